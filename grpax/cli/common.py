"""Helpers shared by the command-line modules: hardware selection and JAX's persistent compilation cache."""

from __future__ import annotations

import glob
import logging
import os

from grpax.config import JAX_CACHE_DIR_HELP, ConfigError  # noqa: F401 - the key's doc, for its users

HARDWARE = ("auto", "cpu", "gpu", "tpu", "gpu_multiprocess")
# Device nodes of attached accelerators: TPU chips (/dev/accel* on v2-v4 and v5e, VFIO groups on v5p and v6e),
# NVIDIA GPUs, AMD GPUs (the ROCm kernel driver).
ACCELERATOR_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
log = logging.getLogger("grpax")


def attached_accelerators() -> list[str]:
    """The accelerator device nodes of this machine (``ACCELERATOR_NODES``), sorted; empty on a CPU-only host."""
    return sorted(path for pattern in ACCELERATOR_NODES for path in glob.glob(pattern))


def select_hardware(hardware: str, attached: list[str] | None = None) -> None:
    """Validates ``hardware`` and sets ``JAX_PLATFORMS`` from it unless the user already set it.

    ``auto`` lets JAX choose (it takes a TPU, then a GPU, then the CPU) where an accelerator is attached
    (``attached``: ``attached_accelerators()`` by default), and pins the CPU where none is, so that a CPU-only
    host with an accelerator's runtime installed (``libtpu`` from ``jax[tpu]``) starts at once and quietly
    instead of probing for a chip. Must run before JAX initialises a backend.

    Raises:
      ConfigError: if ``hardware`` is not one of ``HARDWARE``.
    """
    if hardware not in HARDWARE:
        raise ConfigError(f"hardware={hardware!r}: expected one of {', '.join(HARDWARE)}")
    if os.environ.get("JAX_PLATFORMS"):
        return
    if hardware == "auto":
        if not (attached_accelerators() if attached is None else attached):
            os.environ["JAX_PLATFORMS"] = "cpu"
        return
    os.environ["JAX_PLATFORMS"] = "cuda" if hardware in ("gpu", "gpu_multiprocess") else hardware


XLA_OPTIMIZATION_LEVELS = ("auto", "O0", "O1", "O2", "O3")


def set_optimization_level(level: str) -> None:
    """Sets XLA's optimization level of every later compile (JAX's ``jax_optimization_level``) from the key
    ``xla_optimization_level`` (``grpax.config.XLA_OPTIMIZATION_LEVEL_HELP``); ``auto`` leaves JAX's own setting.
    The level is part of a program's compile options, so JAX's persistent cache keeps each level apart, and of
    the fit check's kept figures (``grpax.plan.figures_cache``). Call it before the first compile.

    Raises:
      ConfigError: if ``level`` is not one of ``XLA_OPTIMIZATION_LEVELS``.
    """
    if level not in XLA_OPTIMIZATION_LEVELS:
        raise ConfigError(
            f"xla_optimization_level={level!r}: expected one of {', '.join(XLA_OPTIMIZATION_LEVELS)} "
            "(auto = the compiler's default)"
        )
    if level != "auto":
        import jax

        jax.config.update("jax_optimization_level", level)


def describe_devices() -> str:
    """One line naming the platform, device kind and count a command runs on, e.g. ``tpu: 1 x TPU v5 lite``
    (``4 x NVIDIA H100 80GB HBM3 on 2 hosts`` over several processes)."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    hosts = f" on {jax.process_count()} hosts" if jax.process_count() > 1 else ""
    return f"{devices[0].platform}: {len(devices)} x {', '.join(kinds)}{hosts}"


def compilation_cache_dir(jax_cache_dir: str) -> str | None:
    """The folder of JAX's persistent compilation cache for the key ``jax_cache_dir`` (``JAX_CACHE_DIR_HELP``);
    None when it is off."""
    if not jax_cache_dir.strip():
        return None
    if jax_cache_dir == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "grpax", "jax")
    return os.path.expanduser(jax_cache_dir)


def enable_compilation_cache(jax_cache_dir: str) -> str | None:
    """Points JAX's persistent compilation cache at ``compilation_cache_dir(jax_cache_dir)`` (None: off).

    Call it before the first compilation (JAX reads the folder once). On CPU JAX keeps programs that took at
    least ``jax_persistent_cache_min_compile_time_secs`` (1 s) to compile; on an accelerator every program (its
    small ones too, each a compile of a tenth of a second or more there), so that a second run of the same keys
    compiles nothing. A folder that cannot be created turns the cache off with one warning: a run never fails
    for its cache.

    Returns:
      The folder in use, or None.
    """
    import jax

    path = compilation_cache_dir(jax_cache_dir)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            log.warning(
                "jax_cache_dir=%s: cannot create %s (%s): no compilation cache", jax_cache_dir, path, e
            )
            path = None
    jax.config.update("jax_compilation_cache_dir", path)
    if path is not None and jax.default_backend() != "cpu":
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
