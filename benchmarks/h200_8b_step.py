"""Llama 3.1 8B full-parameter GRPO on one GPU: the seed's job, its memory plan, and three measured steps.

The seed's command (README, "The 8B workflow") with ``compile_topology=h200-1`` plans the job to fit one H200 with
a tenth of it free: float32 weights and AdamW state on the device, the frozen reference rounded to bfloat16 as
the forward reads it (``reference_dtype=compute``) and kept in host memory (``reference_memory=auto`` ->
``pinned_host``; docs/scaling.md, "One H200"). This script runs that job as ``train_rl`` builds it, on random
weights (no checkpoint, no tokenizer, no dataset: random prompts, a fixed reward of the completions' tokens):

1. ``plan``: the auto keys chosen from the device's memory limit (``grpax.plan.memory_plan.choose``), the NVIDIA
   estimate of the chosen job (``grpax.plan.memory_estimate``: what ``compile_topology=h200-1`` prints) and, unless
   ``--no_fit_check``, the fit check compiled for this device (``compile_check.compile_job``: what ``train_rl``
   runs before a run; its programs go to a fresh compilation cache the steps read back);
2. ``setup``: random init in float32 on the device, the reference as the trainer makes it
   (``trainer._reference``), AdamW's state: the trainer's order;
3. ``step 1..N``: ``Rollout`` (sampling, rewards, the reference pass) then ``make_update``: the trainer's own
   objects; seconds of the step, its rollout, reference pass (with the reference's copy from host memory) and
   update, completion tokens per second, and the device's peak bytes in use after each phase;
4. ``reference``: the first step's reference logprobs again from the float32 params themselves: the bfloat16
   copy must give the same values (0 difference: ``round_as_read``'s claim, on this device's kernels);
5. ``memory``: the measured peak against the estimate and the compiled fit check.

Every part prints its line as it ends and rewrites ``$OUT/h200_8b_step.{txt,json}`` (a command cut by its
timeout keeps what it measured). JAX's allocator takes 75% of a GPU unless told: the script sets
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` before JAX starts unless it is set. ``--tiny`` runs a 2-layer model of
the same dtypes with short rows, any ``key=value`` overrides a ``train_rl`` key; on CPU:
``JAX_PLATFORMS=cpu python benchmarks/h200_8b_step.py --tiny reference_memory=pinned_host`` (a minute).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # before JAX starts: the plan needs 88% of it

import argparse  # noqa: E402  (the environment above first)
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from grpax import sharding  # noqa: E402
from grpax.cli.common import enable_compilation_cache  # noqa: E402
from grpax.config import build_config  # noqa: E402
from grpax.models.params import init_params  # noqa: E402
from grpax.models.registry import ModelConfig, to_hf_config  # noqa: E402
from grpax.plan import compile_check, memory_estimate, memory_plan  # noqa: E402
from grpax.plan.fit_report import GIB, format_report  # noqa: E402
from grpax.plan.topology import Chip, chip_of  # noqa: E402
from grpax.rl import trainer  # noqa: E402
from grpax.rl.optim import optimizer_from_config  # noqa: E402
from grpax.rl.resume import RunPaths  # noqa: E402
from grpax.rl.rollout import Rollout  # noqa: E402
from grpax.rl.train_config import TrainConfig  # noqa: E402
from grpax.rl.train_step import TrainState, compute_logprobs, make_train_step, make_update  # noqa: E402

# The seed's 8B command (README), one GPU.
SEED_KEYS = dict(
    model_name="llama3.1-8b-Instruct", chips_per_vm=1, num_batches=50, rollout_data_parallelism=1,
    rollout_tensor_parallelism=-1,
)  # fmt: skip
TINY_KEYS = dict(
    model_name="", chips_per_vm=0, batch_size=2, num_generations=4, max_prefill_predict_length=16,
    max_target_length=48, dtype="bfloat16", weight_dtype="float32",
)  # fmt: skip
TINY_MODEL = ModelConfig(
    vocab_size=512, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
    eos_token_ids=(1,),
)  # fmt: skip


class Table:
    """The parts' figures, printed as each ends and written to ``$OUT`` after every part."""

    def __init__(self, out: Path, header: str, name: str = "h200_8b_step"):
        self.out, self.header, self.name, self.rows, self.start = out, header, name, [], time.perf_counter()
        print(header, flush=True)

    def add(self, part: str, **figures) -> None:
        self.rows.append({"part": part, **figures})
        shown = "  ".join(f"{k} {_fmt(v)}" for k, v in figures.items() if k != "note")
        note = f"  [{figures['note']}]" if "note" in figures else ""
        print(f"{part:<22} {shown}{note}", flush=True)

    def write(self, final: bool) -> None:
        lines = [self.header, ""]
        for row in self.rows:
            figures = "  ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("part", "note"))
            lines.append(f"{row['part']:<22} {figures}" + (f"  [{row['note']}]" if "note" in row else ""))
        lines.append(f"\n{'total' if final else 'so far'} {time.perf_counter() - self.start:.1f} s")
        (self.out / f"{self.name}.txt").write_text("\n".join(lines) + "\n")
        record = {"header": self.header, "rows": self.rows, "finished": final}
        (self.out / f"{self.name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def peak_gib(device) -> float | None:
    """The device's peak bytes in use so far, GiB (None where it reports none: a CPU)."""
    stats = device.memory_stats() or {}
    return stats["peak_bytes_in_use"] / GIB if "peak_bytes_in_use" in stats else None


def job_config(
    tiny: bool, overrides: list[str], out: Path, seed_keys: dict = SEED_KEYS, run_name: str = "h200_8b_step"
) -> TrainConfig:
    """The seed's keys (or the tiny job's, its model's config.json under ``out``) with ``overrides``."""
    keys = {**seed_keys, "base_output_directory": str(out), "run_name": run_name}
    if tiny:
        folder = out / "tiny_model"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(to_hf_config(TINY_MODEL, "float32")))
        keys.update(TINY_KEYS, load_parameters_path=str(folder))
    return build_config(TrainConfig, [*(f"{k}={v}" for k, v in keys.items()), *overrides])


