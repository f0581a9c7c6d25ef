"""Compile a whole GRPO job for its devices, or for a TPU slice that is not here, and say whether it fits.

``grpax train_rl <keys> compile_topology=v6e-8`` builds every array of the run abstractly (``ShapeDtypeStruct``s:
no weight is read or allocated), places them with the run's own mesh keys and sharding rules on the slice's
devices (``grpax.plan.topology``), and compiles the run's own functions with the real TPU compiler: the GRPO update
(``make_run_update``, the trainer's own builder: micro-batches, remat), the reference logprobs
(``token_logprobs``) and the sampler's prefill and decode loop on the rollout mesh. Each compiled
function's ``memory_analysis()`` gives its per-chip arguments, outputs, aliases and temporaries; the table
adds what stays resident (params, optimizer state, reference params) to the largest phase. With LoRA
(``lora_rank > 0``, ``grpax.rl.policy``) the update compiled is the adapters' (the frozen base an argument, never
donated; optimizer state for the adapters only), the reference pass reads the base itself (no reference copy), and
the sampler reads what ``lora_sampler`` picks (``grpax.rl.policy.sampler_mode``; auto: adapters on a TPU or
GPU): with ``merged`` the merge is compiled too and its merged weights are counted while the rollout and the
reference pass hold them; with ``adapters`` the prefill and decode are compiled on the base with its adapters
(``lora.apply``: no merged copy, no merge). The same check runs
before a real run on an accelerator (``check_before_run``), against the device's memory limit; its arrays are
placed as the trainer places its own, so the programs it compiles are the run's and go to JAX's persistent
compilation cache (``jax_cache_dir``): the run's first update reads its program back instead of compiling it
again (tests/test_compile_cache.py). MaxText's
``train_compile.py`` does this for pre-training; this follows its keys.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpax import sharding
from grpax.config import ConfigError
from grpax.models import lora as lora_lib
from grpax.models import quantize as quant
from grpax.models.llama import round_as_read
from grpax.models.moe import route_dtype
from grpax.models.params import abstract_params, layer_specs
from grpax.models.registry import ModelConfig, find_hf_config, get_model_config, load_hf_config
from grpax.plan import figures_cache
from grpax.plan.collectives import count_collectives, fsdp_minimum
from grpax.plan.fit_report import GIB, Compiled, Report, format_report, suggestions
from grpax.plan.step_cost import Phase, StepShape, step_phases
from grpax.plan.topology import chip_of, get_topology
from grpax.rl.batch import Batch
from grpax.rl.policy import merge_adapters, sampler_mode
from grpax.rl.teacher import check_same_vocabulary, teacher_name
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import TrainState, logprobs_program, make_run_update
from grpax.sampler import paging, program_set
from grpax.sampler.backend import select_backend
from grpax.sharding import per_chip_bytes

log = logging.getLogger("grpax.compile_check")


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The run's model: the checkpoint's config.json when there is one, else the registered ``model_name``."""
    runtime = cfg.model_keys()
    found = find_hf_config(cfg.load_parameters_path) if cfg.load_parameters_path else None
    if found is not None:
        return load_hf_config(found, **runtime)
    if not cfg.model_name:
        where = (
            f"load_parameters_path={cfg.load_parameters_path} has no config.json at or above it"
            if cfg.load_parameters_path
            else "no load_parameters_path"
        )
        raise ConfigError(
            f"compile_topology needs the model's shapes and {where}: pass model_name=<a registered model> "
            "or the load_parameters_path of a converted checkpoint (<base>/0/items, config.json in <base>)"
        )
    path = cfg.load_parameters_path
    if path and "://" not in path and not Path(path).exists():  # a typo would compile model_name's shapes
        raise ConfigError(
            f"load_parameters_path={path} does not exist; fix the path, or leave it out to compile the "
            "registered model_name's shapes"
        )
    if path:
        log.warning("no config.json at or above %s: compiling model_name=%s's shapes", path, cfg.model_name)
    return get_model_config(cfg.model_name, **runtime)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def teacher_model_config(cfg: TrainConfig) -> ModelConfig | None:
    """The distillation teacher's model (``distillation_coef`` > 0), as ``model_config`` reads the student's: its
    checkpoint's config.json, else the registered ``teacher_model_name`` (default ``model_name``); else None."""
    if cfg.distillation_coef <= 0:
        return None
    found = find_hf_config(cfg.teacher_parameters_path) if cfg.teacher_parameters_path else None
    if found is not None:
        return load_hf_config(found, **cfg.model_keys())
    if not teacher_name(cfg):
        raise ConfigError(
            "compile_topology with distillation_coef > 0 needs the teacher's shapes: pass teacher_model_name=<a "
            "registered model> or the teacher_parameters_path of a converted checkpoint"
        )
    return get_model_config(teacher_name(cfg), **cfg.model_keys())


