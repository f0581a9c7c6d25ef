"""A decode step's matmuls on CPU: the grpax matmul kernel vs XLA's dot, torch (oneDNN) and numpy (BLAS).

Each decode step multiplies the batch's B rows by every weight matrix of the model, so for a small model
at B = 64 these products are most of a step (SmolLM2-135M: 2 * 64 * 134.5M = 17.2 GFLOP). This times that
chain, per layer the fused q/k/v projection, the output projection, gate and up with SwiGLU, the down
projection, then the LM head, with the residual adds between, in each library on the same machine:

- grpax: ``grpax.backends.cpu.ops.matmul`` on packed panels (the CPU backend's decode step);
- XLA: the same chain as ``jnp`` dots under ``jax.jit`` (the XLA backend's decode step);
- torch: ``x @ W`` (oneDNN / MKL; for bfloat16 oneDNN uses AMX where the CPU has it);
- numpy: ``x @ W`` (its BLAS, OpenBLAS in the PyPI wheels; float32 only).

The libraries run in turn in each of ``--rounds`` rounds and the best time of each is kept, so a shared
machine's drift hits them alike. Prints GFLOP/s, each peer's time over grpax's (above 1: grpax is faster),
and the fraction
of the roofline: time >= max(weight bytes / memory bandwidth, FLOPs / matmul peak), with the peak the
fastest large ([2048, 2048]^2) matmul any of the libraries reaches in that dtype.

Usage: python benchmarks/matmul_bench.py [--batch_sizes 16,64] [--dtypes float32,bfloat16] [--rounds 10]
       [--model_name smollm2-135m]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
from rollout_bench import _timed, measure_bandwidth, measure_matmul

from grpax.backends.cpu import build, ops
from grpax.models.registry import get_model_config


def chain_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the decode step's products, float32 numpy (cast per library): qkv [L, D, (N+2K)H],
    o [L, NH, D], gate / up [L, D, F], down [L, F, D], embed [V, D] (the head multiplies by its transpose).

    Scaled to 0.1 / sqrt(fan-in), so that the 3 L residual adds of the chain (which has no norms) grow the
    activations by ~(1 + 0.01)^(3L) (~2.5x for 30 layers) and every product runs on finite, normal values.
    """
    rng = np.random.default_rng(seed)
    D, H, F, L = cfg.hidden_dim, cfg.head_dim, cfg.mlp_dim, cfg.num_layers

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * (0.1 / np.sqrt(shape[-2]))).astype(np.float32)

    return {
        "qkv": w(L, D, (cfg.num_heads + 2 * cfg.num_kv_heads) * H),
        "o": w(L, cfg.num_heads * H, D),
        "gate": w(L, D, F),
        "up": w(L, D, F),
        "down": w(L, F, D),
        "embed": w(cfg.vocab_size, D),
    }


def chain_flops(cfg, batch: int) -> float:
    """FLOPs of one decode step's products: 2 * B * (matrix parameters of the layers + the head)."""
    D, H, F = cfg.hidden_dim, cfg.head_dim, cfg.mlp_dim
    per_layer = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * H + cfg.num_heads * H * D + 3 * D * F
    return 2.0 * batch * (cfg.num_layers * per_layer + cfg.vocab_size * D)


def make_runs(cfg, weights: dict[str, np.ndarray], batch: int, dtype: str) -> dict[str, callable]:
    """name -> a call that runs the whole chain once and waits for it."""
    D, F, L = cfg.hidden_dim, cfg.mlp_dim, cfg.num_layers
    x0 = np.random.default_rng(1).standard_normal((batch, D), np.float32)
    runs = {}

    if build.available():
        j = {k: jnp.asarray(v, dtype) for k, v in weights.items()}
        packed = {
            "qkv": ops.pack([j["qkv"]]),
            "o": ops.pack([j["o"]]),
            "gate_up": ops.pack([j["gate"], j["up"]], swiglu=True),
            "down": ops.pack([j["down"]]),
            "head": ops.pack([j["embed"][None]], transposed=True)[0],
        }
        del j
        n_qkv = weights["qkv"].shape[-1]

        @jax.jit
        def kernel_chain(x, p):
            mm = ops.matmul
            for layer in range(L):
                x = x + mm(x, p["qkv"][layer], n_qkv, out_dtype=x.dtype)[:, :D]
                x = x + mm(x, p["o"][layer], D, out_dtype=x.dtype)
                h = mm(x, p["gate_up"][layer], F, swiglu=True, transpose_out=True, out_dtype=x.dtype)
                x = x + mm(h, p["down"][layer], D, x_transposed=True, out_dtype=x.dtype)
            return mm(x, p["head"], cfg.vocab_size)

        xk = jnp.asarray(x0, dtype)
        runs["grpax kernel"] = lambda: kernel_chain(xk, packed).block_until_ready()

    jw = {k: jnp.asarray(v, dtype) for k, v in weights.items()}

    @jax.jit
    def xla_chain(x, w):
        for layer in range(L):
            x = x + (x @ w["qkv"][layer])[:, :D]
            x = x + x @ w["o"][layer]
            x = x + (jax.nn.silu(x @ w["gate"][layer]) * (x @ w["up"][layer])) @ w["down"][layer]
        return (x @ w["embed"].T).astype(jnp.float32)

    xj = jnp.asarray(x0, dtype)
    runs["XLA dot"] = lambda: xla_chain(xj, jw).block_until_ready()

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tw = {k: torch.from_numpy(v).to(tdtype) for k, v in weights.items()}
    xt = torch.from_numpy(x0).to(tdtype)

    def torch_chain():
        with torch.inference_mode():
            x = xt
            for layer in range(L):
                x = x + (x @ tw["qkv"][layer])[:, :D]
                x = x + x @ tw["o"][layer]
                x = (
                    x
                    + (torch.nn.functional.silu(x @ tw["gate"][layer]) * (x @ tw["up"][layer]))
                    @ tw["down"][layer]
                )
            return (x @ tw["embed"].T).float()

    runs["torch"] = torch_chain

    if dtype == "float32":

        def numpy_chain():
            x = x0
            for layer in range(L):
                x = x + (x @ weights["qkv"][layer])[:, :D]
                x = x + x @ weights["o"][layer]
                g = x @ weights["gate"][layer]
                x = (
                    x
                    + (g / (1.0 + np.exp(-np.maximum(g, -80.0))) * (x @ weights["up"][layer]))
                    @ weights["down"][layer]
                )
            return x @ weights["embed"].T

        runs["numpy"] = numpy_chain
    return runs