def plan(cfg: TrainConfig, devices, table: Table, fit_check: bool) -> TrainConfig:
    """The auto keys chosen for this device's memory limit, the estimate of the chosen job and its compiled
    fit check; returns the chosen keys."""
    device = devices[0]
    stats = device.memory_stats() or {}
    limit = int(stats.get("bytes_limit", 0)) or memory_estimate.GPUS["h200"].hbm_bytes
    chip = memory_estimate.GPUS["h200"] if device.platform == "gpu" else chip_of(device.device_kind)
    chip = dataclasses.replace(chip or Chip(device.device_kind, limit, 0.0, 0.0, 1), hbm_bytes=limit)
    # A CPU chooses as a GPU would (train_rl on a CPU takes full remat): the tiny job proves the plan's path.
    chosen = memory_plan.choose(
        cfg, chip, len(devices), "gpu" if device.platform == "cpu" else device.platform
    )
    estimate = memory_estimate.estimate_job(chosen, chip, len(devices), "this device (estimate)")
    (table.out / "estimate.txt").write_text(format_report(chosen, estimate, len(devices)) + "\n")
    figures = dict(limit_gib=limit / GIB, estimate_gib=estimate.peak / GIB)
    table.fit = {"estimate": estimate.peak}
    if fit_check:
        t0 = time.perf_counter()
        report = compile_check.compile_job(chosen, devices, "this device", limit, None, None)
        (table.out / "fit_report.txt").write_text(format_report(chosen, report, len(devices)) + "\n")
        figures.update(fit_check_gib=report.peak / GIB, fit_check_s=time.perf_counter() - t0)
        table.fit["fit check"] = report.peak
    keys = f"remat_policy={chosen.remat_policy} reference_memory={chosen.reference_memory}"
    table.add(
        "plan", **figures, note=f"{keys} ({memory_plan.describe(cfg, chosen) or 'as given'}); $OUT/*.txt"
    )
    return chosen