def abstract_teacher(teacher_cfg: ModelConfig, mesh):
    """The teacher's params as the trainer holds them (``grpax.rl.teacher.load_teacher``): placed by the rules
    table, rounded as the forward reads them."""
    params = _abstract(abstract_params(teacher_cfg), sharding.param_shardings(teacher_cfg, mesh))
    return round_as_read(params, teacher_cfg)


def _batch(cfg: TrainConfig, mesh, with_ref: bool, model_cfg: ModelConfig | None = None) -> Batch:
    """The update's batch as the trainer's ``Rollout`` builds it, at the longest prompt bucket (with a mixture of
    experts' recorded routing under ``router_replay``)."""
    placed = lambda shape: sharding.batch_sharding(np.broadcast_to(np.int8(0), shape), mesh)  # noqa: E731
    routes = None
    if cfg.router_replay != "none" and model_cfg is not None and model_cfg.num_experts:
        routes = (model_cfg.num_layers, model_cfg.num_experts_per_tok, route_dtype(model_cfg.num_experts))
    return Batch.abstract(
        cfg.batch_size,
        cfg.num_generations,
        cfg.max_prefill_predict_length,
        cfg.max_completion_length,
        with_ref=with_ref,
        with_old=cfg.needs_old_logprobs,
        with_teacher=cfg.distillation_coef > 0,
        sharding_of=placed,
        routes=routes,
    )


# The TPU compiler refuses a program whose memory exceeds HBM: "... HLO temporaries (202.67G) exceeds ...". The
# figure is the program's whole peak, its arguments included, not its temporaries: on v6e-8 a program with a
# donated 20 GiB argument and 16 GiB of temporaries (16.00 when a 4 GiB argument lets it compile) is refused
# with "(36.00G)" (tests/test_compile_check.py), and Qwen3-30B-A3B's update of 24 and 48 layers with
# "(32.94G)" and "(64.35G)" beside 21.76 and 42.66 GiB of arguments (docs/scaling.md).
_OVER_HBM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\)")


def _compile(
    name: str, num_devices: int, fn, *args, options: tuple = (), **kwargs
) -> tuple[Compiled, jax.stages.Compiled | None]:
    """Lowers and compiles ``fn`` for its abstract arguments on ``num_devices``; (its memory and collectives,
    the executable or None if refused). ``options``: the compiler options ``fn`` was jitted with."""
    start = time.perf_counter()
    lowered = fn.lower(*args, **kwargs)
    key = figures_cache.program_key(lowered, _devices_of((args, kwargs)), options)
    kept = figures_cache.read(key)
    if kept is not None:  # the same program compiled before: its figures, no compile (figures_cache)
        kept = dataclasses.replace(kept, name=name, seconds=time.perf_counter() - start)
        log.info(
            "%s: the figures of the same program compiled before (%s), no compile", name, figures_cache.FOLDER
        )
        return kept, None
    log.info("compiling %s ...", name)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        match = _OVER_HBM.search(str(e))
        if match is None:
            raise
        required = int(float(match.group(1)) * 1024 ** " KMGT".index(match.group(2) or " "))
        leaves = jax.tree.leaves((args, kwargs))
        arguments = per_chip_bytes([x for x in leaves if isinstance(x, jax.ShapeDtypeStruct)])
        log.warning("%s does not compile: %s", name, str(e).splitlines()[0])
        seconds = time.perf_counter() - start
        # the refused figure counts the arguments too (_OVER_HBM): its temporaries are the rest
        temporaries = max(required - arguments, 0)
        return Compiled(name, arguments, 0, 0, temporaries, seconds, over_hbm=True), None
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    sizes = (memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes)
    collectives, unknown = count_collectives(compiled.as_text(), num_devices)
    # its figures as soon as it compiles: a long job's table comes only after its last function
    log.info(
        "compiled %s in %.1f s: temporaries %.2f GiB, arguments %.2f GiB, collectives %.2f GB per chip",
        name, seconds, memory.temp_size_in_bytes / GIB, memory.argument_size_in_bytes / GIB,
        sum(c.bytes_per_chip for c in collectives.values()) / 1e9,
    )  # fmt: skip
    if unknown:
        log.warning("%s: %d loops of unknown trip count, their collectives counted once", name, unknown)
    c = Compiled(
        name, *(int(x) for x in sizes), int(memory.temp_size_in_bytes), seconds, collectives=collectives
    )
    figures_cache.write(key, c)
    return c, compiled


