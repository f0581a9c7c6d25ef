"""grpax serve under load against transformers' ``generate`` one prompt at a time and the engine in batches.

SmolLM2-135M-Instruct (the embedded GGUF, float32) answers the first ``--num_prompts`` GSM8K test questions, each
a bare user turn in the model's chat template, greedy, at most ``--max_tokens`` new tokens, stopping at the
model's stop tokens: the same prompt ids and settings in every arm. Arms:

- ``transformers``: ``LlamaForCausalLM.generate`` (torch, float32), one prompt after the other;
- ``engine bN``: ``grpax.sampler.engine.generate`` on batches of N prompts, one after the other (a request's
  latency is its batch's time);
- ``serve cN``: ``grpax serve`` (this tree, uvicorn on a local port, ``--max_num_seqs`` slots) with N client
  threads of the official ``openai`` client in a closed loop (each sends its next chat request when its last one
  returned), so N requests are in flight.

Every engine arm first runs the same pass untimed (its compiles); the server instead runs its own warm-up at
start (``EngineWorker.warmup``, the whole program set that ``grpax serve warmup=true`` compiles: a one-prompt prefill
per prompt bucket, a decode per slot count; its seconds are reported as ``warmup_s``, the process's memory mappings
after it as ``mappings``, and after each serve arm in its row), or with ``--serve_warm_pass``
the untimed pass as well. JAX's compile seconds left in the timed pass are reported (``compile_s``). Reported per arm: requests/s, completion tokens/s, p50 and p99 request latency (seconds), and
whether its completions equal the engine's. Results go to ``--json_out`` and a markdown table is printed.

Usage: python benchmarks/serve_bench.py [--num_prompts 64] [--max_tokens 64] [--clients 1 8 32]
       [--batches 8 32] [--max_num_seqs 32] [--json_out FILE] [--gsm8k_dir DIR] [--skip_transformers]
       [--serve_warm_pass]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from rollout_bench import add_gsm8k_dir_option, gsm8k_file  # noqa: E402

from grpax.checkpoint.gguf import default_gguf_path, read_gguf  # noqa: E402
from grpax.checkpoint.hf import load_params_from_tensors  # noqa: E402
from grpax.data.tokenizer import stop_token_ids  # noqa: E402
from grpax.host_memory import memory_mappings  # noqa: E402
from grpax.models.registry import from_hf_config  # noqa: E402
from grpax.sampler.engine import generate  # noqa: E402
from grpax.sampler.keys import sampler_config  # noqa: E402

COMPILE_S = [0.0]
MAX_PROMPT_LENGTH = 256


def _count_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILE_S[0] += duration


def summary(name: str, wall: float, latencies: list[float], outputs: list[list[int]], reference) -> dict:
    lat = np.asarray(latencies)
    tokens = sum(map(len, outputs))
    return {
        "arm": name,
        "requests": len(outputs),
        "wall_s": wall,
        "requests_per_s": len(outputs) / wall,
        "tokens_per_s": tokens / wall,
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "completion_tokens": tokens,
        "same_as_engine": None if reference is None else outputs == reference,
    }


def run_transformers(path, prompts, stops, max_tokens, threads):
    import torch

    torch.set_num_threads(threads)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM(LlamaConfig(**load_gguf_checkpoint(path, return_tensors=False)["config"]))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    model = model.float().eval()
    outputs, latencies = [], []
    start = time.perf_counter()
    for prompt in prompts:
        t = time.perf_counter()
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=list(stops),
                pad_token_id=stops[0],
            )
        latencies.append(time.perf_counter() - t)
        outputs.append(ids[0, len(prompt) :].tolist())
    return time.perf_counter() - start, latencies, outputs


def run_engine(params, cfg, sc, prompts, batch):
    outputs, latencies = [], []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        out = generate(params, prompts[i : i + batch], cfg, sc, jax.random.key(0))
        dt = time.perf_counter() - t
        for r in range(len(out.lengths)):
            outputs.append(out.completion_ids[r, : out.lengths[r]].tolist())
            latencies.append(dt)
    return time.perf_counter() - start, latencies, outputs


def run_clients(url, messages, clients, max_tokens):
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    outputs, latencies = [None] * len(messages), [0.0] * len(messages)
    next_index, lock = [0], threading.Lock()

    def loop():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(messages):
                return
            t = time.perf_counter()
            r = client.chat.completions.create(
                model="smollm2",
                messages=messages[i],
                temperature=0,
                max_tokens=max_tokens,
                extra_body={"return_token_ids": True},
            )
            latencies[i] = time.perf_counter() - t
            outputs[i] = r.choices[0].token_ids

    start = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_prompts", type=int, default=64)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--max_num_seqs", type=int, default=32)
    ap.add_argument("--skip_transformers", action="store_true")
    ap.add_argument("--serve_warm_pass", action="store_true", help="an untimed pass per client count too")
    ap.add_argument(
        "--torch_threads", type=int, default=1, help="torch threads (1 is the faster on 2 shared cores)"
    )
    ap.add_argument("--json_out", default="")
    add_gsm8k_dir_option(ap)
    args = ap.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_count_compile)

    from grpax import serve
    from grpax.serve.app import Server
    from grpax.serve.worker import EngineWorker

    path = default_gguf_path()
    source = read_gguf(path)
    cfg = from_hf_config(source.hf_config)
    params = jax.device_put(load_params_from_tensors(source.get_tensor, source.has_tensor, cfg))
    tokenizer = source.tokenizer()
    with open(gsm8k_file(args.gsm8k_dir, "test")) as f:
        questions = [
            json.loads(line)["question"] for line, _ in zip(f, range(args.num_prompts), strict=False)
        ]
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for m in messages
    ]
    stops = stop_token_ids(tokenizer, cfg)
    C = args.max_tokens
    results, reference = [], None
    load = [os.getloadavg()]

    def record(name, run, warm=None):
        nonlocal reference
        if warm is not None:
            warm()
        before = COMPILE_S[0]
        wall, latencies, outputs = run()
        result = summary(name, wall, latencies, outputs, reference)
        result["compile_s"] = COMPILE_S[0] - before
        result["mappings"] = (memory_mappings() or (None,))[0]
        if reference is None:
            reference = outputs
        results.append(result)
        print(json.dumps(result), flush=True)

    for batch in args.batches:
        sc = sampler_config(MAX_PROMPT_LENGTH, C, stops, stops[0], greedy=True)
        record(
            f"engine b{batch}",
            lambda b=batch, sc=sc: run_engine(params, cfg, sc, prompts, b),
            warm=lambda b=batch, sc=sc: run_engine(params, cfg, sc, prompts, b),
        )

    sc = sampler_config(MAX_PROMPT_LENGTH, C, stops, stops[0], max_num_seqs=args.max_num_seqs)
    worker = EngineWorker(params, cfg, sc)
    before, t = COMPILE_S[0], time.perf_counter()
    prefills = worker.warmup()
    warmup = {
        "warmup_s": time.perf_counter() - t,
        "warmup_compile_s": COMPILE_S[0] - before,
        "programs": prefills,
        "mappings": (memory_mappings() or (None,))[0],
    }
    print(json.dumps(warmup), flush=True)
    running = serve.start(Server(worker, tokenizer, "smollm2"))
    try:
        for clients in args.clients:
            record(
                f"serve c{clients}",
                lambda c=clients: run_clients(running.url, messages, c, C),
                warm=(lambda c=clients: run_clients(running.url, messages, c, C))
                if args.serve_warm_pass
                else None,
            )
    finally:
        running.stop()
    if not args.skip_transformers:
        threads = args.torch_threads
        record("transformers (one at a time)", lambda: run_transformers(path, prompts, stops, C, threads))
    load.append(os.getloadavg())

    print("\n| arm | requests/s | tokens/s | p50 s | p99 s | same tokens as engine b8 |")
    print("|---|---|---|---|---|---|")
    for r in results:
        same = "-" if r["same_as_engine"] is None else ("yes" if r["same_as_engine"] else "no")
        print(
            f"| {r['arm']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['p50_s']:.2f} | "
            f"{r['p99_s']:.2f} | {same} |"
        )
    if args.json_out:
        meta = {"num_prompts": len(prompts), "max_tokens": C, "max_num_seqs": args.max_num_seqs, "load": load}
        meta["serve_warmup"] = warmup
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
