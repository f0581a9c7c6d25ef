"""Accelerator check: decode tokens/s against the HBM roofline and GRPO train-step MFU, in one table.

Run by ``benchmarks/device_check.sh`` after the parity tests. On a GPU or TPU it builds a randomly initialised
llama3.1-8b in bfloat16 on the device (no download, no network) and measures:

* decode tokens/s of ``generate_padded`` at batch 1, 64 and 256 (prompt 128 tokens, 128 new tokens, no stop
  token), against the HBM roofline: each decode step reads all weights plus the filled KV cache, so
  ``tokens/s <= B / max(step_bytes / bandwidth, step_flops / peak_flops)``;
* training tokens/s and MFU of one jitted GRPO train step (``make_train_step``: forward, backward, AdamW) on
  16 rows of 128 + 128 tokens with full rematerialisation: ``MFU = 6 * params * tokens / time / peak_flops``.

Peak bandwidth and bf16 dense FLOP/s come from ``PEAKS`` by ``device_kind``; an unknown device is measured
(a device-side copy for bandwidth, a bf16 4096^3 matmul for FLOP/s). Compile time is reported apart from run
time. With ``DEVICE_CHECK_TINY=1``, or automatically on CPU, a tiny Llama replaces the 8B model so the whole
script runs in seconds. ``DEVICE_CHECK_BACKEND`` sets the sampler's backend (``SamplerConfig.backend``: auto,
the default, xla or cpu). Every figure is per the devices used (all local devices, tensor parallel).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpax import sharding
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig, get_model_config
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import make_optimizer
from grpax.rl.train_step import TrainState, make_train_step
from grpax.sampler.engine import SamplerConfig, generate_padded

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
BATCHES = (1, 64, 256)
BUDGET_S = float(os.environ.get("DEVICE_CHECK_BUDGET_S", 230))  # stop starting new measurements after this


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
    return (*measure_peaks(devices[0]), f"measured ({kind})")


def measure_peaks(device) -> tuple[float, float]:
    """Measured (bytes/s, FLOP/s) of one device: a jitted copy of 256 MiB and a bf16 matmul (best of 5)."""
    n_bytes = 256 * 2**20 if device.platform != "cpu" else 64 * 2**20
    x = jax.device_put(jnp.ones((n_bytes // 4,), jnp.float32), device)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    bw = 2 * n_bytes / min(_timed(lambda: copy(x))[1] for _ in range(5))
    n = 4096 if device.platform != "cpu" else 512
    dtype = jnp.bfloat16 if device.platform != "cpu" else jnp.float32
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    flops = 2 * n**3 / min(_timed(lambda: mm(a))[1] for _ in range(5))
    return bw, flops


def model_config(tiny: bool) -> ModelConfig:
    if tiny:
        return ModelConfig(
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
    return get_model_config("llama3.1-8b", dtype="bfloat16", weight_dtype="bfloat16")


def decode_roofline(cfg: ModelConfig, B: int, P: int, C: int, bw: float, flops: float) -> float:
    """Upper bound on decode tokens/s: weights + average filled KV cache per step, or matmul FLOPs."""
    itemsize = jnp.dtype(cfg.weight_dtype).itemsize
    avg_len = P + C / 2
    kv_bytes = (
        2 * cfg.num_layers * B * avg_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    )
    step_bytes = cfg.num_params() * itemsize + kv_bytes
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_dim)
    step_flops = 2 * B * matmul_params + 4 * B * cfg.num_layers * cfg.num_heads * cfg.head_dim * avg_len
    return B / max(step_bytes / bw, step_flops / flops)


def bench_decode(params, cfg: ModelConfig, B: int, P: int, C: int, mesh) -> dict:
    sc = SamplerConfig(
        max_prompt_length=P,
        max_completion_length=C,
        greedy=True,
        stop_token_ids=(),
        pad_token_id=0,
        backend=os.environ.get("DEVICE_CHECK_BACKEND", "auto"),
    )
    rng = np.random.default_rng(B)
    tokens = rng.integers(1, cfg.vocab_size, (B, P), dtype=np.int32)
    lengths = np.full((B,), P, np.int32)
    key = jax.random.key(0)
    with jax.set_mesh(mesh):
        tokens, lengths = sharding.shard_global_batch((tokens, lengths), mesh)
        out, first = _timed(lambda: generate_padded(params, tokens, lengths, key, cfg, sc))
        out, run = _timed(lambda: generate_padded(params, tokens, lengths, key, cfg, sc))
    assert int(np.asarray(jax.device_get(out["lengths"])).min()) == C  # no stop token: every row decodes C
    return {"compile_s": max(first - run, 0.0), "run_s": run, "tokens_per_s": B * C / run}


def bench_train(params, cfg: ModelConfig, rows: int, P: int, C: int, mesh, peak_flops: float) -> dict:
    grpo = GRPOConfig(beta=0.0, num_generations=2, learning_rate=1e-6)
    optimizer = make_optimizer(1e-6, 10)
    state = TrainState(
        params=params,
        opt_state=sharding.init_optimizer_state(optimizer, params, mesh),
        step=jnp.zeros((), jnp.int32),
    )
    step = make_train_step(cfg, grpo, optimizer, num_micro_batches=1)
    rng = np.random.default_rng(0)
    batch = {
        "prompt_ids": rng.integers(1, cfg.vocab_size, (rows, P), dtype=np.int32),
        "prompt_mask": np.ones((rows, P), np.int32),
        "completion_ids": rng.integers(1, cfg.vocab_size, (rows, C), dtype=np.int32),
        "completion_mask": np.ones((rows, C), np.int32),
        "advantages": rng.standard_normal(rows).astype(np.float32),
        "old_logprobs": np.full((rows, C), -np.log(cfg.vocab_size), np.float32),
    }
    with jax.set_mesh(mesh):
        batch = sharding.shard_global_batch(batch, mesh)
        (state, metrics), first = _timed(lambda: step(state, batch))
        (state, metrics), run = _timed(lambda: step(state, batch))
    assert not bool(metrics["nonfinite"]), metrics
    tokens = rows * (P + C)
    return {
        "compile_s": max(first - run, 0.0),
        "run_s": run,
        "tokens_per_s": tokens / run,
        "mfu": 6 * cfg.num_params() * tokens / run / peak_flops,
    }


def main() -> None:
    start = time.perf_counter()
    backend = jax.default_backend()
    tiny = os.environ.get("DEVICE_CHECK_TINY") == "1" or backend == "cpu"
    devices = jax.local_devices()
    bw, flops, source = peak_numbers(devices)
    cfg = model_config(tiny)
    mesh = sharding.create_mesh(
        sharding.MeshConfig(ici_fsdp_parallelism=1, ici_tensor_parallelism=-1, dcn_data_parallelism=1),
        devices=devices,
    )
    model = "tiny llama (float32)" if tiny else "llama3.1-8b random init (bfloat16)"
    print(
        f"device: {len(devices)} x {devices[0].device_kind} ({backend}); model: {model}, "
        f"{cfg.num_params() / 1e6:,.2f} M params; peaks: {bw / 1e12:.3f} TB/s, {flops / 1e12:.1f} TFLOP/s "
        f"[{source}]",
        flush=True,
    )
    t0 = time.perf_counter()
    shardings = sharding.param_shardings(cfg, mesh)
    params = jax.jit(lambda k: init_params(cfg, k), out_shardings=shardings)(jax.random.key(0))
    params = jax.block_until_ready(params)
    print(f"init params on device: {time.perf_counter() - t0:.1f} s", flush=True)

    P = C = 128
    rows = []
    for B in BATCHES:
        if time.perf_counter() - start > BUDGET_S:
            rows.append((f"decode B={B}", None, "skipped: time budget"))
            continue
        r = bench_decode(params, cfg, B, P, C, mesh)
        roof = decode_roofline(cfg, B, P, C, bw, flops)
        rows.append((f"decode B={B}", r, f"roofline {roof:,.0f} tok/s, {r['tokens_per_s'] / roof:.1%} of it"))
        print(f"  decode B={B}: {r['tokens_per_s']:,.1f} tok/s (compile {r['compile_s']:.1f} s)", flush=True)
    train_rows = 16
    if time.perf_counter() - start > BUDGET_S:
        rows.append((f"train {train_rows}x{P + C}", None, "skipped: time budget"))
    else:
        train_cfg = cfg if tiny else cfg.replace(remat_policy="full")
        r = bench_train(params, train_cfg, train_rows, P, C, mesh, flops)
        rows.append((f"GRPO train step {train_rows}x{P + C}", r, f"MFU {r['mfu']:.1%}"))

    print()
    print(f"{'measurement':<28}{'compile s':>10}{'run s':>10}{'tokens/s':>14}  vs peak")
    for name, r, note in rows:
        if r is None:
            print(f"{name:<28}{'-':>10}{'-':>10}{'-':>14}  {note}")
        else:
            print(f"{name:<28}{r['compile_s']:>10.1f}{r['run_s']:>10.3f}{r['tokens_per_s']:>14,.1f}  {note}")
    if tiny:
        print(
            "(tiny model: its weights fit in cache, so the HBM roofline does not bound it; a smoke test only)"
        )
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