def _devices_of(tree) -> list:
    """The devices of the first sharded leaf of ``tree`` (abstract arguments), else ``jax.devices()``."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and hasattr(sharding, "device_set"):
            return sorted(sharding.device_set, key=lambda d: d.id)
    return jax.devices()


def _extra(c: Compiled, counted: int) -> int:
    """Bytes a function adds beyond arguments already counted: other arguments, temporaries, new outputs."""
    return c.arguments - counted + c.temporaries + c.outputs - c.aliased


@dataclasses.dataclass
class Job:
    """The run's arrays, abstract and placed on its meshes: what ``compile_job`` compiles and
    ``grpax.plan.memory_estimate`` sizes by formula."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    mesh: Any
    rollout_mesh: Any
    optimizer: Any
    lr_schedule: Any
    state: TrainState  # the trained tree: the params, or with LoRA the adapters (float32)
    batch: dict
    rollout_params: Any
    sampler_cfg: Any
    resident: dict[str, int]  # bytes per chip of what stays for the whole step (table rows, in order)
    rollout_copy: int  # the params copied to the sampler's layout (0 when it is the trainer's)
    kv_cache: int  # the rollout engine's KV page pool (``paging.abstract_pool``), per chip
    shape: StepShape
    lora: lora_lib.LoraConfig | None = None
    base: Any = None  # LoRA: the frozen base params on the trainer's mesh (also the reference)
    merged_copy: int = 0  # LoRA: the merged weights the rollout samples with (``lora.merge``), per chip
    sampler: str = ""  # LoRA: what the sampler reads, "merged" or "adapters" (``policy.sampler_mode``)
    dense_base: Any = (
        None  # LoRA: the base unquantised (QLoRA's ``base`` is quantised), on the trainer's mesh
    )
    reference: Any = None  # beta > 0, full fine-tune: the frozen reference's copy as the trainer stores it
    reference_on_host: bool = False  # that copy in host memory (``reference_memory=pinned_host``)
    train_step: Any = (
        None  # the run's jitted update (``train_step.make_run_update``, as the trainer builds it)
    )
    num_pages: int = 0  # pages in that pool (``paging.pool_pages``), of ``sampler_cfg.page_size`` tokens
    sampler_backend: Any = None  # ``select_backend``'s choice for the rollout params: who runs the engine
    teacher: Any = None  # distillation_coef > 0: the teacher's params as the trainer holds them
    teacher_cfg: ModelConfig | None = None  # its model
    compiler_options: tuple = ()  # the update's and logprob passes' (``TrainConfig.training_compile_options``)

    @property
    def teacher_on_host(self) -> bool:
        """A teacher that lives in host memory (``teacher_memory=pinned_host``), on the devices for its pass."""
        return self.teacher is not None and self.cfg.teacher_on_host


# Table rows of a LoRA job's resident arrays (``Job.resident``).
BASE_ROW = "base weights (frozen; the reference too)"
ADAPTERS_ROW = "adapters (float32)"
ADAPTER_OPT_ROW = "adapter optimizer state"
NO_REFERENCE_ROW = "reference copy: none (the base, adapters off)"
REFERENCE_ON_HOST_ROW = "reference params: in host memory (pinned_host)"
TEACHER_ON_HOST_ROW = "teacher params: in host memory (pinned_host)"


def base_bytes_per_param(cfg: TrainConfig, model_cfg: ModelConfig) -> float:
    """Bytes per parameter of a layer's projection weights the run holds frozen (LoRA's base) or trains:
    ``weight_dtype``'s (a full fine-tune), QLoRA's (``lora_base_dtype``): int8 1 (its float32 scale per output
    channel, 4 / in bytes a value, left out), nf4 0.5 + one float32 scale per block of ``quantize.NF4_BLOCK``
    values, or LoRA's frozen base rounded as read (``lora.frozen_base``: the narrower of weight_dtype and dtype)."""
    if cfg.lora_rank and cfg.lora_base_dtype == "int8":
        return 1.0
    if cfg.lora_rank and cfg.lora_base_dtype == "nf4":
        return 0.5 + 4 / quant.NF4_BLOCK
    stored = jnp.dtype(model_cfg.weight_dtype).itemsize
    return min(stored, jnp.dtype(model_cfg.dtype).itemsize) if cfg.lora_rank else stored


def _abstract_adapters(model_cfg: ModelConfig, lora: lora_lib.LoraConfig, mesh):
    """The adapters as ``Policy.init_trainable`` places them: the adapted weight's logical axes, rank
    replicated."""
    shapes = jax.eval_shape(lambda: lora_lib.init_adapters(model_cfg, lora, jax.random.key(0)))
    axes = lora_lib.adapter_logical_axes(model_cfg, lora)
    return _abstract(shapes, sharding.logical_to_sharding(axes, mesh, shapes=shapes))


