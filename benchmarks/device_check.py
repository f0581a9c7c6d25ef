"""Accelerator check: the GRPO update's MFU / HFU, sampled decode, a GRPO step, peak memory, profiles, variants.

Run by ``benchmarks/device_check.sh`` (which puts the repository and the carried wheels on ``PYTHONPATH``: no
install, no network). On a GPU or TPU it builds a randomly initialised llama3.2-3b in bfloat16 on the device
(``DEVICE_CHECK_MODEL`` names another registered model) and one GRPO job around it, as ``train_rl`` would build
it from its keys (``JOB_KEYS``: 8 prompts x 8 completions, prompts up to 128 tokens, completions up to 256, beta
0.04, temperature 0.9, top-k 50, the model's stop tokens). The whole job of llama3.1-8b does not fit one H200
(``compile_topology=h200-1``: 156 GiB of 140 with AdamW's float32 master copy and the reference); 3B needs 64 GiB;
the 8B step has its own command (``benchmarks/h200_8b_step.py``). It measures, in this order (the likeliest to be
cut by the time budget last):

1. ``update``: the job's jitted GRPO update (``make_train_step``: forward, backward, AdamW) on a batch of the
   job's full shape; tokens/s, ``MFU = 6 * params * rows * (P + C) / time / peak_flops`` and ``HFU``: the FLOPs
   the hardware runs (``grpax.plan.step_cost``: each prompt once per group, the remat recompute, attention) over
   the same time;
2. ``profile of one update``: one more call under ``jax.profiler``, summarised as text
   (``benchmarks/profile_summary.py``: top kernels, idle gaps, shares by named scope and by pass: forward,
   backward, recompute);
3. ``top-k threshold``: the sampler's block threshold (``sampling._kth_largest_by_blocks``, a GPU's path) against
   ``lax.top_k``'s k-th value on rows of random and tied logits of the vocabulary's width: equal, and each one's
   time;
4. ``decode``: the rollout's sampler exactly as GRPO samples (``generate``: each prompt prefilled once, G
   completions, temperature, top-k, stop tokens), at the job's 8 x 8 rows and (``decode 4x rows``, after the
   memory part: its pool is sized to fill the chip) at 32 x 8; useful tokens/s (completion tokens before each
   row's stop) against the HBM roofline, ms per decode step, the rows' mean length, the fraction of decode
   row-steps spent past a row's stop; every decode after the first samples the first one's weights;
5. ``profile of one decode`` (8 x 8 rows, the job's): kernels per decode step, idle gaps between kernels, the
   shares of the matmuls, attention, sampling (top-k, top-p, rng, draw, logprobs), cache writes, stop
   bookkeeping and the loop's condition;
6. ``grpo step``: ``Rollout`` (sampling + rewards) -> reference logprobs -> ``make_update``, the trainer's
   own objects, split into rollout / reference / update seconds (the third step: the first compiles);
7. ``memory``: the device's peak bytes in use (``memory_stats``) against the fit check's per-device table of
   the same job (``grpax.plan.compile_check.compile_job``, the check ``train_rl`` runs before a run), and how
   many of the fit check's programs were read from JAX's persistent compilation cache;
8. ``variant ...``: ``VARIANTS``, each beside the default in the same process, after the memory part (so the
   peak is the job's): a sampler key, XLA GPU compiler options of the sampler's jits
   (``grpax.sampler.backend.XLA_GPU_OPTIONS``, per program: not process-wide as ``XLA_FLAGS``), main's top-k
   (``lax.top_k`` on every platform: the "before" of this change), XLA's optimization level of its programs, or
   the update's model keys (``DEVICE_CHECK_VARIANTS`` keeps those whose name holds one of its words). A decode variant
   samples the default's prompts with its keys and reports the fraction of rows with the same tokens.

Each part runs in its own ``try``: a failure prints one line and the table keeps the other parts' figures. A
part starts only if the elapsed time plus its H200 estimate (``Variant.seconds``, ``PART_SECONDS``) stays within
``DEVICE_CHECK_BUDGET_S`` (default 480: with the shell's start about 8.5 minutes, under the device tool's 10);
the order puts the likeliest causes first. How the H200 time was budgeted, from its first run (compiles: the
decode's programs 35 s per row count, the update 23 s): setup 5 s, update 30, its profile 10, threshold check 5,
decode 45 + 45, its profile 20, GRPO step 40, memory 30 (~235 s), then variants of 30-45 s each.
Every figure is printed and written to ``$OUT/device_check.{txt,json}`` (``$OUT`` defaults to
``runs/device_check``), the profiles' text to ``$OUT/profiles.txt``, the traces to ``$OUT/trace_update.tar.gz``
and ``trace_decode.tar.gz`` (each kept only under 15 MiB, what the device tool brings back). With
``DEVICE_CHECK_TINY=1``, or automatically on CPU, a tiny Llama replaces the model so the whole script runs in a
few minutes on a CPU; GPU-only variants are then checked for accepted compiler options, not measured. Peak
bandwidth and bf16 dense FLOP/s come from ``PEAKS`` by ``device_kind``; an unknown device is measured (a
device-side copy, a 4096^3 bf16 matmul). ``DEVICE_CHECK_HLO_DUMP``: a folder of XLA's HLO dumps of the decode
(``--xla_dump_to``, set by the shell script), read to name a CPU trace's thunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import profile_summary
from jax.sharding import NamedSharding, PartitionSpec

from grpax import sharding
from grpax.cli.common import enable_compilation_cache
from grpax.compiles import effort_options
from grpax.config import build_config
from grpax.models import attention as attention_module
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.plan.compile_check import compile_job, model_config
from grpax.plan.fit_report import GIB, format_report
from grpax.plan.step_cost import StepShape, step_phases
from grpax.rl import train_step as train_step_module
from grpax.rl.batch import Batch
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.sampler import backend as sampler_backend
from grpax.sampler import paging, sampling
from grpax.sampler.engine import generate

# device_kind substring -> (HBM bytes/s, bf16 dense FLOP/s), per chip (vendor data sheets).
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4.8e12, 989e12),
    ("H100", 3.35e12, 989e12),  # SXM; PCIe: 2.0e12, 756e12
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100", 1.555e12, 312e12),
    ("TPU v6", 1.64e12, 918e12),  # v6e (Trillium), device_kind "TPU v6 lite"
    ("TPU v5 lite", 0.819e12, 197e12),  # v5e
    ("TPU v5e", 0.819e12, 197e12),
    ("TPU v5p", 2.765e12, 459e12),
    ("TPU v5", 2.765e12, 459e12),  # v5p reports "TPU v5"
    ("TPU v4", 1.2e12, 275e12),
)
BUDGET_S = float(os.environ.get("DEVICE_CHECK_BUDGET_S", 480))  # no part starts that would end after this
# Parts left out by name (comma-separated, e.g. "grpo step,memory"; a variant's name starts "variant "): a short
# lease measures what it came for first.
SKIP = {name.strip() for name in os.environ.get("DEVICE_CHECK_SKIP", "").split(",") if name.strip()}
# Only the variants whose name contains one of these (comma-separated); unset or empty: every variant.
ONLY_VARIANTS = [w.strip() for w in os.environ.get("DEVICE_CHECK_VARIANTS", "").split(",") if w.strip()]

# The GRPO job of the check, as train_rl keys (the 8B run and the tiny one share every key but the shapes).
JOB_KEYS = dict(
    batch_size=8,
    num_generations=8,
    max_prefill_predict_length=128,
    max_target_length=384,
    beta=0.04,
    temperature=0.9,
    decode_sampling_top_k=50,
    weight_dtype="bfloat16",
    dtype="bfloat16",
    remat_policy="full",
    num_batches=10,
    learning_rate=1e-6,
)
TINY_KEYS = dict(
    batch_size=2,
    num_generations=4,
    max_prefill_predict_length=16,
    max_target_length=48,
    weight_dtype="float32",
    dtype="float32",
    remat_policy="none",
)
TINY_MODEL = ModelConfig(
    vocab_size=512,
    hidden_dim=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    dtype="float32",
    weight_dtype="float32",
)

# XLA's GPU command buffers (CUDA graphs) as XLA enables them by default (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL,
# CUDNN, DYNAMIC_SLICE_FUSION), plus the decode's while loop and conditionals: the whole decode phase one graph,
# its loop condition evaluated on the device instead of a copy to the host and a launch per step.
COMMAND_BUFFERS_WHILE = (
    "xla_gpu_enable_command_buffer",
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One setting measured beside the default, in the same process.

    Attributes:
      name: what it changes.
      rows: a decode variant's prompts as a multiple of the job's batch_size (1: 8 x 8 rows, 4: 32 x 8); 0: an
        update variant.
      sampler: ``SamplerConfig`` fields; gpu_options: the sampler's XLA GPU compiler options
        (``XLA_GPU_OPTIONS``); model: ``ModelConfig`` fields of the update; sort_top_k: main's top-k
        threshold (``lax.top_k``) on every platform.
      gpu_only: measured on GPUs only (elsewhere its options are only checked).
      seconds: its H200 estimate (compile + 2 runs), for the budget.
    """

    name: str
    rows: int = 0
    sampler: tuple[tuple[str, object], ...] = ()
    gpu_options: tuple[tuple[str, str], ...] = ()
    model: tuple[tuple[str, object], ...] = ()
    sort_top_k: bool = False
    gpu_only: bool = False
    seconds: float = 45.0
    head_chunk_min_tokens: int | None = None  # train_step.LOGITS_CHUNK_MIN_TOKENS for an update variant
    xla_paged: bool = False  # the decode's paged attention by XLA's gather where Pallas's kernel would run
    tpu_only: bool = False  # measured on TPUs only (a TPU kernel: elsewhere noted as n/a)
    flash_block_max: int = 0  # attention.FLASH_BLOCK_MAX for an update variant (attention=flash's blocks)
    optimization_level: str = ""  # XLA's level (jax_optimization_level, O0-O3) of its programs
    exec_time_effort: float = 0.0  # XLA's run-time effort of its programs (jax_exec_time_optimization_effort)


