"""TPU slices by name (``v6e-8``, ``v5p-8``, ...) as JAX devices without the hardware, and each chip's peaks.

JAX compiles for a TPU topology on a machine with no TPU: ``libtpu`` (the ``tpu`` extra) describes a slice's
devices (``jax.experimental.topologies.get_topology_desc``, even under ``JAX_PLATFORMS=cpu``), and a jit lowered
over ``jax.ShapeDtypeStruct``s sharded on a mesh of them runs the real TPU compiler. MaxText's
``train_compile.py`` does this for pre-training with the same key names (``compile_topology``,
``compile_topology_num_slices``); ``grpax.plan.compile_check`` does it for a whole GRPO job.

Slice names count chips for v5e and v6e (``v6e-8``: 8 chips, 2x4) and TensorCores for v4 and v5p (``v5p-8``:
4 chips, 2x2x1), as Google Cloud names them. The chip figures (HBM, bf16 dense FLOP/s, HBM bandwidth) are
Google Cloud's published per-chip specifications (ICI: the per-chip inter-chip interconnect bandwidth).
"""

from __future__ import annotations

import dataclasses
import math
import os

from grpax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published figures."""

    name: str  # what the tables print, e.g. "TPU v6e"
    hbm_bytes: int  # HBM per chip
    peak_flops: float  # bf16 dense FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    chips_per_host: int  # chips of one host (VM) in a multi-host slice
    ici_bandwidth: float = 0.0  # bytes/s per chip over the inter-chip interconnect, all links together
    host_bandwidth: float = 0.0  # bytes/s per chip from its host (PCIe), one direction; 0: not published here


GIB = 2**30
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, 1.228e12, 4, 2400e9 / 8),  # ICI 2,400 Gbps
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 0.819e12, 4, 1600e9 / 8),  # 1,600 Gbps
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2.765e12, 4, 4800e9 / 8),  # 4,800 Gbps
    "v6e": Chip("TPU v6e", 32 * GIB, 918e12, 1.64e12, 4, 3584e9 / 8),  # 3,584 Gbps
}
# Slice name -> chip grid. v5e / v6e names count chips, v4 / v5p names count TensorCores (2 per chip).
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRIDS_3D = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8"}
TOPOLOGIES: dict[str, tuple[str, str]] = {
    **{f"{g}-{n}": (g, f"{g}:{grid}") for g in ("v5e", "v6e") for n, grid in _GRIDS_2D.items()},
    **{f"{g}-{n}": (g, f"{g}:{grid}") for g in ("v4", "v5p") for n, grid in _GRIDS_3D.items()},
}
SINGLE_HOST_MAX = 8  # v5e / v6e slices of up to 8 chips are one VM (ct5lp-/ct6e-standard-8t)


# jax's device_kind of each generation's chips.
_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                 "TPU v6 lite": "v6e", "TPU v6e": "v6e"}  # fmt: skip


def chip_of(device_kind: str) -> Chip | None:
    """The ``Chip`` of a JAX device's ``device_kind`` (e.g. "TPU v6 lite"), or None for any other device."""
    generation = _DEVICE_KINDS.get(device_kind)
    return CHIPS[generation] if generation else None


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named TPU slice (or several): its devices for compilation, its chip and its shape."""

    name: str  # as given, e.g. "v6e-8"
    chip: Chip
    devices: tuple  # jax TPU devices (compile-only), num_slices x chips
    num_slices: int
    chips_per_host: int

    @property
    def num_chips(self) -> int:
        return len(self.devices)


def _grid(name: str) -> tuple[str, str]:
    """(generation, libtpu topology name "v6e:2x4") of a slice name; raises naming the known ones.

    Case is ignored, and Google Cloud's accelerator type for v5e (``v5litepod-8``) is its ``v5e-8``.
    """
    key = name.lower().replace("v5litepod-", "v5e-")
    if key in TOPOLOGIES:
        return TOPOLOGIES[key]
    generation, _, grid = name.partition(":")
    dims = grid.split("x")
    if generation in CHIPS and grid and all(d.isdigit() and int(d) > 0 for d in dims) and len(dims) in (2, 3):
        return generation, name
    raise ConfigError(
        f"compile_topology={name!r} is not a known TPU slice: use one of {', '.join(TOPOLOGIES)} "
        f"or a chip grid such as v6e:2x4 ({', '.join(CHIPS)})"
    )


def get_topology(name: str, num_slices: int = 1, chips_per_vm: int = 0):
    """The devices of ``num_slices`` TPU slices named ``name``, for compilation only (no TPU needed).

    Args:
      name: a slice name (``v6e-8``, ``v5e-16``, ``v5p-8``; ``TOPOLOGIES``) or a chip grid (``v6e:2x4``).
      num_slices: slices joined over DCN (MaxText ``compile_topology_num_slices``).
      chips_per_vm: chips per host; 0 = the slice's own (single-host v5e / v6e slices up to 8 chips, else 4).

    Returns:
      A ``Topology``.

    Raises:
      ConfigError: an unknown name, a bad slice count or chips_per_vm, or no ``libtpu`` (the ``tpu`` extra).
    """
    generation, tpu_name = _grid(name)
    chip = CHIPS[generation]
    if num_slices < 1:
        raise ConfigError(f"compile_topology_num_slices={num_slices}: expected >= 1")
    dims = [int(d) for d in tpu_name.split(":")[1].split("x")]
    chips = math.prod(dims)
    default = chips if generation in ("v5e", "v6e") and chips <= SINGLE_HOST_MAX else min(chips, 4)
    per_host = chips_per_vm or default
    host_bounds = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}.get(per_host)
    tiles = host_bounds is not None and not chips % per_host
    tiles = tiles and all(d % b == 0 for d, b in zip(dims, host_bounds, strict=False))
    if not tiles and not chips_per_vm:
        raise ConfigError(
            f"compile_topology={name!r}: {generation} hosts hold "
            f"{'1, 4 or 8 chips (1x1, 2x2, 2x4)' if generation in ('v5e', 'v6e') else '4 chips (2x2x1)'}, "
            f"which do not tile {tpu_name}; use a slice name such as {generation}-8 or a grid of whole hosts"
        )
    if not tiles:
        raise ConfigError(
            f"chips_per_vm={chips_per_vm}: a {name} slice ({tpu_name}) has hosts of "
            f"{'1, 4 or 8' if generation in ('v5e', 'v6e') else '4'} chips; pass chips_per_vm={default} or 0"
        )
    try:
        import libtpu  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise ConfigError(
            f'compile_topology={name} needs libtpu: pip install -e ".[tpu]" (the tpu extra; no TPU is needed)'
        ) from None
    from jax.experimental import topologies

    # Compiling needs no TPU: skip libtpu's probe of the cloud metadata server and its one-process-per-host lock
    # (held by any other JAX process on this machine that loaded libtpu).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(
        topology_name=tpu_name,
        platform="tpu",
        # v4's "default" is one device per TensorCore (2 per chip), which jax's mesh builder refuses; "megacore"
        # is one per chip, as v5p's "default" already is (MaxText's train_compile uses megacore for v4 too).
        chip_config_name="megacore" if generation == "v4" else "default",
        chips_per_host_bounds=host_bounds,
        num_slices=num_slices,
        wrap=(False, False, False),
    )
    return Topology(name, chip, tuple(desc.devices), num_slices, per_host)