def _same_layout(a, b) -> bool:
    if isinstance(a.sharding.mesh, jax.sharding.AbstractMesh):
        return (
            dict(a.sharding.mesh.shape) == dict(b.sharding.mesh.shape) and a.sharding.spec == b.sharding.spec
        )
    return a.sharding.is_equivalent_to(b.sharding, len(a.shape))


def largest_leaf(tree):
    """The leaf of ``tree`` with the most elements."""
    return max(jax.tree.leaves(tree), key=lambda x: math.prod(x.shape))


def _platform(mesh) -> str:
    """The platform of ``mesh``'s devices; an ``AbstractMesh`` is the NVIDIA estimate's: "gpu"."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return "gpu"
    return mesh.devices.flat[0].platform


def _rounded(tree, compute_dtype):
    """``tree``'s ``ShapeDtypeStruct``s with wider floats rounded to ``compute_dtype`` (``reshard_for_rollout``;
    a QLoRA weight's codes and scales are copied as they are)."""
    quantised = lambda x: isinstance(x, quant.QuantizedWeight)  # noqa: E731
    return jax.tree.map(
        lambda x: (
            x
            if quantised(x)
            else jax.ShapeDtypeStruct(
                x.shape, sharding.rounded_dtype(x.dtype, compute_dtype), sharding=x.sharding
            )
        ),
        tree,
        is_leaf=quantised,
    )


def build_job(cfg: TrainConfig, mesh, rollout_mesh, model_cfg: ModelConfig | None = None) -> Job:
    """Every array of the run as a ``ShapeDtypeStruct`` placed by the rules table on the trainer's and the
    sampler's meshes (device meshes or ``jax.sharding.AbstractMesh``es); ``model_cfg`` default
    ``model_config(cfg)``."""
    model_cfg = model_cfg or model_config(cfg)
    grpo, lora = cfg.grpo(), cfg.lora()
    sampler = "" if lora is None else sampler_mode(cfg.lora_sampler, _platform(mesh), model_cfg.dtype)
    shapes = abstract_params(model_cfg)
    params = _abstract(shapes, sharding.param_shardings(model_cfg, mesh))
    # LoRA's frozen base as Policy holds it (lora.frozen_base: QLoRA's projections quantised, the rest rounded)
    base = lora_lib.frozen_base(params, cfg.lora_base_dtype, model_cfg) if lora is not None else params
    # What the optimizer trains: the params, or the float32 adapters beside the frozen base (trainer._init_state).
    trainable = params if lora is None else _abstract_adapters(model_cfg, lora, mesh)
    # The run's own optimizer and update (the trainer builds them with the same call); LoRA's base is an argument
    # of the compiled update (``train_step.func``), not bound.
    options = cfg.training_compile_options(model_cfg, _platform(mesh), mesh.size)
    optimizer, lr_schedule, train_step = make_run_update(
        grpo, model_cfg, cfg.num_batches, cfg.micro_batches, cfg.max_completion_length, lora=lora,
        compiler_options=options,
    )  # fmt: skip
    opt_shapes = jax.eval_shape(optimizer.init, trainable)
    opt_state = _abstract(opt_shapes, sharding.optimizer_state_shardings(optimizer, trainable, mesh))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    with_ref = grpo.beta > 0
    resident, reference, merged_copy = _resident(cfg, model_cfg, params, base, trainable, opt_state, sampler)
    teacher_cfg, teacher = teacher_model_config(cfg), None
    if teacher_cfg is not None:
        check_same_vocabulary(teacher_cfg, None, model_cfg, None)  # the checkpoints' are the run's to check
        teacher = abstract_teacher(teacher_cfg, mesh)
        # on the devices for the whole run (a CPU host maps it, but plans are for chips), or in host memory
        # (teacher_memory=pinned_host): on the devices during its own pass only
        if cfg.teacher_on_host:
            resident[TEACHER_ON_HOST_ROW] = 0
        else:
            resident["teacher params"] = per_chip_bytes(teacher)
    # What the sampler reads, on the trainer's mesh: the params, the merged weights (placed as the base), or
    # the base with its adapters.
    sampled = params if sampler != "adapters" else lora_lib.apply(base, trainable, lora)
    if grpo.max_staleness > 0:  # grpax.rl.ahead: each version a rollout ahead needs is a copy of all of it
        resident[f"params versions for rollouts ahead ({grpo.max_staleness + 1})"] = (
            grpo.max_staleness + 1
        ) * per_chip_bytes(sampled)
        merged_copy = 0  # the versions are the merged weights
    rollout_params, same = _rollout_params(cfg, model_cfg, rollout_mesh, sampled, sampler)
    stops = model_cfg.eos_token_ids or (0,)  # the tokenizer's ids do not change any shape
    sc = dataclasses.replace(cfg.sampler_config(stops, stops[0]), backend="xla")
    backend = select_backend(sc.backend, rollout_params, model_cfg, sc.cache_dtype, concrete=False)
    slots = sc.decode_slots(cfg.batch_size * grpo.num_generations)
    num_pages = paging.pool_pages(sc, slots)
    kv_cache = per_chip_bytes(paging.abstract_pool(rollout_params, model_cfg, sc, backend, num_pages))
    L = model_cfg.num_layers
    adapter_params = 0 if lora is None else sum(math.prod(x.shape) for x in jax.tree.leaves(trainable))
    specs = layer_specs(model_cfg)
    targets = () if lora is None else lora_lib.adapted_weights(model_cfg, lora)
    adapted = L * sum(math.prod(specs[w][0]) for w in targets)
    shape = StepShape(
        cfg.batch_size, grpo.num_generations, cfg.max_prefill_predict_length, cfg.max_completion_length,
        cfg.micro_batches, grpo.num_iterations, with_ref, grpo.needs_old_logprobs,
        adapter_params, adapted, 0 if lora is None else lora.rank, sampler == "adapters",
        reference_dtype="" if reference is None else str(largest_leaf(reference).dtype),
        decode_slots=slots, sampler=sc, reads_filled_pages=backend.reads_filled_pages,
    )  # fmt: skip
    return Job(
        cfg, model_cfg, mesh, rollout_mesh, optimizer, lr_schedule,
        TrainState(params=trainable, opt_state=opt_state, step=step), _batch(cfg, mesh, with_ref, model_cfg), rollout_params,
        sc, resident, 0 if same else per_chip_bytes(rollout_params), kv_cache, shape,
        lora, None if lora is None else base, merged_copy, sampler, None if lora is None else params, reference,
        reference is not None and cfg.reference_on_host, train_step, num_pages, backend, teacher, teacher_cfg,
        options,
    )  # fmt: skip