# In the order they run: the likeliest to explain the decode's 22% of the HBM roofline first (one decode step
# launches hundreds of kernels and XLA's GPU top-k sorts the vocabulary for k > 16), then the update's remat.
VARIANTS: tuple[Variant, ...] = (
    # Pallas's splash attention kernel in the update (attention=flash): the scores never in HBM (the check's job
    # still needs remat full: minimal 21.5 GiB of temporaries, compiled for a v5e with libtpu)
    Variant("update attention=flash", model=(("attention", "flash"),), tpu_only=True, seconds=60),
    Variant(
        "update attention=flash, blocks of 128",
        model=(("attention", "flash"),),
        flash_block_max=128,
        tpu_only=True,
        seconds=60,
    ),  # fmt: skip
    # XLA's optimization level (the key xla_optimization_level): compile seconds against run seconds
    Variant("update at XLA O1", optimization_level="O1", seconds=30),
    Variant("update at XLA O0", optimization_level="O0", seconds=30),
    Variant("decode at XLA O1", rows=1, optimization_level="O1", seconds=30),
    Variant("decode at XLA O0", rows=1, optimization_level="O0", seconds=30),
    # XLA's run-time effort (training_compile_effort=low: the update and logprob passes of a short run)
    Variant("update at XLA effort -1", exec_time_effort=-1.0, seconds=30),
    Variant("update at XLA effort -0.5", exec_time_effort=-0.5, seconds=30),
    Variant("decode at XLA effort -1", rows=1, exec_time_effort=-1.0, seconds=30),
    # the decode's pages and calls (issue 54: the ragged kernel reads ~42% of HBM bandwidth per layer at 32-token
    # pages): longer pages are longer DMAs per page; more steps per call, fewer host round trips
    Variant("decode page_size=64", rows=1, sampler=(("page_size", 64),), seconds=30),
    Variant("decode page_size=128", rows=1, sampler=(("page_size", 128),), seconds=30),
    Variant("decode 64 steps per call", rows=1, sampler=(("decode_steps_per_call", 64),), seconds=30),
    # the vocabulary head's chunks as they were before issue 54 (2**24 logits per chip, no floor of tokens)
    Variant("update head chunks of 2**24 logits (no token floor)", head_chunk_min_tokens=0, seconds=40),
    Variant("update head chunks of >= 1024 tokens", head_chunk_min_tokens=1024, seconds=40),
    Variant("update head chunks of >= 2048 tokens", head_chunk_min_tokens=2048, seconds=40),
    Variant("decode paged attention by XLA's gather (not Pallas's ragged kernel)", rows=4, xla_paged=True),
    Variant("main's sampler (lax.top_k threshold)", rows=4, sort_top_k=True, seconds=45),
    Variant(
        "command buffers +WHILE,+CONDITIONAL", rows=4, gpu_options=(COMMAND_BUFFERS_WHILE,), gpu_only=True
    ),
    Variant("update remat_policy=dots", model=(("remat_policy", "dots"),), seconds=30),
    Variant(
        "command buffers +WHILE,+CONDITIONAL", rows=1, gpu_options=(COMMAND_BUFFERS_WHILE,), gpu_only=True
    ),
    Variant(
        "one decode phase (decode_phase_length=0)", rows=4, sampler=(("decode_phase_length", 0),), seconds=30
    ),
    Variant(
        "one phase + command buffers +WHILE,+CONDITIONAL",
        rows=4,
        sampler=(("decode_phase_length", 0),),
        gpu_options=(COMMAND_BUFFERS_WHILE,),
        gpu_only=True,
        seconds=30,
    ),
    Variant("update attention=cudnn", model=(("attention", "cudnn"),), gpu_only=True, seconds=30),
    Variant("main's sampler (lax.top_k threshold)", rows=1, sort_top_k=True, seconds=40),
    Variant(
        "no command buffers", rows=4, gpu_options=(("xla_gpu_enable_command_buffer", ""),), gpu_only=True
    ),
    Variant(
        "latency-hiding scheduler",
        rows=4,
        gpu_options=(("xla_gpu_enable_latency_hiding_scheduler", "True"),),
        gpu_only=True,
    ),
)
# H200 estimates of the other parts (s), from its first run, for the budget.
PART_SECONDS = {"setup": 10, "update": 30, "profile": 10, "top-k threshold": 5, "decode 1": 45, "decode 4": 45,
                "decode profile": 20, "grpo step": 40, "memory": 30, "memory bracket": 20}  # fmt: skip