def random_rows(rng, vocab: int, num: int, longest: int) -> list[dict]:
    """``num`` prompts of random tokens, lengths in [longest / 2, longest], the first one ``longest``."""
    lengths = rng.integers(longest // 2, longest + 1, num)
    lengths[0] = longest  # every step in the same (longest) prompt bucket: one compile per shape
    return [{"prompt_ids": rng.integers(2, vocab, n).tolist()} for n in lengths]


def score(rows, out):
    """Rewards from the completions' tokens (random weights solve nothing): any fixed function of them."""
    total = [
        float(hash(tuple(ids[m.astype(bool)].tolist())) % 7)
        for ids, m in zip(out.completion_ids, out.completion_mask, strict=True)
    ]
    return {"total": total}, np.zeros(len(rows))


def run(cfg: TrainConfig, model_cfg: ModelConfig, devices, table: Table, num_steps: int, check: bool) -> None:
    """Setup, ``num_steps`` GRPO steps and the reference check, each a row of ``table``."""
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    mesh, rollout_mesh = sharding.create_meshes(mesh_cfg, devices)
    grpo, device = cfg.grpo(), devices[0]
    t0 = time.perf_counter()
    init = jax.jit(
        lambda k: init_params(model_cfg, k), out_shardings=sharding.param_shardings(model_cfg, mesh)
    )
    params = jax.block_until_ready(init(jax.random.key(0)))
    closing = contextlib.ExitStack()
    reference = trainer._reference(cfg, params, model_cfg, RunPaths.of(cfg), closing)  # the trainer's order
    optimizer, schedule = optimizer_from_config(
        grpo, cfg.num_batches * grpo.num_iterations, model_cfg.weight_dtype
    )
    state = TrainState(
        params=params,
        opt_state=sharding.init_optimizer_state(optimizer, params, mesh),
        step=jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, PartitionSpec())),
    )
    del params
    train_step = make_train_step(
        model_cfg,
        grpo,
        optimizer,
        cfg.micro_batches,
        schedule,
        max_completion_length=cfg.max_completion_length,
    )
    stops = model_cfg.eos_token_ids or (model_cfg.vocab_size - 1,)
    rollout = Rollout(
        model_cfg, cfg.sampler_config(stops, stops[0]), grpo, score, mesh=mesh, rollout_mesh=rollout_mesh,
        reference=reference, num_micro_batches=cfg.micro_batches,
    )  # fmt: skip
    update = make_update(train_step, grpo.num_iterations)
    table.add("setup", seconds=time.perf_counter() - t0, peak_gib=peak_gib(device), note="random init, AdamW")
    table.write(False)
    rng = np.random.default_rng(0)
    for i in range(num_steps):
        rows = random_rows(rng, model_cfg.vocab_size, cfg.batch_size, cfg.max_prefill_predict_length)
        t0 = time.perf_counter()
        rollout.update_params(state.params, i)
        batch = rollout(rows, jax.random.key(10 + i))
        t1 = time.perf_counter()
        after_rollout = peak_gib(device)
        if i == 0 and check and batch.ref_logprobs is not None:
            # the same pass on the float32 params themselves (the state's: not donated here)
            with jax.set_mesh(mesh):
                direct = compute_logprobs(state.params, batch, model_cfg, grpo.temperature, cfg.micro_batches)
            diff = float(jnp.max(jnp.abs(direct - batch.ref_logprobs)))
            table.add("reference", max_abs_diff=diff, note="float32 params vs the reference's rounded copy")
        t2 = time.perf_counter()
        with jax.set_mesh(mesh):  # as the trainer calls it
            state, metrics = update(state, batch)
        t3 = time.perf_counter()
        host = batch.host
        tokens = int(host.completion_lengths.sum())
        step_s = (t1 - t0) + (t3 - t2)
        table.add(
            f"step {i + 1}",
            step_s=step_s, rollout_s=host.timings["time/rollout_s"], rewards_s=host.timings["time/rewards_s"],
            reference_s=host.timings["time/reference_s"], update_s=t3 - t2, tokens_per_s=tokens / step_s,
            peak_after_rollout_gib=after_rollout, peak_after_update_gib=peak_gib(device),
            note=f"{tokens} completion tokens, mean {host.completion_lengths.mean():.0f} of "
            f"{cfg.max_completion_length}; nonfinite {bool(metrics['nonfinite'])}" + (" (compiles)" if i == 0 else ""),
        )  # fmt: skip
        table.write(False)
    closing.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, short rows (a CPU proof)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no_fit_check", action="store_true", help="skip compiling the fit check (minutes)")
    parser.add_argument("--no_reference_check", action="store_true")
    parser.add_argument("keys", nargs="*", help="train_rl keys, key=value")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or "runs/h200_8b_step")
    out.mkdir(parents=True, exist_ok=True)
    enable_compilation_cache(tempfile.mkdtemp(prefix="grpax-jax-cache."))  # as jax_cache_dir, a fresh folder
    devices = jax.local_devices()[:1]
    cfg = job_config(args.tiny, args.keys, out)
    header = (
        f"device: {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}, "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']}; model: "
        f"{cfg.model_name or 'tiny llama'} random init; {cfg.batch_size} x {cfg.num_generations} rows of "
        f"{cfg.max_prefill_predict_length} + {cfg.max_completion_length} tokens, beta {cfg.beta}"
    )
    table = Table(out, header)
    failed = 0
    try:
        cfg = plan(cfg, devices, table, fit_check=not args.no_fit_check)
        model_cfg = compile_check.model_config(cfg)
        run(cfg, model_cfg, devices, table, args.steps, check=not args.no_reference_check)
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