def _resident(cfg: TrainConfig, model_cfg: ModelConfig, params, base, trainable, opt_state, sampler: str):
    """What stays on each chip for the whole step (table rows, bytes per chip), the frozen reference's copy
    (full fine-tune with beta > 0: rounded as read with ``reference_dtype=compute``; else None) and the merged
    weights LoRA's merged sampler holds (bytes per chip)."""
    if cfg.lora_rank == 0:
        resident = {"params": per_chip_bytes(params), "optimizer state": per_chip_bytes(opt_state) + 4}
        if cfg.beta <= 0:
            return resident, None, 0
        # the state is donated: the reference is a copy (trainer._reference), rounded as read
        reference = round_as_read(params, model_cfg) if cfg.reference_dtype == "compute" else params
        if cfg.reference_on_host:  # on the devices only during its pass (a phase's bytes)
            resident[REFERENCE_ON_HOST_ROW] = 0
        else:
            resident["reference params"] = per_chip_bytes(reference)
        return resident, reference, 0
    resident = {
        BASE_ROW: per_chip_bytes(base),
        ADAPTERS_ROW: per_chip_bytes(trainable),
        ADAPTER_OPT_ROW: per_chip_bytes(opt_state) + 4,
    }
    if cfg.beta > 0:
        resident[NO_REFERENCE_ROW] = 0
    # Policy.sampler_params: jitted lora.merge returns every weight anew (the adapted ones merged; QLoRA's
    # dequantised, in weight_dtype), placed as the base; it lives from the rollout to the reference pass
    # (Rollout.update_params(None) after). The adapters sampler reads the base and the adapters as they are
    # (lora.apply): no copy.
    return resident, None, per_chip_bytes(params) if sampler == "merged" else 0


def _rollout_params(cfg: TrainConfig, model_cfg: ModelConfig, rollout_mesh, sampled, sampler: str):
    """What the sampler reads on its mesh, and whether that is the trainer's arrays themselves (the same layout:
    no copy) rather than ``reshard_for_rollout``'s copy rounded to the compute dtype."""
    lora, qtype = cfg.lora(), cfg.lora_base_dtype if cfg.lora_rank else ""
    shapes = abstract_params(model_cfg)
    rollout_params = _abstract(shapes, sharding.param_shardings(model_cfg, rollout_mesh))
    if sampler == "adapters":
        rollout_base = lora_lib.frozen_base(rollout_params, qtype, model_cfg)
        rollout_params = lora_lib.apply(rollout_base, _abstract_adapters(model_cfg, lora, rollout_mesh), lora)
    same = all(
        _same_layout(a, b)
        for a, b in zip(jax.tree.leaves(sampled), jax.tree.leaves(rollout_params), strict=True)
    )
    if same:
        return sampled, True  # the sampler reads the trainer's arrays (the adapters: float32)
    return _rounded(rollout_params, model_cfg.dtype), False


