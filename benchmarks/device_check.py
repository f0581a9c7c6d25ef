"""Accelerator check: GRPO update MFU, sampled decode, one whole GRPO step, peak memory, a profile; one table.

Run by ``benchmarks/device_check.sh`` (which puts the repository and the carried wheels on ``PYTHONPATH``: no
install, no network). On a GPU or TPU it builds a randomly initialised llama3.2-3b in bfloat16 on the device
(``DEVICE_CHECK_MODEL`` names another registered model) and one GRPO job around it, as ``train_rl`` would build
it from its keys (``JOB_KEYS``: 8 prompts x 8 completions, prompts up to 128 tokens, completions up to 256, beta
0.04, temperature 0.9, top-k 50, the model's stop tokens). The whole job of llama3.1-8b does not fit one H200
(``compile_topology=h200-1``: 156 GiB of 140 with AdamW's float32 master copy and the reference); 3B needs 64 GiB.
It then measures, in this order (the likeliest to be cut by the time budget last):

1. ``update``: the job's jitted GRPO update (``make_train_step``: forward, backward, AdamW) on a batch of the
   job's full shape; tokens/s and ``MFU = 6 * params * tokens / time / peak_flops``; one more call is traced
   with ``jax.profiler`` (``$OUT/trace.tar.gz``, for TensorBoard's profile plugin or Perfetto);
2. ``decode``: the rollout's sampler exactly as GRPO samples (``generate``: each prompt prefilled once, G
   completions, temperature, top-k, stop tokens), at the job's 8 x 8 rows and at 32 x 8; useful tokens/s
   (completion tokens before each row's stop) against the HBM roofline, the rows' mean length, the fraction
   of decode row-steps spent past a row's stop;
3. ``grpo step``: ``Rollout`` (sampling + rewards) -> reference logprobs -> ``make_update``, the trainer's
   own objects, split into rollout / reference / update seconds (the second step: the first compiles);
4. ``memory``: the device's peak bytes in use (``memory_stats``) against the fit check's per-device table of
   the same job (``grpax.rl.compile_check.compile_job``, the check ``train_rl`` runs before a run), and how
   many of the fit check's programs were read from JAX's persistent compilation cache (a fresh folder for
   this process, as ``jax_cache_dir`` sets it for a run) instead of being compiled again.

Each part runs in its own ``try``: a failure prints one line and the table keeps the other parts' figures.
Every figure is printed as a table and written to ``$OUT/device_check.{txt,json}`` (``$OUT`` defaults to
``runs/device_check``). With ``DEVICE_CHECK_TINY=1``, or automatically on CPU, a tiny Llama replaces the 8B
model so the whole script runs in about a minute on a CPU. ``DEVICE_CHECK_BUDGET_S`` (default 240) stops
starting new parts after that many seconds. Peak bandwidth and bf16 dense FLOP/s come from ``PEAKS`` by
``device_kind``; an unknown device is measured (a device-side copy, a 4096^3 bf16 matmul).
"""

from __future__ import annotations

import dataclasses
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
from jax.sharding import NamedSharding, PartitionSpec

from grpax import sharding
from grpax.cli.common import enable_compilation_cache
from grpax.config import build_config
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.batch import Batch
from grpax.rl.compile_check import compile_job, model_config
from grpax.rl.fit_report import GIB, format_report
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import TrainState, make_train_step, make_update
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
BUDGET_S = float(os.environ.get("DEVICE_CHECK_BUDGET_S", 240))  # no new part starts after this

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