# The memory bracket's rooms: shares of the update's compiled temporaries left free beside the state.
BRACKET_ROOMS = (1.03, 1.0, 0.97, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def _timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def peak_numbers(devices) -> tuple[float, float, str]:
    """(bandwidth bytes/s, FLOP/s, source) summed over ``devices``: from ``PEAKS`` or measured."""
    kind = devices[0].device_kind
    for name, bw, flops in PEAKS:
        if name.lower() in kind.lower():
            return bw * len(devices), flops * len(devices), f"table ({name})"
    bw, flops = measure_peaks(devices[0])
    return bw * len(devices), flops * len(devices), f"measured ({kind})"


def measure_peaks(device) -> tuple[float, float]:
    """Measured (bytes/s, FLOP/s) of one device: a jitted copy of 256 MiB and a bf16 matmul (best of 5)."""
    cpu = device.platform == "cpu"
    n_bytes = (64 if cpu else 256) * 2**20
    x = jax.device_put(jnp.ones((n_bytes // 4,), jnp.float32), device)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    bw = 2 * n_bytes / min(_timed(lambda: copy(x))[1] for _ in range(5))
    n = 512 if cpu else 4096
    a = jax.device_put(jnp.ones((n, n), jnp.float32 if cpu else jnp.bfloat16), device)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    return bw, 2 * n**3 / min(_timed(lambda: mm(a))[1] for _ in range(5))


def job_config(tiny: bool) -> tuple[TrainConfig, ModelConfig]:
    """The check's GRPO job: train_rl's keys and the model (random weights: no checkpoint is read)."""
    model = "" if tiny else os.environ.get("DEVICE_CHECK_MODEL", "llama3.2-3b")
    keys = {**JOB_KEYS, **(TINY_KEYS if tiny else {}), "model_name": model}
    cfg = build_config(TrainConfig, [f"{k}={v}" for k, v in keys.items()])
    return cfg, TINY_MODEL if tiny else model_config(cfg)  # model_config: train_rl's, from the keys


def decode_roofline(cfg: ModelConfig, rows: int, P: int, C: int, bw: float, flops: float) -> float:
    """Upper bound on decode tokens/s: weights + average filled KV cache read per step, or matmul FLOPs."""
    avg_len = P + C / 2
    kv_bytes = (
        2 * cfg.num_layers * rows * avg_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    )
    step_bytes = cfg.num_params() * jnp.dtype(cfg.weight_dtype).itemsize + kv_bytes
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_dim)
    step_flops = 2 * rows * matmul_params + 4 * rows * cfg.num_layers * cfg.num_heads * cfg.head_dim * avg_len
    return rows / max(step_bytes / bw, step_flops / flops)


def update_hardware_flops(model_cfg: ModelConfig, cfg: TrainConfig, micro_batches: int) -> float:
    """FLOPs one update runs (``grpax.plan.step_cost``): each prompt once per group, forward + backward, the remat
    recompute of ``model_cfg.remat_policy``, attention, the vocabulary projection."""
    grpo = cfg.grpo()
    shape = StepShape(
        num_prompts=cfg.batch_size,
        num_generations=grpo.num_generations,
        prompt_length=cfg.max_prefill_predict_length,
        completion_length=cfg.max_completion_length,
        num_micro_batches=micro_batches,
        num_iterations=1,
        with_reference=False,
        with_old_logprobs=False,
    )
    phases = step_phases(model_cfg, shape, 1, 1, 1, 1, peak_flops=1.0, hbm_bandwidth=1.0)
    return next(phase.flops for phase in phases if phase.name == "update")


def random_prompts(rng, vocab: int, num: int, longest: int) -> list[list[int]]:
    """``num`` prompts of random tokens, lengths spread over [longest / 2, longest] as real prompts are, the
    first one ``longest`` tokens."""
    lengths = rng.integers(longest // 2, longest + 1, num)
    lengths[0] = longest  # every batch in the same (longest) prompt bucket: one compile per shape
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def stop_tokens(model_cfg: ModelConfig, tiny: bool) -> tuple[int, ...]:
    """The model's end-of-sequence ids; the tiny random model gets 16 ids, so its rows stop at ~V/16 tokens."""
    if tiny:
        return tuple(range(1, 17))
    return tuple(model_cfg.eos_token_ids or (model_cfg.vocab_size - 1,))


def hlo_dumps(modules: tuple[str, ...]) -> dict[str, str]:
    """{module name: its optimised HLO text} of the modules XLA dumped into ``DEVICE_CHECK_HLO_DUMP`` whose names
    contain one of ``modules`` (several programs of one name, e.g. the decode phases, joined)."""
    folder = os.environ.get("DEVICE_CHECK_HLO_DUMP")
    texts: dict[str, list[str]] = {}
    for path in sorted(Path(folder).glob("*after_optimizations.txt")) if folder else []:
        text = path.read_text()
        name = profile_summary.module_name(text)
        if any(m in name for m in modules):
            texts.setdefault(name, []).append(text)
    return {name: "\n".join(parts) for name, parts in texts.items()}


@contextlib.contextmanager
def applied(variant: Variant):
    """The sampler's GPU options, top-k threshold and paged attention, and XLA's optimization level of every
    program, of ``variant`` while inside (restored after)."""
    options, blocks = sampler_backend.XLA_GPU_OPTIONS, sampling._kth_largest_by_blocks
    takes, level = sampler_backend.ragged_tpu_takes, jax.config.jax_optimization_level
    effort = getattr(jax.config, "jax_exec_time_optimization_effort", None)  # jax 0.11 has no float efforts
    sampler_backend.XLA_GPU_OPTIONS = options + variant.gpu_options
    if variant.sort_top_k:
        sampling._kth_largest_by_blocks = sampling._kth_largest_by_sort
    if variant.xla_paged:
        sampler_backend.ragged_tpu_takes = lambda *args: False
    if variant.optimization_level:
        jax.config.update("jax_optimization_level", variant.optimization_level)
    if variant.exec_time_effort:
        jax.config.update("jax_exec_time_optimization_effort", variant.exec_time_effort)
    retrace = bool(
        variant.sort_top_k or variant.xla_paged or variant.optimization_level or variant.exec_time_effort
    )
    if retrace:
        jax.clear_caches()  # the programs traced and compiled again with the patched function or level
    try:
        yield
    finally:
        sampler_backend.XLA_GPU_OPTIONS, sampling._kth_largest_by_blocks = options, blocks
        sampler_backend.ragged_tpu_takes = takes
        jax.config.update("jax_optimization_level", level)
        if effort is not None:
            jax.config.update("jax_exec_time_optimization_effort", effort)
        if retrace:
            jax.clear_caches()


class Check:
    """The check's job and its measurements: each ``part_*`` method adds rows to ``self.rows``."""

    def __init__(self, out: Path, tiny: bool):
        self.start = time.perf_counter()
        self.out, self.tiny = out, tiny
        self.devices = jax.local_devices()
        self.platform = self.devices[0].platform
        self.bw, self.flops, self.peak_source = peak_numbers(self.devices)
        self.cfg, self.model_cfg = job_config(tiny)
        mesh_cfg = dataclasses.replace(self.cfg.mesh(), chips_per_vm=0)
        self.mesh = sharding.create_mesh(mesh_cfg, self.devices)
        self.rollout_mesh = sharding.create_rollout_mesh(mesh_cfg, self.devices)
        self.grpo = self.cfg.grpo()
        self.sampler_cfg = self.cfg.sampler_config(stop_tokens(self.model_cfg, tiny), 0)
        self.rows: list[dict] = []
        self.rng = np.random.default_rng(0)
        self.prompts: dict[int, list[list[int]]] = {}  # per prompt count: the same prompts for every variant
        self.outputs: dict[tuple[str, int], np.ndarray] = {}  # (variant, prompts) -> completion_ids
        self.results: dict[str, dict[str, dict]] = {}  # variant -> {"decode 8x8": ..., "update": ...}
        self.profiles: list[str] = []
        # The weights every decode samples: the default's decodes read the train state's (a host copy is kept),
        # the variants, after updates have moved the state, that copy put back (so their tokens compare).
        self.decode_weights = None
        self.variant_params = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def add(self, part: str, **figures) -> None:
        row = {"part": part, **figures}
        self.rows.append(row)
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in figures.items() if k != "note")
        print(f"  {part}: {shown}{'  ' + figures['note'] if 'note' in figures else ''}", flush=True)

    def setup(self) -> None:
        """The params and optimizer state on the devices, the job's update and rollout objects."""
        t0 = time.perf_counter()
        cfg, model_cfg, mesh = self.cfg, self.model_cfg, self.mesh
        init = jax.jit(
            lambda k: init_params(model_cfg, k), out_shardings=sharding.param_shardings(model_cfg, mesh)
        )
        params = jax.block_until_ready(init(jax.random.key(0)))
        self.optimizer, self.schedule = optimizer_from_config(
            self.grpo, cfg.num_batches * self.grpo.num_iterations, model_cfg.weight_dtype
        )
        self.state = TrainState(
            params=params,
            opt_state=sharding.init_optimizer_state(self.optimizer, params, mesh),
            step=jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, PartitionSpec())),
        )
        self.train_step = make_train_step(
            model_cfg, self.grpo, self.optimizer, cfg.micro_batches, self.schedule
        )
        self.add("setup", seconds=time.perf_counter() - t0, note="random init on the devices, AdamW state")

    def full_batch(self) -> Batch:
        """A batch of the job's full shape (random tokens; every completion C long)."""
        cfg, rng, V = self.cfg, self.rng, self.model_cfg.vocab_size
        P, G, Lp, C = (
            cfg.batch_size,
            self.grpo.num_generations,
            cfg.max_prefill_predict_length,
            cfg.max_completion_length,
        )
        B = P * G
        return Batch(
            prompt_ids=rng.integers(1, V, (P, Lp), dtype=np.int32),
            prompt_mask=np.ones((P, Lp), np.int32),
            completion_ids=rng.integers(1, V, (B, C), dtype=np.int32),
            completion_mask=np.ones((B, C), np.int32),
            advantages=rng.standard_normal(B).astype(np.float32),
            rollout_logprobs=np.full((B, C), -np.log(V), np.float32),
            truncated=np.zeros((B,), bool),
            ref_logprobs=np.full((B, C), -np.log(V), np.float32) if self.grpo.beta > 0 else None,
        )

    def part_update(self, label: str = "default", model_cfg: ModelConfig | None = None) -> None:
        """The update on a full-shape batch: compile, then two timed calls (the last one counts); MFU and HFU."""
        cfg, G = self.cfg, self.grpo.num_generations
        model_cfg = model_cfg or self.model_cfg
        train_step = self.train_step
        if model_cfg is not self.model_cfg:
            train_step = make_train_step(
                model_cfg, self.grpo, self.optimizer, cfg.micro_batches, self.schedule
            )
        P, Lp, C = cfg.batch_size, cfg.max_prefill_predict_length, cfg.max_completion_length
        in_use = (self.devices[0].memory_stats() or {}).get("bytes_in_use")
        with jax.set_mesh(self.mesh):
            batch = sharding.shard_global_batch(self.full_batch(), self.mesh)
            (self.state, metrics), first = _timed(lambda: train_step(self.state, batch))
            (self.state, metrics), second = _timed(lambda: train_step(self.state, batch))
            (self.state, metrics), run = _timed(lambda: train_step(self.state, batch))
        memory = ""
        if label == "default":
            self.batch = batch
            memory = self.update_memory(in_use)
        assert not bool(metrics["nonfinite"]), metrics
        tokens = P * G * (Lp + C)
        figures = dict(
            tokens_per_s=tokens / run,
            mfu=6 * model_cfg.num_params() * tokens / run / self.flops,
            hfu=update_hardware_flops(model_cfg, cfg, cfg.micro_batches) / run / self.flops,
        )
        self.results.setdefault(label, {})["update"] = figures
        self.add(
            f"update {P}x{G} rows of {Lp}+{C}" + ("" if label == "default" else f": {label}"),
            compile_s=max(first - run, 0.0),
            run_s=run,
            **figures,
            compiles=train_step._cache_size(),
            note=f"second call {second:.3f} s; remat_policy={model_cfg.remat_policy}, attention={model_cfg.attention}"
            + memory,
        )

    def update_memory(self, in_use: int | None) -> str:
        """The device's peak after the first update (the job's planned peak phase) against the bytes in use
        before it (the state: params, optimizer state) and the compiled update's temporaries."""
        peak = (self.devices[0].memory_stats() or {}).get("peak_bytes_in_use")
        if peak is None or in_use is None:
            return ""
        temporaries = self.update_temporaries
        return (
            f"; peak so far {peak / GIB:.2f} GiB = in use before it {in_use / GIB:.2f} + "
            f"{(peak - in_use) / GIB:.2f} (its compiled temporaries {temporaries / GIB:.2f})"
        )

    @functools.cached_property
    def update_temporaries(self) -> int:
        """The default update's compiled temporaries (bytes), read once (its executable: compiled already)."""
        with jax.set_mesh(self.mesh):
            compiled = self.train_step.lower(self.state, self.batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    def part_profile(self) -> None:
        """One more update under ``jax.profiler.trace``, summarised (top kernels, scopes, passes)."""
        folder = self.out / "trace_update"
        with jax.set_mesh(self.mesh), jax.profiler.trace(str(folder)):
            (self.state, _), traced = _timed(lambda: self.train_step(self.state, self.batch))
        with jax.set_mesh(self.mesh):
            hlo = (
                self.train_step.lower(self.state, self.batch).compile().as_text()
            )  # compiled already: no compile
        text, figures = profile_summary.summarize_trace(
            folder, "update", {profile_summary.module_name(hlo): hlo}, by_pass=True
        )
        self.profiles.append(text)
        passes = figures.get("passes", {})
        self.add(
            "profile of one update",
            seconds=traced,
            kernels=figures["kernels"],
            busy=figures.get("busy_fraction", 0.0),
            recompute=passes.get("recompute (remat)", 0.0),
            backward=passes.get("backward", 0.0),
            matmul=figures.get("kinds", {}).get("matmul", 0.0),
            note="$OUT/profiles.txt",
        )
        print(text, flush=True)
        self.pack(folder)

    def part_threshold(self) -> None:
        """The sampler's block threshold against lax.top_k's k-th value on this device: equal, and their times."""
        rows, V, k = (
            4 * self.cfg.batch_size * self.grpo.num_generations,
            self.model_cfg.vocab_size,
            self.sampler_cfg.top_k,
        )
        if not 0 < k < V:
            self.add("top-k threshold", note=f"n/a: top-k {k} filters nothing")
            return
        key = jax.random.key(5)
        spread = 3.0 * jax.random.normal(key, (rows, V), jnp.float32)
        ties = jnp.round(spread)  # many equal logits, ties at the threshold
        blocks = jax.jit(lambda x: sampling._kth_largest_by_blocks(x, k))
        by_sort = jax.jit(lambda x: sampling._kth_largest_by_sort(x, k))
        equal = all(bool(jnp.all(blocks(x) == by_sort(x))) for x in (spread, ties))
        times = {}
        for name, fn in (("blocks", blocks), ("sort", by_sort)):
            times[name] = min(_timed(lambda fn=fn: fn(spread))[1] for _ in range(5))
        self.add(
            f"top-k threshold {rows}x{V}, k {k}",
            equal=equal,
            blocks_ms=times["blocks"] * 1e3,
            sort_ms=times["sort"] * 1e3,
            note="the block maxima's threshold (a GPU's path) vs lax.top_k's k-th value, random and tied logits",
        )
        assert equal, "the block threshold differs from lax.top_k's k-th value"

    def part_decode(self, factor: int, label: str = "default", sc=None) -> None:
        """The rollout's sampling at ``factor * batch_size`` x G rows: compile + run, then a timed run (new key);
        the same prompts and keys for every variant."""
        model_cfg, G = self.model_cfg, self.grpo.num_generations
        sc = sc or self.sampler_cfg
        num_prompts = factor * self.cfg.batch_size
        prompts = self.prompts.setdefault(
            num_prompts, random_prompts(self.rng, model_cfg.vocab_size, num_prompts, sc.max_prompt_length)
        )
        weights = self.state.params
        if self.decode_weights is None:  # on the host: not counted in the device's peak
            self.decode_weights = jax.device_get(self.state.params)
        else:  # every later decode samples with the first one's weights (the GRPO step moves the state)
            if self.variant_params is None:
                shardings = sharding.param_shardings(model_cfg, self.mesh)
                self.variant_params = jax.device_put(self.decode_weights, shardings)
            weights = self.variant_params
        # As the rollout reads them: on the sampler's mesh (a copy only when its layout differs).
        params, _ = sharding.reshard_for_rollout(weights, self.mesh, self.rollout_mesh)
        sc, pool_note = self.fitting_pool(sc, params, num_prompts * G)
        with jax.set_mesh(self.rollout_mesh):
            _, first = _timed(lambda: generate(params, prompts, model_cfg, sc, jax.random.key(1), G))
            out, run = _timed(lambda: generate(params, prompts, model_cfg, sc, jax.random.key(2), G))
        lengths = np.asarray(out.completion_mask).sum(axis=1)
        rows = len(lengths)
        steps = max(int(lengths.max()), 1)
        # The decode loop runs every row until the longest one stops (or C): the rest is past a row's stop.
        past_stop = 1.0 - lengths.sum() / (rows * steps)
        mean_prompt = float(np.mean([len(p) for p in prompts]))
        roof = decode_roofline(model_cfg, rows, int(mean_prompt), int(lengths.mean()), self.bw, self.flops)
        tps = lengths.sum() / run
        figures = dict(tokens_per_s=tps, roofline=tps / roof, step_ms=run / steps * 1e3)
        default = self.outputs.get(("default", num_prompts))
        if default is not None and label != "default":
            figures["same_rows"] = float(np.mean(np.all(out.completion_ids == default, axis=1)))
        self.outputs[(label, num_prompts)] = out.completion_ids
        self.results.setdefault(label, {})[f"decode {num_prompts}x{G}"] = figures
        self.add(
            f"decode {num_prompts}x{G} rows, sampled" + ("" if label == "default" else f": {label}"),
            compile_s=max(first - run, 0.0),
            run_s=run,
            **figures,
            mean_length=float(lengths.mean()),
            stopped=float(np.mean([r == "stop" for r in out.finish_reason])),
            past_stop=past_stop,
            note=f"T {sc.temperature}, top-k {sc.top_k}; roofline {roof:,.0f} tok/s{pool_note}",
        )

    def fitting_pool(self, sc, params, rows: int):
        """``sc`` with a KV pool that fits beside what the device holds (the train state, the kept copies): the
        pages 85% of its memory leaves (the rest for the decode's temporaries), at most every row's; as
        train_rl's plan sizes its pool. On a CPU (no memory size) ``sc`` as it is. Returns (sc, a note)."""
        stats = self.devices[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return sc, ""
        backend = sampler_backend.select_backend("xla", params, self.model_cfg, sc.cache_dtype, True)
        page = sharding.per_chip_bytes(paging.abstract_pool(params, self.model_cfg, sc, backend, 1))
        full = paging.pool_pages(sc, rows)
        fits = int((0.85 * stats["bytes_limit"] - stats.get("bytes_in_use", 0)) // page)
        if fits >= full:
            return sc, ""
        return dataclasses.replace(sc, num_pages=fits), f"; pool {fits} of {full} pages (memory)"

    def part_decode_profile(self) -> None:
        """One more decode of the job's rows (8 x 8: the default's prompts and key, its pool) under
        ``jax.profiler.trace``, summarised; before the 32 x 8 decode, whose pool fills the chip."""
        model_cfg, sc, G = self.model_cfg, self.sampler_cfg, self.grpo.num_generations
        num_prompts = self.cfg.batch_size
        prompts = self.prompts[num_prompts]
        params, _ = sharding.reshard_for_rollout(self.state.params, self.mesh, self.rollout_mesh)
        sc, _ = self.fitting_pool(sc, params, num_prompts * G)
        folder = self.out / "trace_decode"
        with jax.set_mesh(self.rollout_mesh), jax.profiler.trace(str(folder)):
            out, traced = _timed(lambda: generate(params, prompts, model_cfg, sc, jax.random.key(2), G))
        steps = max(int(np.asarray(out.lengths).max()) - 1, 1)  # loop steps after the prefill's first token
        decode = ("retire_phase", "_decode")
        text, figures = profile_summary.summarize_trace(
            folder, f"decode {num_prompts}x{G} rows", hlo_dumps(decode), steps=steps, modules=decode
        )
        self.profiles.append(text)
        shares = figures.get("shares", {})
        self.add(
            "profile of one decode",
            seconds=traced,
            kernels_per_step=figures.get("kernels_per_step", 0.0),
            step_ms=figures.get("step_ms", 0.0),
            busy=figures.get("busy_fraction", 0.0),
            sampling=sum(v for k, v in shares.items() if k.startswith("sampling")),
            top_k=shares.get("sampling: top-k", 0.0),
            attention=shares.get("attention", 0.0),
            matmul=figures.get("kinds", {}).get("matmul", 0.0),
            note="$OUT/profiles.txt",
        )
        print(text, flush=True)
        self.pack(folder)

    def part_grpo_step(self) -> None:
        """Three GRPO steps of the trainer's own objects (the first compiles); the last one's phases."""
        G = self.grpo.num_generations

        def score(rows, out):
            # Rewards from the completions' tokens: any fixed function of them (random weights solve nothing).
            total = [
                float(hash(tuple(ids[m.astype(bool)].tolist())) % 7)
                for ids, m in zip(out.completion_ids, out.completion_mask, strict=True)
            ]
            return {"total": total}, np.zeros(len(rows))

        reference = jax.tree.map(jnp.copy, self.state.params) if self.grpo.beta > 0 else None
        rollout = Rollout(
            self.model_cfg,
            self.sampler_cfg,
            self.grpo,
            score,
            mesh=self.mesh,
            rollout_mesh=self.rollout_mesh,
            reference=reference,
            num_micro_batches=self.cfg.micro_batches,
        )
        update = make_update(self.train_step, self.grpo.num_iterations)
        steps = []
        for i in range(3):
            rows = [
                {"prompt_ids": p}
                for p in random_prompts(
                    self.rng,
                    self.model_cfg.vocab_size,
                    self.cfg.batch_size,
                    self.cfg.max_prefill_predict_length,
                )
            ]
            t0 = time.perf_counter()
            rollout.update_params(self.state.params, i)
            batch = rollout(rows, jax.random.key(10 + i))
            t1 = time.perf_counter()
            with jax.set_mesh(self.mesh):  # as the trainer calls it
                self.state, metrics = update(self.state, batch)
            t2 = time.perf_counter()
            steps.append((batch.host, t2 - t0, t2 - t1))
        host, step_s, update_s = steps[-1]
        tokens = int(host.completion_lengths.sum())
        self.add(
            f"grpo step {self.cfg.batch_size}x{G}",
            step_s=step_s,
            rollout_s=host.timings["time/rollout_s"],
            rewards_s=host.timings["time/rewards_s"],
            reference_s=host.timings["time/reference_s"],
            update_s=update_s,
            first_step_s=steps[0][1],
            tokens_per_s=tokens / step_s,
            note=f"{tokens} completion tokens, mean {host.completion_lengths.mean():.0f} of {self.sampler_cfg.max_completion_length}",
        )

    def part_memory(self) -> None:
        """Peak bytes in use on device 0 so far against the fit check's table of the same job."""
        stats = self.devices[0].memory_stats() or {}
        # A CPU reports no limit: its memory is the host's.
        limit = int(stats.get("bytes_limit", 0)) or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        hits: list[str] = []
        listener = lambda name, **kwargs: hits.append(name) if name.endswith("cache_hits") else None  # noqa: E731
        jax.monitoring.register_event_listener(listener)
        t0 = time.perf_counter()
        report = compile_job(
            self.cfg, self.devices, "this device", limit, None, None, model_cfg=self.model_cfg
        )
        seconds = time.perf_counter() - t0
        (self.out / "fit_report.txt").write_text(format_report(self.cfg, report, len(self.devices)) + "\n")
        peak = stats.get("peak_bytes_in_use")
        figures = dict(
            fit_peak_gib=report.peak / GIB,
            fit_check_s=seconds,
            fit_programs=len(report.functions),
            cache_hits=len(hits),
        )
        if peak is None:
            self.add("memory", **figures, note=f"{self.devices[0].platform} reports no memory stats")
            return
        self.add(
            "memory",
            peak_gib=peak / GIB,
            **figures,
            limit_gib=limit / GIB,
            note=f"measured peak / fit check's peak {peak / max(report.peak, 1):.2f}",
        )

    def part_memory_bracket(self) -> None:
        """The update's real temporaries measured on the device: the TPU's ``peak_bytes_in_use`` leaves a
        program's temporaries out (the update part's note sets the peak beside the state: docs/benchmarks.md), so
        an array (ballast) leaves the update room for ``BRACKET_ROOMS`` of its compiled temporaries in turn,
        the largest first, until one runs out of memory: the temporaries it needs lie between that room and the
        last that ran. The last part: a failed update may have consumed the state it donates."""
        stats = self.devices[0].memory_stats() or {}
        limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use")
        if not limit or in_use is None or getattr(self, "batch", None) is None:
            self.add("memory bracket", note=f"{self.platform} reports no memory limit")
            return
        temporaries = self.update_temporaries
        ran, failed = None, None
        for room in BRACKET_ROOMS:
            ballast_bytes = int(limit - in_use - room * temporaries)
            ballast = jax.device_put(np.zeros(max(ballast_bytes, 0), np.uint8), self.devices[0])
            try:
                with jax.set_mesh(self.mesh):
                    self.state, _ = jax.block_until_ready(self.train_step(self.state, self.batch))
                ran = room
            except Exception as e:  # noqa: BLE001 - the device's out-of-memory error is the measurement
                failed = f"{room:.2f}" + ("" if "RESOURCE_EXHAUSTED" in str(e) else f" ({type(e).__name__})")
                break
            finally:
                ballast.delete()
        self.add(
            "memory bracket",
            temporaries_gib=temporaries / GIB,
            in_use_gib=in_use / GIB,
            limit_gib=limit / GIB,
            ran_with=ran or 0.0,
            note=f"the update ran with {ran} of its compiled temporaries' bytes free, not with {failed}",
        )

    def part_variant(self, variant: Variant) -> None:
        """``variant`` beside the default: its decode at its rows (the default's prompts and keys), or its
        update; GPU-only variants elsewhere only have their compiler options checked."""
        if variant.gpu_only and self.platform != "gpu":
            if (
                variant.gpu_options
            ):  # the option names and values this jaxlib accepts, compiled on this device
                jax.jit(lambda x: x + 1, compiler_options=dict(variant.gpu_options)).lower(1.0).compile()
            self.add(
                f"variant {variant.name}",
                note=f"n/a on {self.platform}: a GPU's; its compiler options compile",
            )
            return
        if variant.tpu_only and self.platform != "tpu":
            self.add(f"variant {variant.name}", note=f"n/a on {self.platform}: a TPU kernel's")
            return
        if variant.exec_time_effort and not effort_options(variant.exec_time_effort):
            self.add(f"variant {variant.name}", note=f"n/a: jax {jax.__version__} has no float efforts")
            return
        if not variant.rows:
            floor, blocks = train_step_module.LOGITS_CHUNK_MIN_TOKENS, attention_module.FLASH_BLOCK_MAX
            if variant.head_chunk_min_tokens is not None:
                train_step_module.LOGITS_CHUNK_MIN_TOKENS = variant.head_chunk_min_tokens
            attention_module.FLASH_BLOCK_MAX = variant.flash_block_max or blocks
            try:  # a new ModelConfig object: a new train step, traced with the variant's chunks and blocks
                with applied(variant):
                    self.part_update(variant.name, dataclasses.replace(self.model_cfg, **dict(variant.model)))
            finally:
                train_step_module.LOGITS_CHUNK_MIN_TOKENS = floor
                attention_module.FLASH_BLOCK_MAX = blocks
            return
        sc = dataclasses.replace(self.sampler_cfg, **dict(variant.sampler))
        with applied(variant):
            self.part_decode(variant.rows, variant.name, sc)

    def pack(self, folder: Path) -> None:
        """A trace folder packed as ``<folder>.tar.gz`` beside it (the device tool brings back no file nested as
        deep as a trace's own), dropped when over 15 MiB (the tool's limit is 16); the folder removed."""
        pack = self.out / f"{folder.name}.tar.gz"
        with tarfile.open(pack, "w:gz") as tar:
            tar.add(folder, arcname=folder.name)
        if pack.stat().st_size > 15 * 2**20:
            print(f"{pack.name}: {pack.stat().st_size / 2**20:.0f} MiB, over what comes back: removed")
            pack.unlink()
        shutil.rmtree(folder, ignore_errors=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    """One line per part: its figures as ``name value``, the note last."""
    lines = [f"{'part':<34} figures"]
    for row in rows:
        figures = "  ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("part", "note"))
        note = f"  [{row['note']}]" if "note" in row else ""
        lines.append(f"{row['part']:<34} {figures}{note}")
    return "\n".join(lines)


def format_comparison(results: dict[str, dict[str, dict]], decode_parts: list[str]) -> str:
    """Variants side by side: decode tokens/s, % of the HBM roofline, ms per step and rows with the default's
    tokens, per row count; the update's MFU and HFU."""
    head = f"{'variant':<48}" + "".join(
        f"{part + ': tok/s, roof, ms/step, same':<46}" for part in decode_parts
    )
    lines = [head + "update: MFU, HFU"]
    for label, parts in results.items():
        cells = []
        for part in decode_parts:
            d = parts.get(part)
            same = f"{d['same_rows']:.0%}" if d and "same_rows" in d else "-"
            cells.append(
                f"{d['tokens_per_s']:>9,.0f} {d['roofline']:6.1%} {d['step_ms']:7.2f} {same:>5}".ljust(46)
                if d
                else "-".ljust(46)
            )
        u = parts.get("update")
        update = f"{u['mfu']:.1%} {u['hfu']:.1%}" if u else "-"
        name = "this commit (the defaults)" if label == "default" else label
        lines.append(f"{name[:47]:<48}{''.join(cells)}{update}")
    return "\n".join(lines)


def main() -> int:
    out = Path(os.environ.get("OUT") or "runs/device_check")
    out.mkdir(parents=True, exist_ok=True)
    backend = jax.default_backend()
    tiny = os.environ.get("DEVICE_CHECK_TINY") == "1" or backend == "cpu"
    enable_compilation_cache(tempfile.mkdtemp(prefix="grpax-jax-cache."))  # as jax_cache_dir, a fresh folder
    check = Check(out, tiny)
    model = "tiny llama (float32)" if tiny else f"{check.cfg.model_name} random init (bfloat16)"
    header = (
        f"device: {len(check.devices)} x {check.devices[0].device_kind} ({backend}), jax {jax.__version__}; "
        f"model: {model}, {check.model_cfg.num_params() / 1e6:,.2f} M params; peaks: {check.bw / 1e12:.3f} TB/s, "
        f"{check.flops / 1e12:.1f} TFLOP/s [{check.peak_source}]"
    )
    print(header, flush=True)
    G = check.grpo.num_generations
    decode_parts = [f"decode {f * check.cfg.batch_size}x{G}" for f in (1, 4)]
    parts = [
        ("setup", PART_SECONDS["setup"], check.setup),
        ("update", PART_SECONDS["update"], check.part_update),
        ("profile", PART_SECONDS["profile"], check.part_profile),
        ("top-k threshold", PART_SECONDS["top-k threshold"], check.part_threshold),
        ("decode", PART_SECONDS["decode 1"], lambda: check.part_decode(1)),
        ("decode profile", PART_SECONDS["decode profile"], check.part_decode_profile),
        ("grpo step", PART_SECONDS["grpo step"], check.part_grpo_step),
        # the job's peak against its plan: before the 32 x 8 decode, whose pool is sized to fill the chip
        ("memory", PART_SECONDS["memory"], check.part_memory),
        ("decode 4x rows", PART_SECONDS["decode 4"], lambda: check.part_decode(4)),
    ]
    chosen = [v for v in VARIANTS if not ONLY_VARIANTS or any(w in v.name for w in ONLY_VARIANTS)]
    parts += [(f"variant {v.name}", v.seconds, lambda v=v: check.part_variant(v)) for v in chosen]
    parts.append(("memory bracket", PART_SECONDS["memory bracket"], check.part_memory_bracket))
    failed = 0

    def write(final: bool) -> str:
        """The tables and the JSON so far (after every part: a run killed by its timeout keeps its figures)."""
        table = (
            f"{header}\n\n{format_table(check.rows)}\n\n{format_comparison(check.results, decode_parts)}\n\n"
            f"{'total' if final else 'so far'} {check.elapsed():.1f} s"
        )
        if tiny:
            table += "\n(tiny model: its weights fit in cache, so the HBM roofline does not bound it; a smoke test)"
        (out / "device_check.txt").write_text(table + "\n")
        (out / "profiles.txt").write_text("\n\n".join(check.profiles) + "\n")
        result = {
            "header": header,
            "rows": check.rows,
            "results": check.results,
            "failed": failed,
            "finished": final,
        }
        (out / "device_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        return table

    # The budget guards a lease; a tiny run (CI, on a CPU) runs every part unless a budget is given.
    budget = BUDGET_S if not tiny or "DEVICE_CHECK_BUDGET_S" in os.environ else float("inf")
    parts = [
        p for p in parts if p[0] not in SKIP and not (p[0].startswith("variant ") and "variants" in SKIP)
    ]
    for name, seconds, part in parts:
        estimate = 0.0 if tiny else seconds  # the H200's estimate; the tiny model's parts take seconds each
        if check.elapsed() + estimate > budget:
            check.add(
                name,
                note=f"skipped: {check.elapsed():.0f} s + ~{estimate:.0f} s > the {budget:.0f} s budget",
            )
            continue
        try:
            part()
        except Exception as e:  # noqa: BLE001 - one line per failed part; the other parts still run
            failed += 1
            check.add(
                name, note=f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            )
            traceback.print_exc(file=sys.stderr)
            if name == "setup":
                break
        finally:
            write(final=False)
    print(f"\n{write(final=True)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
