"""Rollout throughput of the grpax sampler vs transformers ``generate`` and this machine's roofline.

SmolLM2-135M-Instruct (the embedded GGUF, dequantised) on real GSM8K test prompts with the chat template,
``new_tokens`` sampled tokens per row (stop ids ignored, so every row decodes the full length), for each batch
size and dtype. Prints compile time apart from steady-state time, new tokens/s, the ratio to transformers
(torch CPU, float32, same prompts and batch) and the fraction of the roofline:

    step time >= max(bytes read per decode step / memory bandwidth, FLOPs per step / matmul throughput)

with bytes = all weights + the filled part of the KV cache (average over the rollout), bandwidth measured with
a numpy copy and matmul throughput with a jnp matmul in the run's dtype. ``--backend`` picks the sampler's
backend (``SamplerConfig.backend``: auto, xla or cpu).

Usage: python benchmarks/rollout_bench.py [--batch_sizes 16,64] [--dtypes float32,bfloat16]
       [--new_tokens 256] [--hf_new_tokens 256] [--skip_transformers] [--backend auto] [--gsm8k_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from grpax.checkpoint.gguf import default_gguf_path, read_gguf
from grpax.checkpoint.hf import load_params_from_tensors
from grpax.models.params import cast_params
from grpax.models.registry import from_hf_config
from grpax.sampler.engine import generate
from grpax.sampler.keys import SamplerConfig

GSM8K_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


def add_gsm8k_dir_option(ap: argparse.ArgumentParser) -> None:
    """Adds ``--gsm8k_dir``, the one setting of the benchmarks for their GSM8K copy."""
    ap.add_argument(
        "--gsm8k_dir",
        type=Path,
        default=GSM8K_DIR,
        help="folder with GSM8K's train.jsonl and test.jsonl (default: <repo>/../shared/data/gsm8k)",
    )


def gsm8k_file(gsm8k_dir: Path, split: str) -> Path:
    """``<gsm8k_dir>/<split>.jsonl``; exits with a one-line message naming the file and the option if absent."""
    path = Path(gsm8k_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass --gsm8k_dir=<folder with train.jsonl and test.jsonl>")
    return path


def measure_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: a numpy copy reads and writes ``num_bytes`` each (best of ``repeats``)."""
    a = np.ones(num_bytes // 8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(repeats))
    return 2 * a.nbytes / best


def measure_matmul(n: int = 1024, repeats: int = 10, dtype: str = "float32") -> float:
    """Matmul throughput in FLOP/s of a jitted [n, n] x [n, n] in ``dtype`` (best of ``repeats``)."""
    x = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def roofline_tokens_per_s(
    cfg, batch: int, prompt_len: float, new_tokens: int, bw: float, flops: float
) -> float:
    """Upper bound on decode tokens/s: weights + average filled KV cache read per step, or matmul FLOPs."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    num_params = cfg.num_params()
    avg_len = prompt_len + new_tokens / 2
    cache_bytes = 2 * cfg.num_layers * batch * avg_len * cfg.num_kv_heads * cfg.head_dim * itemsize
    step_bytes = num_params * itemsize + cache_bytes
    matmul_params = num_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_dim)
    step_flops = (
        2 * batch * matmul_params + 4 * batch * cfg.num_layers * cfg.num_heads * cfg.head_dim * avg_len
    )
    return batch / max(step_bytes / bw, step_flops / flops)


def load_prompts(tokenizer, count: int, path: Path) -> list[list[int]]:
    """The first ``count`` questions of the GSM8K file ``path`` as chat-template prompt ids."""
    with open(path) as f:
        questions = [json.loads(line)["question"] for line, _ in zip(f, range(count), strict=False)]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]


def bench_grpax(params, cfg, prompts, new_tokens: int, backend: str = "auto") -> tuple[float, float]:
    """(compile seconds, steady-state tokens/s) of one ``generate`` over ``prompts`` (no early stop)."""
    sc = SamplerConfig(
        max_prompt_length=256,
        max_completion_length=new_tokens,
        temperature=1.0,
        pad_token_id=2,
        backend=backend,
    )
    first = _timed(lambda: generate(params, prompts, cfg, sc, jax.random.key(0)))
    steady = _timed(lambda: generate(params, prompts, cfg, sc, jax.random.key(1)))
    return max(first - steady, 0.0), len(prompts) * new_tokens / steady


def bench_transformers(path: str, prompts, new_tokens: int) -> float:
    """transformers ``generate`` tokens/s (torch CPU float32, left-padded batch, sampling, no early stop)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM(LlamaConfig(**load_gguf_checkpoint(path, return_tensors=False)["config"]))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    model = model.float().eval()
    P = max(map(len, prompts))
    ids = torch.tensor([[2] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=2,
    )
    with torch.no_grad():
        model.generate(ids[:1, -8:], max_new_tokens=2, pad_token_id=2)  # warm-up
        seconds = _timed(lambda: model.generate(ids, **kwargs))
    return len(prompts) * new_tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch_sizes", default="16,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--hf_new_tokens", type=int, default=0, help="transformers run length (0: new_tokens)")
    ap.add_argument("--skip_transformers", action="store_true")
    ap.add_argument("--backend", default="auto", choices=("auto", "xla", "cpu"), help="the sampler's backend")
    add_gsm8k_dir_option(ap)
    args = ap.parse_args()
    test_file = gsm8k_file(args.gsm8k_dir, "test")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = args.dtypes.split(",")

    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}"
    )
    bw, flops = measure_bandwidth(), {"float32": measure_matmul()}
    flops["bfloat16"] = measure_matmul(dtype="bfloat16")
    print(
        f"measured: memory bandwidth {bw / 1e9:.1f} GB/s (numpy copy), matmul {flops['float32'] / 1e9:.0f} "
        f"GFLOP/s (jnp float32), bfloat16 {flops['bfloat16'] / 1e9:.0f} (jnp)"
    )

    path = default_gguf_path()
    source = read_gguf(path)
    base_cfg = from_hf_config(source.hf_config)
    params32 = jax.device_put(load_params_from_tensors(source.get_tensor, source.has_tensor, base_cfg))
    tokenizer = source.tokenizer()
    all_prompts = load_prompts(tokenizer, max(batch_sizes), test_file)
    hf_tokens = args.hf_new_tokens or args.new_tokens

    rows = []
    for batch in batch_sizes:
        prompts = all_prompts[:batch]
        mean_len = float(np.mean([len(p) for p in prompts]))
        hf = None
        if not args.skip_transformers:
            hf = bench_transformers(path, prompts, hf_tokens)
            print(f"transformers B={batch}: {hf:.1f} tok/s ({hf_tokens} new tokens)")
        for dtype in dtypes:
            cfg = base_cfg.replace(dtype=dtype, weight_dtype=dtype)
            params = params32 if dtype == "float32" else cast_params(params32, dtype)
            compile_s, tok_s = bench_grpax(params, cfg, prompts, args.new_tokens, args.backend)
            roof = roofline_tokens_per_s(
                cfg, batch, mean_len, args.new_tokens, bw, flops.get(dtype, flops["float32"])
            )
            rows.append((batch, dtype, compile_s, tok_s, hf, roof))
            print(
                f"grpax B={batch} {dtype}: {tok_s:.1f} tok/s, compile {compile_s:.1f} s, roofline {roof:.0f}"
            )

    print(
        f"\nSmolLM2-135M-Instruct, GSM8K test prompts (chat template), {args.new_tokens} new tokens, no early stop"
    )
    print(
        f"{'batch':>5} {'dtype':>9} {'compile s':>9} {'tok/s':>8} {'vs HF':>7} {'roofline':>9} {'of roof':>8}"
    )
    for batch, dtype, compile_s, tok_s, hf, roof in rows:
        ratio = f"{tok_s / hf:.2f}x" if hf else "-"
        print(
            f"{batch:>5} {dtype:>9} {compile_s:>9.1f} {tok_s:>8.1f} {ratio:>7} {roof:>9.0f} {tok_s / roof:>8.1%}"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