def _to_numpy(value) -> np.ndarray:
    """A run's logits (a jax array, torch tensor or numpy array) as float32 numpy."""
    if isinstance(value, torch.Tensor):
        return value.float().numpy()
    return np.asarray(value).astype(np.float32)


def measure_torch_matmul(n: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    """Matmul throughput in FLOP/s of torch's [n, n] x [n, n] in ``dtype`` (best of ``repeats``)."""
    a = torch.ones(n, n, dtype=dtype)
    a @ a
    return 2 * n**3 / min(_timed(lambda: a @ a) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch_sizes", default="16,64", help="rows per decode step, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16, comma-separated")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of every library in turn (best time kept)")
    ap.add_argument("--model_name", default="smollm2-135m", help="shapes from this registry model")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in ("float32", "bfloat16")]:
        ap.error(f"--dtypes {','.join(unknown)}: each must be float32 or bfloat16")
    cfg = get_model_config(args.model_name)
    torch.set_num_threads(os.cpu_count() or 1)
    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} cpus, jax {jax.__version__}, torch {torch.__version__}"
        f" ({torch.get_num_threads()} threads), grpax kernels {'on' if build.available() else 'UNAVAILABLE'}"
    )
    bw = measure_bandwidth()
    peak = {
        "float32": max(measure_matmul(2048, 5), measure_torch_matmul()),
        "bfloat16": max(
            measure_matmul(2048, 5, "bfloat16"),
            measure_torch_matmul(dtype=torch.bfloat16),
        ),
    }
    print(
        f"memory bandwidth {bw / 1e9:.1f} GB/s; matmul peak (fastest [2048, 2048]^2): float32 "
        f"{peak['float32'] / 1e9:.0f} GFLOP/s, bfloat16 {peak['bfloat16'] / 1e9:.0f} GFLOP/s"
    )
    weights = chain_weights(cfg)
    rows = []
    for dtype in dtypes:
        weight_bytes = sum(v.size for v in weights.values()) * jnp.dtype(dtype).itemsize
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            runs = make_runs(cfg, weights, batch, dtype)
            # Compile and first touch; the logits must be finite and agree across libraries.
            logits = {name: _to_numpy(run()) for name, run in runs.items()}
            ref = logits["torch"]
            for name, value in logits.items():
                if not np.isfinite(value).all():
                    raise SystemExit(f"{name}: non-finite logits at B={batch} {dtype}")
            spread = max(float(np.abs(v - ref).max()) for v in logits.values()) / float(np.abs(ref).max())
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.rounds):
                for name, run in runs.items():
                    best[name] = min(best[name], _timed(run))
            flops = chain_flops(cfg, batch)
            roof = max(weight_bytes / bw, flops / peak[dtype])
            ours = best.get("grpax kernel")
            for name, seconds in best.items():
                rows.append(
                    (
                        batch,
                        dtype,
                        name,
                        seconds,
                        flops / seconds,
                        seconds / ours if ours else None,
                        roof / seconds,
                    )
                )
            print(
                f"B={batch} {dtype}: "
                + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in best.items())
                + f"; logits agree to {spread:.1e} of their largest",
                flush=True,
            )

    print(
        f"\n{args.model_name}: {cfg.num_layers} layers + head, one decode step's products, best of {args.rounds} rounds"
    )
    print(
        f"{'batch':>5} {'dtype':>9} {'library':>13} {'ms':>8} {'GFLOP/s':>8} {'grpax/it':>9} {'of roof':>8}"
    )
    for batch, dtype, name, seconds, rate, ratio, of_roof in rows:
        r = f"{ratio:.2f}x" if ratio else "-"
        print(
            f"{batch:>5} {dtype:>9} {name:>13} {seconds * 1e3:>8.1f} {rate / 1e9:>8.1f} {r:>9} {of_roof:>8.1%}"
        )
    print("grpax/it: the peer's time over grpax's (above 1: grpax is faster)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