class Check:
    """The check's job and its measurements: each ``part_*`` method adds rows to ``self.rows``."""

    def __init__(self, out: Path, tiny: bool):
        self.start = time.perf_counter()
        self.out, self.tiny = out, tiny
        self.devices = jax.local_devices()
        self.bw, self.flops, self.peak_source = peak_numbers(self.devices)
        self.cfg, self.model_cfg = job_config(tiny)
        mesh_cfg = dataclasses.replace(self.cfg.mesh(), chips_per_vm=0)
        self.mesh = sharding.create_mesh(mesh_cfg, self.devices)
        self.rollout_mesh = sharding.create_rollout_mesh(mesh_cfg, self.devices)
        self.grpo = self.cfg.grpo()
        self.sampler_cfg = self.cfg.sampler_config(stop_tokens(self.model_cfg, tiny), 0)
        self.rows: list[dict] = []
        self.rng = np.random.default_rng(0)

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
        optimizer, schedule = optimizer_from_config(
            self.grpo, cfg.num_batches * self.grpo.num_iterations, model_cfg.weight_dtype
        )
        self.state = TrainState(
            params=params,
            opt_state=sharding.init_optimizer_state(optimizer, params, mesh),
            step=jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, PartitionSpec())),
        )
        self.train_step = make_train_step(model_cfg, self.grpo, optimizer, cfg.micro_batches, schedule)
        self.add("setup", seconds=time.perf_counter() - t0, note="random init on the devices, AdamW state")

    def part_update(self) -> None:
        """The job's update on a full-shape batch: compile, then two timed calls (the last one counts)."""
        cfg, model_cfg, rng = self.cfg, self.model_cfg, self.rng
        P, G, Lp, C = (
            cfg.batch_size,
            self.grpo.num_generations,
            cfg.max_prefill_predict_length,
            cfg.max_completion_length,
        )
        B, V = P * G, model_cfg.vocab_size
        batch = Batch(
            prompt_ids=rng.integers(1, V, (P, Lp), dtype=np.int32),
            prompt_mask=np.ones((P, Lp), np.int32),
            completion_ids=rng.integers(1, V, (B, C), dtype=np.int32),
            completion_mask=np.ones((B, C), np.int32),
            advantages=rng.standard_normal(B).astype(np.float32),
            rollout_logprobs=np.full((B, C), -np.log(V), np.float32),
            truncated=np.zeros((B,), bool),
            ref_logprobs=np.full((B, C), -np.log(V), np.float32) if self.grpo.beta > 0 else None,
        )
        with jax.set_mesh(self.mesh):
            batch = sharding.shard_global_batch(batch, self.mesh)
            (self.state, metrics), first = _timed(lambda: self.train_step(self.state, batch))
            (self.state, metrics), second = _timed(lambda: self.train_step(self.state, batch))
            (self.state, metrics), run = _timed(lambda: self.train_step(self.state, batch))
        self.batch = batch
        assert not bool(metrics["nonfinite"]), metrics
        tokens = B * (Lp + C)
        self.add(
            f"update {P}x{G} rows of {Lp}+{C}",
            compile_s=max(first - run, 0.0),
            run_s=run,
            tokens_per_s=tokens / run,
            mfu=6 * model_cfg.num_params() * tokens / run / self.flops,
            compiles=self.train_step._cache_size(),
            note=f"second call {second:.3f} s",
        )

    def part_profile(self) -> None:
        """One more update under ``jax.profiler.trace``, packed as ``$OUT/trace.tar.gz`` (the trace's own folders
        are nested deeper than the device tool brings files back from)."""
        folder = self.out / "trace"
        with jax.set_mesh(self.mesh), jax.profiler.trace(str(folder)):
            (self.state, _), traced = _timed(lambda: self.train_step(self.state, self.batch))
        with tarfile.open(self.out / "trace.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname="trace")
        shutil.rmtree(folder, ignore_errors=True)
        size = (self.out / "trace.tar.gz").stat().st_size
        self.add("profile of one update", seconds=traced, mib=size / 2**20, note="$OUT/trace.tar.gz")

    def part_decode(self, num_prompts: int) -> None:
        """The rollout's sampling at ``num_prompts`` x G rows: compile + run, then a timed run (new key)."""
        model_cfg, sc, G = self.model_cfg, self.sampler_cfg, self.grpo.num_generations
        prompts = random_prompts(self.rng, model_cfg.vocab_size, num_prompts, sc.max_prompt_length)
        # As the rollout reads them: on the sampler's mesh (a copy only when its layout differs).
        params, _ = sharding.reshard_for_rollout(self.state.params, self.mesh, self.rollout_mesh)
        with jax.set_mesh(self.rollout_mesh):
            _, first = _timed(lambda: generate(params, prompts, model_cfg, sc, jax.random.key(1), G))
            out, run = _timed(lambda: generate(params, prompts, model_cfg, sc, jax.random.key(2), G))
        lengths = np.asarray(out.completion_mask).sum(axis=1)
        rows = len(lengths)
        # The decode loop runs every row until the longest one stops (or C): the rest is past a row's stop.
        past_stop = 1.0 - lengths.sum() / (rows * max(int(lengths.max()), 1))
        mean_prompt = float(np.mean([len(p) for p in prompts]))
        roof = decode_roofline(model_cfg, rows, int(mean_prompt), int(lengths.mean()), self.bw, self.flops)
        tps = lengths.sum() / run
        self.add(
            f"decode {num_prompts}x{G} rows, sampled",
            compile_s=max(first - run, 0.0),
            run_s=run,
            tokens_per_s=tps,
            mean_length=float(lengths.mean()),
            stopped=float(np.mean([r == "stop" for r in out.finish_reason])),
            past_stop=past_stop,
            note=f"T {sc.temperature}, top-k {sc.top_k}; roofline {roof:,.0f} tok/s, {tps / roof:.1%} of it",
        )

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
    parts = [
        ("setup", check.setup),
        ("update", check.part_update),
        ("profile", check.part_profile),
        ("decode", lambda: check.part_decode(check.cfg.batch_size)),
        ("decode", lambda: check.part_decode(4 * check.cfg.batch_size)),
        ("grpo step", check.part_grpo_step),
        ("memory", check.part_memory),
    ]
    failed = 0

    def write(final: bool) -> str:
        """The table and the JSON so far (after every part: a run killed by its timeout keeps its figures)."""
        table = f"{header}\n\n{format_table(check.rows)}\n\n{'total' if final else 'so far'} {check.elapsed():.1f} s"
        if tiny:
            table += "\n(tiny model: its weights fit in cache, so the HBM roofline does not bound it; a smoke test)"
        (out / "device_check.txt").write_text(table + "\n")
        result = {"header": header, "rows": check.rows, "failed": failed, "finished": final}
        (out / "device_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        return table

    for name, part in parts:
        if check.elapsed() > BUDGET_S:
            check.add(name, note=f"skipped: past the {BUDGET_S:.0f} s budget")
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