HOST_COPY_PHASE = "reference from host"
TEACHER_COPY_PHASE = "teacher from host"


def step_count(
    job: Job, num_chips: int, peak_flops: float | None, bandwidth: float | None, host_bandwidth: float = 0.0
) -> list:
    """The counted phases of one step (``grpax.plan.step_cost``); [] without the chip's peaks (None or 0).

    A reference held in host memory adds its copy to the devices before each reference pass
    (``HOST_COPY_PHASE``), a teacher there its own before the teacher's pass (``TEACHER_COPY_PHASE``), at
    ``host_bandwidth`` (bytes/s per chip; 0: not published, counted as 0 s)."""
    if not peak_flops:
        return []
    mesh, rollout = dict(job.mesh.shape), dict(job.rollout_mesh.shape)
    phases = step_phases(
        job.model_cfg, job.shape, num_chips, mesh["tensor"], rollout["tensor"], rollout["data"], peak_flops,
        bandwidth, trainer_expert=mesh["expert"], rollout_expert=rollout["expert"], teacher=job.teacher_cfg,
    )  # fmt: skip
    if job.reference_on_host:
        copied = per_chip_bytes(job.reference)
        seconds = copied / host_bandwidth if host_bandwidth else 0.0
        phases.insert(-job.shape.num_iterations, Phase(HOST_COPY_PHASE, 0.0, copied, seconds))
    if job.teacher_on_host:
        copied = per_chip_bytes(job.teacher)
        at = [p.name for p in phases].index("teacher logprobs")
        phases.insert(
            at, Phase(TEACHER_COPY_PHASE, 0.0, copied, copied / host_bandwidth if host_bandwidth else 0.0)
        )
    return phases


def compile_job(
    cfg: TrainConfig,
    devices,
    target: str,
    hbm: int,
    peak_flops: float | None,
    bandwidth: float | None,
    ici_bandwidth: float = 0.0,
    model_cfg: ModelConfig | None = None,
    host_bandwidth: float = 0.0,
    evaluation: bool = False,
) -> Report:
    """Compiles the run's update, reference pass, prefill and decode for ``devices``; returns the per-chip table.

    Args:
      cfg: the run's keys.
      devices: the devices of the meshes (a TPU topology's, or ``jax.devices()``).
      target: what the table's title calls them; hbm: bytes per chip; peak_flops, bandwidth: per chip (None:
        no step count); ici_bandwidth: bytes/s per chip between chips (0: no ICI time).
      model_cfg: the model (default ``model_config(cfg)``: the checkpoint's config.json or ``model_name``).
      host_bandwidth: bytes/s per chip to and from its host (0: unknown), for a reference in host memory.
      evaluation: also compile the evaluation's programs where the sampler's program set is fixed (a run's
        check on its own devices: the run then obtains every program it needs from here).

    Raises:
      ConfigError: mesh keys that do not fit the devices (``grpax.sharding``).
    """
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)  # checked against the topology by the caller
    job = build_job(cfg, *sharding.create_meshes(mesh_cfg, devices), model_cfg)
    functions: dict[str, Compiled] = {}
    phases: dict[str, int] = {}
    with jax.set_mesh(job.mesh):
        _compile_update(job, len(devices), functions, phases)
        _compile_reference(job, len(devices), functions, phases)
        _compile_teacher(job, len(devices), functions, phases)
    _compile_sampler(job, len(devices), functions, phases)
    if evaluation:
        _compile_evaluation(job, len(devices))
    flops = step_count(job, len(devices), peak_flops, bandwidth, host_bandwidth)
    return Report(
        target, hbm, job.resident, job.kv_cache, job.rollout_copy, functions, phases, flops,
        kv_pool=(job.num_pages, job.sampler_cfg.page_size),
        rollout_chips=cfg.rollout_devices,
        ici_bandwidth=ici_bandwidth,
        merged_copy=job.merged_copy,
        num_experts=job.model_cfg.num_experts,
    )  # fmt: skip


def _forward_params(job: Job):
    """The weights the forward reads: the params, or LoRA's frozen base."""
    return job.state.params if job.lora is None else job.base


