"""The run's memory choices made from its memory plan: ``remat_policy=auto``, ``reference_memory=auto`` and
``teacher_memory=auto``.

Each key trades step time for memory. A remat policy that recomputes less in the backward pass keeps more
activations (``none`` keeps them all, ``full`` only each layer's input); the frozen reference, or a distillation
teacher, in host memory (``pinned_host``) frees its bytes on the devices but crosses the host link at each of its
passes. ``choose`` takes the cheapest setting whose estimated peak (``grpax.plan.memory_estimate``: the fit
check's table with its temporaries from formulas; a remat policy's activations traced from the model's own
autodiff) leaves ``MARGIN`` of the devices' memory free, in this order: the reference and the teacher on the
devices, then the reference in host memory, then the teacher too, and for each placement the remat policies from the least recompute to the most (``REMAT_ORDER``: none, minimal, dots, full). When none
leaves the margin, the setting with the least memory. On CPU: full and the devices (full is also the fastest
there; a CPU process maps the reference from files anyway). A key set to a value other than auto is kept.

``fit_before_run`` then compiles the choice for the run's devices (the fit check,
``compile_check.check_before_run``); if the compiler's plan refuses an auto choice, it tries remat full, then the
reference in host memory, then the teacher, before it stops the run: auto never refuses a job that fits with remat full and the
reference on the devices (what those keys meant before auto). ``check_fit=false`` (no compile to check a choice
against) takes remat full and the devices.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from grpax.errors import ConfigError
from grpax.models.sharding_rules import MESH_AXES
from grpax.plan import compile_check, memory_estimate
from grpax.plan.fit_report import GIB
from grpax.plan.topology import Chip, chip_of, get_topology
from grpax.rl.train_config import REMAT_ORDER, TrainConfig

log = logging.getLogger("grpax.memory_plan")

MARGIN = 0.10  # of the devices' memory left free by an auto choice (the estimate's error and the allocator's)


def _auto(cfg: TrainConfig) -> tuple[bool, bool, bool]:
    """(remat_policy is auto, reference_memory is auto for a reference copy that exists: beta > 0, no LoRA,
    teacher_memory is auto for a teacher that exists: distillation_coef > 0)."""
    copy = cfg.beta > 0 and not cfg.lora_rank
    teacher = cfg.teacher_memory == "auto" and cfg.distillation_coef > 0
    return cfg.remat_policy == "auto", cfg.reference_memory == "auto" and copy, teacher


def _settled(
    cfg: TrainConfig, remat: str | None = None, reference: str | None = None, teacher: str | None = None
) -> TrainConfig:
    """``cfg`` with no auto left: ``remat`` / ``reference`` / ``teacher`` where given, else full / device /
    device for an auto key."""
    auto_remat = _auto(cfg)[0]
    return dataclasses.replace(
        cfg,
        remat_policy=remat or ("full" if auto_remat else cfg.remat_policy),
        reference_memory=reference or ("device" if cfg.reference_memory == "auto" else cfg.reference_memory),
        teacher_memory=teacher or ("device" if cfg.teacher_memory == "auto" else cfg.teacher_memory),
    )


def candidates(cfg: TrainConfig) -> list[TrainConfig]:
    """The settings an auto key may take, cheapest first: the reference, then also the distillation teacher, on
    the devices before host memory (a host copy each step: the smaller first), and for each placement the remat
    policies in ``REMAT_ORDER``; a single one when no key is auto."""
    auto_remat, auto_reference, auto_teacher = _auto(cfg)
    remats = REMAT_ORDER if auto_remat else (None,)
    places = [(None, None)]
    if auto_reference or auto_teacher:
        places = [("device" if auto_reference else None, "device" if auto_teacher else None)]
        if auto_reference:
            places.append(("pinned_host", places[0][1]))
        if auto_teacher:
            places.append((places[-1][0], "pinned_host"))
    return [_settled(cfg, remat, ref, teacher) for ref, teacher in places for remat in remats]


def describe(cfg: TrainConfig, chosen: TrainConfig) -> str:
    """``remat_policy=auto -> dots, reference_memory=auto -> device``: what the auto keys became ('' if none)."""
    keys = ("remat_policy", "reference_memory", "teacher_memory")
    return ", ".join(f"{k}=auto -> {getattr(chosen, k)}" for k in keys if getattr(cfg, k) == "auto")


def choose(
    cfg: TrainConfig, chip: Chip, num_devices: int, platform: str, estimable: bool = True
) -> TrainConfig:
    """``cfg`` with its auto keys chosen from the estimated plan (module docstring).

    Args:
      cfg: the run's keys.
      chip: the devices' figures; its ``hbm_bytes`` is the memory a device may use (a GPU's ``bytes_limit``).
      num_devices: devices of the trainer's mesh, on one host (``memory_estimate``'s meshes).
      platform: "cpu", "gpu" or "tpu".
      estimable: False where the estimate does not cover the job (several processes or slices): the least-memory
        remat (full) and the devices, as the keys meant before auto.
    """
    options = candidates(cfg)
    if len(options) == 1:
        return options[0]
    if platform == "cpu" or not estimable:
        return _settled(cfg)
    peaks = {}
    for option in options:
        try:
            peaks[option] = memory_estimate.estimate_job(option, chip, num_devices, "").peak
        except ConfigError as e:  # keys the estimate does not cover (e.g. rollout_devices): as before auto
            log.info("the memory plan cannot estimate this job (%s): %s", e, describe(cfg, _settled(cfg)))
            return _settled(cfg)
        if peaks[option] <= chip.hbm_bytes * (1 - MARGIN):
            break
    else:  # none leaves the margin: the least memory
        option = min(peaks, key=peaks.get)
    log.info(
        "%s: estimated peak %.2f GiB of %.2f GiB per device (%.0f%%; an auto choice leaves %.0f%% free)",
        describe(cfg, option), peaks[option] / GIB, chip.hbm_bytes / GIB, 100 * peaks[option] / chip.hbm_bytes,
        100 * MARGIN,
    )  # fmt: skip
    return option


def fallbacks(cfg: TrainConfig, chosen: TrainConfig) -> list[TrainConfig]:
    """What to compile when the compiler refuses ``chosen``: remat full (if it was auto), then also the
    reference in host memory, then also the teacher (each if it was auto), the ones that differ from ``chosen``."""
    auto_remat, auto_reference, auto_teacher = _auto(cfg)
    out = [chosen]
    if auto_remat:
        out.append(dataclasses.replace(out[-1], remat_policy="full"))
    if auto_reference:
        out.append(dataclasses.replace(out[-1], reference_memory="pinned_host"))
    if auto_teacher:
        out.append(dataclasses.replace(out[-1], teacher_memory="pinned_host"))
    return [c for i, c in enumerate(out) if i and c != out[i - 1]]


def fit_before_run(cfg: TrainConfig, devices=None, limit: int | None = None) -> TrainConfig:
    """The run's keys with the auto ones chosen, checked by compiling the job for ``devices`` (accelerators).

    Args:
      cfg: the run's keys.
      devices: default ``jax.devices()``.
      limit: bytes per device; default the first device's ``memory_stats()["bytes_limit"]``.

    Returns:
      ``cfg`` with ``remat_policy``, ``reference_memory`` and ``teacher_memory`` settled (no auto left).

    Raises:
      ConfigError: the job does not fit even with the least-memory settings the auto keys allow
        (``compile_check.check_before_run``'s message: what to change).
    """
    devices = list(devices or jax.devices())
    platform = devices[0].platform
    if platform == "cpu" or not cfg.check_fit:  # no compiled check (check_before_run skips these too)
        return _settled(cfg)
    limit = limit or int((devices[0].memory_stats() or {}).get("bytes_limit", 0))
    if not limit:
        compile_check.check_before_run(_settled(cfg), devices, limit)  # it says the check is skipped
        return _settled(cfg)
    chip = chip_of(devices[0].device_kind) or Chip(devices[0].device_kind, limit, 0.0, 0.0, 1)
    chip = dataclasses.replace(chip, hbm_bytes=limit)
    chosen = choose(cfg, chip, len(devices), platform, estimable=jax.process_count() == 1)
    *tries, last = [chosen, *fallbacks(cfg, chosen)]
    for option in tries:
        try:
            compile_check.check_before_run(option, devices, limit)
            return option
        except ConfigError as e:
            if not str(e).startswith("this run does not fit"):
                raise
            log.warning("%s does not fit, the next setting is compiled: %s", describe(cfg, option), e)
    compile_check.check_before_run(last, devices, limit)
    return last


def _traced_for(device):
    """A one-device mesh of ``device`` with the model's axes, set: the estimate's traces of the model then see
    the target's platform (``attention.target_platform``: attention=flash's TPU kernel, traced on a CPU host)."""
    shape = (1,) * len(MESH_AXES)
    return jax.set_mesh(jax.sharding.Mesh(np.asarray([device], dtype=object).reshape(shape), MESH_AXES))


def compile_topology(cfg: TrainConfig) -> int:
    """``grpax train_rl ... compile_topology=NAME``: the auto keys chosen for that target, then its table (an
    NVIDIA estimate, or the job compiled for a TPU slice, the fallbacks compiled where it refuses the choice);
    0 if it fits, else 1."""
    gpus = memory_estimate.gpu_target(cfg.compile_topology)
    if gpus:
        options = [choose(cfg, *gpus, "gpu")]
    else:
        topology = get_topology(cfg.compile_topology, cfg.compile_topology_num_slices, cfg.chips_per_vm or 0)
        with _traced_for(topology.devices[0]):
            chosen = choose(cfg, topology.chip, topology.num_chips, "tpu", estimable=topology.num_slices == 1)
        options = [chosen, *fallbacks(cfg, chosen)]
    for option in options:
        code = memory_estimate.run(option) if gpus else compile_check.run(option)
        if describe(cfg, option):
            print(f"chosen by the memory plan: {describe(cfg, option)}")
        if code == 0:
            break
    return code
