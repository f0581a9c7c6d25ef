"""Llama 3.1 8B QLoRA GRPO on one TPU v5e: the seed's job on an nf4 base, its memory plan, and three measured steps.

The seed's command (README, "The 8B workflow") with ``lora_rank=16 lora_base_dtype=nf4`` plans the job to fit one
v5e (15.75 GiB): LoRA adapters and their AdamW state in float32, the frozen base held as the forward reads it
(``lora.frozen_base``: the layers' projections in NF4, the embedding, head and norms in bfloat16; also the
reference, adapters off), remat full (docs/benchmarks.md, "Llama 3.1 8B QLoRA on one v5e": 10.87 GiB compiled for
``compile_topology=v5e-1``). This script runs that job as ``train_rl`` builds it, on random weights, with the parts
of ``h200_8b_step.py`` (no checkpoint, no tokenizer, no dataset: random prompts, a fixed reward of the tokens):

1. ``plan``: the auto keys chosen from the chip's memory limit, the estimate of the chosen job and, unless
   ``--no_fit_check``, the fit check compiled for this chip (``compile_check.compile_job``: the four programs a
   step runs, into a fresh compilation cache the steps read back), as ``h200_8b_step.plan``;
2. ``setup``: the frozen base drawn at random leaf by leaf directly as the run holds it (``init_frozen_base``: the
   8B base is 16 GB in bfloat16, 32 GB in float32, so it is never whole before quantisation), then the trainer's
   order: ``Policy`` (its fingerprint), the reference (the base itself), the adapters and their AdamW state;
3. ``step 1..N``: ``Rollout`` (sampling with the adapters on the base, rewards, the reference pass) then
   ``make_update``, the trainer's own objects in ``trainer._next_batch``'s order; seconds of the step, rollout,
   reference pass and update, completion tokens per second, the device's peak bytes in use after each phase,
   and the programs each part obtained (compiled, or read from the compilation cache);
4. ``memory``: the measured peak against the estimate and the compiled fit check. The TPU runtime's
   ``peak_bytes_in_use`` left programs' temporaries out (docs/benchmarks.md, fifth session): expect it near the
   resident arrays (base 5.61 GiB, adapters and their state 0.47, KV pool 1.00), below the plan's peak.

Every part prints its line as it ends and rewrites ``$OUT/v5e_8b_qlora_step.{txt,json}`` (a command cut by its
timeout keeps what it measured). ``--tiny`` runs a 2-layer model of the same dtypes and keys with short rows, any
``key=value`` overrides a ``train_rl`` key (``max_target_length=384`` shortens the completions); on CPU:
``JAX_PLATFORMS=cpu python benchmarks/v5e_8b_qlora_step.py --tiny`` (two minutes on 2 cores, one with
``--no_fit_check``). The compiler's log lines (each program's seconds as it ends) go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from h200_8b_step import SEED_KEYS as H200_SEED_KEYS
from h200_8b_step import Table, job_config, peak_gib, plan, random_rows, score

from grpax import sharding
from grpax.cli.common import enable_compilation_cache
from grpax.compiles import CompileLog
from grpax.models import lora as lora_lib
from grpax.models import quantize as quant
from grpax.models.params import abstract_params
from grpax.models.registry import ModelConfig
from grpax.plan import compile_check
from grpax.plan.fit_report import GIB
from grpax.rl import trainer
from grpax.rl.policy import Policy
from grpax.rl.resume import RunPaths
from grpax.rl.rollout import Rollout
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import make_update
from grpax.sharding import mesh_context

NAME = "v5e_8b_qlora_step"
# The seed's 8B command, one v5e chip, with LoRA on an nf4 base (docs/benchmarks.md's compile_topology=v5e-1 keys).
SEED_KEYS = {**H200_SEED_KEYS, "num_test_batches": 10, "lora_rank": 16, "lora_base_dtype": "nf4"}
# The base's draws use XLA's RngBitGenerator: compiled for a v5e by libtpu on a 2-core host, the embedding's draw
# took 6.4 s against threefry's 15.8 (the random values only need to be small; this is no parity test).
DRAW_PRNG = "rbg"
DRAW_BLOCKS = 16  # a dense weight is drawn in up to this many blocks of its leading axis


def _quantized(x) -> bool:
    return isinstance(x, quant.QuantizedWeight)


@functools.cache
def _dense_init(shape: tuple, dtype, sharding_, fill: float | None):
    """A jitted draw of one weight: normal(0, 0.02) (as ``init_params``) in blocks of its leading axis (the
    embedding's float32 random bits would take 2 GiB at once, a block's a sixteenth), or ``fill``
    everywhere (norms)."""
    n = math.gcd(shape[0], DRAW_BLOCKS)

    def block(key):
        return (0.02 * jax.random.normal(key, (shape[0] // n, *shape[1:]), jnp.float32)).astype(dtype)

    def draw(key):
        if fill is not None:
            return jnp.full(shape, fill, dtype)
        return jax.lax.map(block, jax.random.split(key, n)).reshape(shape)

    return jax.jit(draw, out_shardings=sharding_)


@functools.cache
def _quantized_init(shape: tuple, dtype, num_lead: int, target: quant.QuantizedWeight):
    """A jitted draw of one quantised weight of ``shape`` [*lead, *in, *out] in ``dtype`` (the base's
    ``weight_dtype``, as loaded), quantised as ``quantize_base`` does, one layer at a time (``lax.map`` over the
    stacked layers): the device holds one layer's float32 values, never the stack's. ``target``: the abstract
    ``QuantizedWeight`` (its scheme and placement)."""

    def one(key):
        w = (0.02 * jax.random.normal(key, shape[num_lead:], jnp.float32)).astype(dtype)
        return quant.quantize(w, target.qtype, target.num_out_axes)

    def draw(key):
        return jax.lax.map(one, jax.random.split(key, shape[0])) if num_lead else one(key)

    out = jax.eval_shape(draw, jax.random.key(0, impl=DRAW_PRNG))
    assert (out.qvalue.shape, out.scale.shape) == (target.qvalue.shape, target.scale.shape), (out, target)
    return jax.jit(
        draw, out_shardings=target.replace(qvalue=target.qvalue.sharding, scale=target.scale.sharding)
    )


def init_frozen_base(cfg: TrainConfig, model_cfg: ModelConfig, mesh, key: jax.Array):
    """Random frozen base as ``Policy`` holds it for ``cfg`` (``lora.frozen_base(params, lora_base_dtype)`` of
    ``init_params``'s draws, placed by the rules table on ``mesh``), each leaf drawn by its own program in its final
    dtype and placement, with its own key, one after another: the peak is what is built plus one leaf's draw.

    Returns:
      The base tree: ``QuantizedWeight``s (codes and float32 scales) for the layers' projections, the other
      weights in the compute dtype ``model_cfg.dtype`` (normal(0, 0.02), norms 1 - norm_offset).
    """
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_params(model_cfg),
        sharding.param_shardings(model_cfg, mesh),
    )
    target = lora_lib.frozen_base(params, cfg.lora_base_dtype, model_cfg)
    num_lead = int(isinstance(params["layers"], dict))  # the stacked layers' axis
    counter = itertools.count()

    def leaf(path, want, full):
        k = jax.random.fold_in(key, next(counter))
        if _quantized(want):
            fn = _quantized_init(full.shape, full.dtype, num_lead, want)
        else:
            name = str(path[-1].key)
            fill = {"norm": 1.0 - model_cfg.norm_offset, "bias": 0.0}.get(name[-4:])  # as init_params
            fn = _dense_init(want.shape, want.dtype, want.sharding, fill)
        return jax.block_until_ready(fn(k))

    return jax.tree_util.tree_map_with_path(leaf, target, params, is_leaf=_quantized)


def _compiles(programs: CompileLog, phase: str, out: Path) -> dict:
    """A part's programs obtained, compiled (not read from the compilation cache) and their seconds; the whole
    ledger so far (the largest programs of each part named) to ``out/compiles.txt``."""
    (out / "compiles.txt").write_text(programs.table() + "\n")
    row = programs.summary().get(phase, {"programs": 0, "compiled": 0, "seconds": 0.0})
    return {"programs": int(row["programs"]), "compiled": int(row["compiled"]), "compile_s": row["seconds"]}


def _compiled_names(programs: CompileLog, phase: str) -> str:
    """``; compiled: name 1.2 s, ...``: the programs ``phase`` compiled, the largest first ('' if none)."""
    largest = sorted(programs.compiled_in(phase), key=lambda p: -p.seconds)[:4]
    return "; compiled: " + ", ".join(f"{p.name} {p.seconds:.1f} s" for p in largest) if largest else ""


def run(cfg: TrainConfig, model_cfg: ModelConfig, devices, table: Table, num_steps: int, programs) -> None:
    """Setup and ``num_steps`` GRPO steps as the trainer runs them with LoRA, each a row of ``table``."""
    mesh, rollout_mesh = sharding.create_meshes(dataclasses.replace(cfg.mesh(), chips_per_vm=0), devices)
    grpo, device = cfg.grpo(), devices[0]
    closing = contextlib.ExitStack()
    t0 = time.perf_counter()
    with programs.phase("setup"):
        base = init_frozen_base(cfg, model_cfg, mesh, jax.random.key(cfg.seed, impl=DRAW_PRNG))
        t_base = time.perf_counter() - t0
        # the base comes as frozen_base holds it: Policy's frozen_base(base, "") keeps every leaf as it is
        policy = Policy(cfg.lora(), base, "", "", cfg.lora_sampler, model_cfg)
        del base
        reference = trainer._reference(cfg, policy.base, model_cfg, RunPaths.of(cfg), closing, frozen=True)
        trainable = policy.init_trainable(None, model_cfg, mesh, cfg.seed)
        options = trainer._training_compile_options(cfg, model_cfg, mesh)
        state, train_step = trainer._init_state(cfg, grpo, trainable, model_cfg, mesh, policy, options)
        jax.block_until_ready(state)
    stops = model_cfg.eos_token_ids or (model_cfg.vocab_size - 1,)
    rollout = Rollout(
        model_cfg, cfg.sampler_config(stops, stops[0]), grpo, score, mesh=mesh, rollout_mesh=rollout_mesh,
        reference=reference, num_micro_batches=cfg.micro_batches, logprobs_options=options,
    )  # fmt: skip
    update = make_update(train_step, grpo.num_iterations)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(policy.base))
    table.add(
        "setup", seconds=time.perf_counter() - t0, base_s=t_base, base_gib=base_bytes / GIB,
        peak_gib=peak_gib(device), **_compiles(programs, "setup", table.out),
        note=f"random frozen base ({cfg.lora_base_dtype} projections, the rest {model_cfg.dtype}), adapters "
        f"rank {cfg.lora_rank}, AdamW; sampler {policy.sampler}",
    )  # fmt: skip
    table.write(False)
    rng = np.random.default_rng(0)
    for i in range(num_steps):
        rows = random_rows(rng, model_cfg.vocab_size, cfg.batch_size, cfg.max_prefill_predict_length)
        with programs.phase(f"step {i + 1}"):
            t0 = time.perf_counter()
            rollout.update_params(policy.sampler_params(state.params), i)
            batch = rollout(rows, jax.random.key(10 + i))
            # as trainer._next_batch: the sampler's params go before the update
            rollout.update_params(None, i)
            t1 = time.perf_counter()
            after_rollout = peak_gib(device)
            with mesh_context(mesh):  # as the trainer calls it
                state, metrics = update(state, batch)
            jax.block_until_ready(state)
            t2 = time.perf_counter()
        host = batch.host
        tokens = int(host.completion_lengths.sum())
        table.add(
            f"step {i + 1}",
            step_s=t2 - t0, rollout_s=host.timings["time/rollout_s"], rewards_s=host.timings["time/rewards_s"],
            reference_s=host.timings["time/reference_s"], update_s=t2 - t1, tokens_per_s=tokens / (t2 - t0),
            peak_after_rollout_gib=after_rollout, peak_after_update_gib=peak_gib(device),
            **_compiles(programs, f"step {i + 1}", table.out),
            note=f"{tokens} completion tokens, mean {host.completion_lengths.mean():.0f} of "
            f"{cfg.max_completion_length}; nonfinite {bool(metrics['nonfinite'])}"
            + _compiled_names(programs, f"step {i + 1}"),
        )  # fmt: skip
        table.write(False)
    closing.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, short rows (a CPU proof)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no_fit_check", action="store_true", help="skip compiling the fit check (minutes)")
    parser.add_argument("keys", nargs="*", help="train_rl keys, key=value")
    args = parser.parse_args()
    logging.basicConfig(
        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.WARNING, force=True
    )
    for name in ("grpax.compile_check", "grpax.memory_plan", "grpax.train"):  # each compile as it ends
        logging.getLogger(name).setLevel(logging.INFO)
    out = Path(os.environ.get("OUT") or f"runs/{NAME}")
    out.mkdir(parents=True, exist_ok=True)
    enable_compilation_cache(tempfile.mkdtemp(prefix="grpax-jax-cache."))  # as jax_cache_dir, a fresh folder
    devices = jax.local_devices()[:1]
    # a CPU's sampler_programs=auto is adaptive: the tiny job takes the fixed set a TPU's auto takes, so that its
    # steps read the fit check's programs back as the chip's do
    tiny_keys = ["sampler_programs=fixed"] if args.tiny else []
    cfg = job_config(args.tiny, tiny_keys + args.keys, out, SEED_KEYS, NAME)
    header = (
        f"device: {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}; model: "
        f"{cfg.model_name or 'tiny llama'} random init, LoRA rank {cfg.lora_rank} on a {cfg.lora_base_dtype} base; "
        f"{cfg.batch_size} x {cfg.num_generations} rows of {cfg.max_prefill_predict_length} + "
        f"{cfg.max_completion_length} tokens, beta {cfg.beta}"
    )
    table = Table(out, header, NAME)
    failed = 0
    with CompileLog() as programs:
        try:
            with programs.phase("plan"):
                cfg = plan(cfg, devices, table, fit_check=not args.no_fit_check)
            model_cfg = compile_check.model_config(cfg)
            run(cfg, model_cfg, devices, table, args.steps, programs)
        except Exception as e:  # noqa: BLE001 - one line in the table; the figures so far are kept
            failed = 1
            table.add("failed", note=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc(file=sys.stderr)
    peak = peak_gib(devices[0])
    if peak is not None:
        against = {name: peak * GIB / b for name, b in getattr(table, "fit", {}).items()}
        table.add(
            "memory", peak_gib=peak, note=", ".join(f"measured / {k} {v:.3f}" for k, v in against.items())
        )
    table.write(True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