def _fsdp_minimum(job: Job, passes: int, grads: bool) -> float:
    """FSDP's least all-gather / reduce-scatter traffic per chip for ``passes`` passes over the weights."""
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(job.dense_base or _forward_params(job)))
    mesh, itemsize = dict(job.mesh.shape), jnp.dtype(job.model_cfg.dtype).itemsize
    return fsdp_minimum(num_params, itemsize, mesh["fsdp"], mesh["tensor"], passes, grads)


def _compile_update(job: Job, n: int, functions: dict, phases: dict) -> None:
    """The run's update (LoRA: the adapters', the base an argument beside the donated state; with the merged
    sampler, the merge too) into ``functions`` and its phase's bytes into ``phases``."""
    train_step = job.train_step
    if job.lora is None:
        functions["update"], _ = _compile(
            "the GRPO update", n, train_step, job.state, job.batch, options=job.compiler_options
        )
        functions["update"].fsdp_minimum = _fsdp_minimum(job, 2, True)
        phases["update"] = _extra(functions["update"], per_chip_bytes(job.state))
        return
    functions["update"], _ = _compile(
        "the GRPO update (LoRA adapters)", n, train_step.func, job.state, job.batch, base=job.base,
        options=job.compiler_options,
    )  # fmt: skip
    functions["update"].fsdp_minimum = _fsdp_minimum(
        job, 2, False
    )  # the base gathered twice, no weight gradient
    phases["update"] = _extra(functions["update"], per_chip_bytes(job.state) + per_chip_bytes(job.base))
    if job.merged_copy:
        c, _ = _compile("the LoRA merge", n, merge_adapters, job.base, job.state.params, job.lora)
        functions["merge"] = c
        phases["merge"] = _extra(c, per_chip_bytes(job.base) + per_chip_bytes(job.state.params))


def _compile_reference(job: Job, n: int, functions: dict, phases: dict) -> None:
    """The reference / pi_old logprob pass (``token_logprobs``), where the run computes one."""
    cfg, grpo = job.cfg, job.cfg.grpo()
    if not (grpo.beta > 0 or grpo.needs_old_logprobs):
        return
    # the reference's own copy (rounded as read) where there is one, else the weights the forward reads
    read = _forward_params(job) if job.reference is None else job.reference
    c, _ = _compile(
        "the reference logprobs", n, logprobs_program(job.compiler_options), read,
        job.batch.tokens(cfg.router_replay == "replay"), job.model_cfg, grpo.temperature, cfg.micro_batches,
        options=job.compiler_options,
    )  # fmt: skip
    functions["reference logprobs"] = c
    c.fsdp_minimum = _fsdp_minimum(job, 1, False)
    # LoRA: the merged weights are still held (dropped after the whole rollout, reference included); a
    # reference in host memory is on the devices for this pass only.
    resident = 0 if job.reference_on_host else per_chip_bytes(read)
    phases["reference logprobs"] = job.merged_copy + _extra(c, resident)


def _compile_teacher(job: Job, n: int, functions: dict, phases: dict) -> None:
    """The distillation teacher's logprob pass (``token_logprobs`` of its model), where the run has a teacher."""
    if job.teacher is None:
        return
    cfg = job.cfg
    c, _ = _compile(
        "the teacher logprobs", n, logprobs_program(job.compiler_options), job.teacher, job.batch.tokens(),
        job.teacher_cfg, cfg.temperature, cfg.micro_batches, options=job.compiler_options,
    )  # fmt: skip
    functions["teacher logprobs"] = c
    # a teacher in host memory is on the devices for this pass only (its bytes are not resident)
    phases["teacher logprobs"] = job.merged_copy + _extra(
        c, 0 if job.teacher_on_host else per_chip_bytes(job.teacher)
    )


def _compile_sampler(job: Job, n: int, functions: dict, phases: dict) -> None:
    """The rollout engine's two programs (prefill: admit prompts into the page pool; decode: a call's decode
    steps) on the rollout mesh, and the rollout phase's bytes."""
    cfg, sc, rollout_params, model_cfg = job.cfg, job.sampler_cfg, job.rollout_params, job.model_cfg
    backend, G = job.sampler_backend, cfg.num_generations
    with jax.set_mesh(job.rollout_mesh):  # the rollout engine's two programs (grpax.sampler.engine)
        for name, (fn, args, kwargs) in program_set.abstract_programs(
            rollout_params, model_cfg, sc, backend, cfg.batch_size, G
        ).items():
            title = {"prefill": "the sampler's prefill", "decode": "the sampler's decode steps"}[name]
            functions[name], _ = _compile(title, n, fn, *args, **kwargs)
    rollout_resident = per_chip_bytes(rollout_params)
    # LoRA: the merged weights stay on the trainer's chips (with rollout_devices its merge phase counts them).
    merged = 0 if cfg.rollout_devices else job.merged_copy
    sampled = [
        _extra(functions[name], rollout_resident) for name in ("prefill", "decode") if name in functions
    ]
    phases["rollout"] = merged + job.rollout_copy + max(sampled)


def _compile_evaluation(job: Job, n: int) -> None:
    """The evaluation's prefill and decode (eval_batch_size x num_eval_passes rows, greedy or not: with the fixed
    program set the sampling rule is data, so a decode of as many slots as the rollout's is the same program, and
    its prompts are prefilled in the rollout's program where num_eval_passes <= num_generations: prefill_group);
    those that are not the rollout's are compiled for the run to find, outside the memory table (the rollout's
    programs bound it). Compiling the
    groups in threads saved 10 of 111 s on a TPU v5e host (the TPU compiler already keeps its cores busy:
    docs/benchmarks.md), so they compile one after another."""
    cfg = job.cfg
    if cfg.num_test_batches == 0 or not program_set.fixed_programs(job.sampler_cfg, job.rollout_params):
        return
    with jax.set_mesh(job.rollout_mesh):
        rollout, programs = (
            program_set.abstract_programs(
                job.rollout_params, job.model_cfg, job.sampler_cfg, job.sampler_backend, prompts, G
            )
            for prompts, G in (
                (cfg.batch_size, cfg.num_generations),
                (cfg.eval_batch_size, cfg.num_eval_passes),
            )
        )
        for name, (fn, args, kwargs) in programs.items():
            if not _same_program(rollout[name], (fn, args, kwargs)):  # the rollout's: compiled already
                _compile(f"the evaluation's {name}", n, fn, *args, **kwargs)


def _same_program(a: tuple, b: tuple) -> bool:
    """Whether two ``abstract_programs`` entries (jitted, args, kwargs) lower to the same program."""
    (fa, args_a, kw_a), (fb, args_b, kw_b) = a, b
    leaves_a, tree_a = jax.tree.flatten(args_a)
    leaves_b, tree_b = jax.tree.flatten(args_b)
    return fa is fb and kw_a == kw_b and tree_a == tree_b and leaves_a == leaves_b


def run(cfg: TrainConfig) -> int:
    """``grpax train_rl ... compile_topology=NAME``: compiles the job for that slice; 0 if it fits, else 1."""
    topology = get_topology(cfg.compile_topology, cfg.compile_topology_num_slices, cfg.chips_per_vm or 0)
    chip = topology.chip
    target = (
        f"{cfg.compile_topology}"
        + (f" x {topology.num_slices} slices" if topology.num_slices > 1 else "")
        + f" ({topology.num_chips} x {chip.name})"
    )
    start = time.perf_counter()
    report = compile_job(
        cfg, topology.devices, target, chip.hbm_bytes, chip.peak_flops, chip.hbm_bandwidth, chip.ici_bandwidth,
        host_bandwidth=chip.host_bandwidth,
    )  # fmt: skip
    print(format_report(cfg, report, topology.num_chips))
    print(f"total compile time {time.perf_counter() - start:.1f} s")
    return 0 if report.fits else 1


def check_before_run(cfg: TrainConfig, devices=None, limit: int | None = None) -> None:
    """Compiles the job for this machine's devices and stops a run that cannot fit (accelerators only).

    Args:
      cfg: the run's keys (``check_fit=false``: no check).
      devices: default ``jax.devices()``; CPU devices are not checked.
      limit: bytes per device; default the first device's ``memory_stats()["bytes_limit"]``.

    Raises:
      ConfigError: the peak exceeds the memory limit; the message names what to change.
    """
    devices = list(devices or jax.devices())
    if not cfg.check_fit or devices[0].platform == "cpu":
        return
    limit = limit or int((devices[0].memory_stats() or {}).get("bytes_limit", 0))
    if not limit:
        log.warning("the device reports no memory limit: the fit check is skipped")
        return
    chip = chip_of(devices[0].device_kind)
    peaks = (chip.peak_flops, chip.hbm_bandwidth, chip.ici_bandwidth) if chip else (None, None, 0.0)
    report = compile_job(
        cfg, devices, f"{len(devices)} x {devices[0].device_kind}", limit, *peaks,
        host_bandwidth=chip.host_bandwidth if chip else 0.0, evaluation=True,
    )  # fmt: skip
    log.info("%s", format_report(cfg, report, len(devices)))
    if not report.fits:
        raise ConfigError(
            f"this run does not fit: peak {report.peak / GIB:.2f} GiB per device > {limit / GIB:.2f} GiB; try: "
            + "; ".join(suggestions(cfg, report, len(devices)))
            + " (check_fit=false skips this check)"
        )
