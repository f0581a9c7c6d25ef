"""Seconds per GRPO step: grpax's step (``Rollout`` + ``make_update``) vs TRL ``GRPOTrainer`` vs this machine's roofline, in one run.

SmolLM2-135M-Instruct (the embedded GGUF, dequantised to float32) on real GSM8K train prompts rendered with the
model's chat template and the ``smollm2_demo`` prompt preset: P prompts x G completions, exactly ``new_tokens``
new tokens per row (grpax: no stop ids; TRL: ``min_new_tokens`` = ``max_completion_length``), beta 0.08, float32
on CPU, one optimizer update per step (num_iterations 1). Both systems see the same weights (TRL loads a Hugging
Face folder written from grpax's params), the same prompts in the same order, the same sampling settings
(temperature 0.9, top-k 50) and the same reward (``grpax.tasks.gsm8k_rewards.score_completions`` total, preset
``smollm2_demo``, wrapped as a TRL reward function).

Start-up (load + trainer construction; plus, for the first step, compilation or warm-up) is reported apart from
the steady state: the median of ``--steady_steps`` steps after ``--warmup_steps`` warm-up steps. Per step:

* grpax: the step's own ``time/{rollout,rewards,reference,train}_s``;
* TRL: ``_generate`` (rollout), ``_calculate_rewards`` (rewards), the rest of ``_generate_and_score_completions``
  (reference logprobs + bookkeeping), and the rest of the step (forward/backward + AdamW: "update").

The roofline is the sum over phases of max(FLOPs / matmul throughput, bytes / memory bandwidth): prefill and
the reference pass are forward passes over the real prompt + completion tokens, each decode step reads all the
weights and the filled KV cache and does 2 FLOPs per matmul weight per row, and the update is 3 forward passes
(forward + backward). Matmul throughput is a jitted float32 1024^3 matmul, bandwidth a numpy copy.

With ``--stop_tokens`` grpax stops each row at the model's real stop tokens (GRPO as train_rl runs it; up to
``new_tokens``) and each step also reports the useful tokens (the completions' lengths), the rollout's seconds
per useful token and the fraction of the decode's row-steps spent on rows already finished (``past_eos``:
1 - sum(length - 1) / rows x decode steps run; ``GenerateOutput.decode_row_steps``, or every row for every
step where the sampler does not count them, as before finished rows were retired).
Each step also reports ``completions_sha256``, a hash of the sampled tokens (equal in two runs = the same
completions). The bench also runs an older grpax put first on ``PYTHONPATH`` (``retire_ab.py``): one whose
sampler does not count decode row-steps (see above) or that has no ``grpax.rl.ahead`` (``--max_staleness`` 0 only).

Usage: python benchmarks/grpo_step_bench.py [--num_prompts 4] [--num_generations 4] [--new_tokens 128]
       [--warmup_steps 1] [--steady_steps 3] [--skip_trl] [--skip_grpax] [--stop_tokens] [--rollout_only]
       [--json_out FILE]
       [--gsm8k_dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from grpax.checkpoint.convert import generation_config
from grpax.checkpoint.gguf import default_gguf_path, read_gguf
from grpax.checkpoint.hf import iter_hf_tensors, load_params_from_tensors
from grpax.data.iterator import PromptIterator
from grpax.data.prompts import filter_by_length, render_prompt, tokenize_prompts
from grpax.data.tokenizer import stop_token_ids
from grpax.eval.evaluate import decode_completions
from grpax.models.registry import from_hf_config, to_hf_config
from grpax.rl import rollout as rollout_module
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_step import TrainState, make_train_step, make_update, token_logprobs
from grpax.rl.trainer import step_metrics
from grpax.sampler.keys import SamplerConfig
from grpax.tasks.gsm8k import load_dataset_rows
from grpax.tasks.gsm8k_rewards import get_reward_config, score_completions
from grpax.tasks.prompts import get_prompt_preset

try:  # an older grpax (a parent commit run through PYTHONPATH) has no rollouts ahead
    from grpax.rl.ahead import AheadRollouts
except ImportError:
    AheadRollouts = None

sys.path.insert(0, str(Path(__file__).parent))
from rollout_bench import add_gsm8k_dir_option, gsm8k_file, measure_bandwidth, measure_matmul  # noqa: E402

PRESET = "smollm2_demo"
MAX_PROMPT_LENGTH = 256
TEMPERATURE, TOP_K, BETA, SEED = 0.9, 50, 0.08, 42


def load_batches(tokenizer, num_prompts: int, num_steps: int, path: Path) -> list[list[dict]]:
    """``num_steps`` batches of ``num_prompts`` shuffled rows of the GSM8K train file ``path``, each with ``text``
    and ``prompt_ids``."""
    preset = get_prompt_preset(PRESET)
    rows = load_dataset_rows(str(path), "train")
    rows = [
        rows[i] for i in np.random.default_rng(SEED).permutation(len(rows))[: 4 * num_prompts * num_steps]
    ]
    for row in rows:
        row["text"] = render_prompt(tokenizer, row["question"], preset)
    ids = tokenize_prompts(tokenizer, [row["text"] for row in rows])
    rows, ids, _ = filter_by_length(rows, ids, MAX_PROMPT_LENGTH)
    for row, row_ids in zip(rows, ids, strict=True):
        row["prompt_ids"] = row_ids
    iterator = PromptIterator(rows, num_prompts, seed=SEED)
    return [next(iterator) for _ in range(num_steps)]


def reward_total(questions, completions, golds) -> list[float]:
    """The grpax GSM8K reward (``smollm2_demo`` preset) that both systems optimise, in points."""
    return score_completions(
        questions,
        completions,
        golds,
        get_reward_config(PRESET),
        response_prefix=get_prompt_preset(PRESET).response_prefix,
    )["total"]


def _cache_size(fn) -> int:
    return fn._cache_size() if hasattr(fn, "_cache_size") else -1


# XLA programs compiled in this process and their compile seconds (JAX's backend-compile event: every jit,
# whichever tree's grpax runs, e.g. the retiring decode's phase programs).
COMPILES = {"programs": 0, "seconds": 0.0}


def _count_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES["programs"] += 1
        COMPILES["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class _Batches:
    """The bench's prompt batches as the trainer's iterator (``next``, ``state_dict``)."""

    def __init__(self, batches):
        self.batches, self.index = batches, 0

    def __next__(self):
        self.index += 1
        return self.batches[self.index - 1]

    def state_dict(self):
        return {"index": self.index}


def bench_grpax(params, cfg, tokenizer, batches, args, max_staleness: int = 0) -> dict:
    """Runs the trainer's step (``Rollout`` then ``make_update``; with ``max_staleness`` >= 1 the rollouts
    ahead in ``grpax.rl.ahead.AheadRollouts``'s thread, as train_rl) on each batch; returns per-step phase
    times and compile-cache sizes."""
    G = args.num_generations
    if max_staleness > 0 and AheadRollouts is None:
        raise SystemExit(f"--max_staleness {max_staleness}: this grpax has no grpax.rl.ahead; use 0")
    # max_staleness only when set: an older GRPOConfig has no such field
    ahead_cfg = {"max_staleness": max_staleness} if max_staleness else {}
    grpo = GRPOConfig(
        num_generations=G,
        beta=BETA,
        temperature=TEMPERATURE,
        lr_schedule="constant",
        warmup_ratio=0.0,
        **ahead_cfg,
    )
    t0 = time.perf_counter()
    params = jax.device_put(params)
    ref_params = jax.tree.map(jnp.copy, params)
    optimizer, schedule = optimizer_from_config(grpo, len(batches))
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    train_step = make_train_step(cfg, grpo, optimizer, args.num_micro_batches, schedule)
    update = make_update(train_step, grpo.num_iterations)
    sampler_cfg = SamplerConfig(
        max_prompt_length=MAX_PROMPT_LENGTH,
        max_completion_length=args.new_tokens,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        # no stop ids: every row decodes exactly new_tokens tokens, as TRL with min_new_tokens
        stop_token_ids=stop_token_ids(tokenizer, cfg) if args.stop_tokens else (),
        pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else 2,
    )
    jax.block_until_ready(state)

    def score(rows, out):
        completions = decode_completions(tokenizer, out.completion_ids, out.completion_mask)
        total = reward_total([row["question"] for row in rows], completions, [row["gold"] for row in rows])
        return {"total": total}, np.zeros(len(rows))

    rollout = Rollout(
        cfg,
        sampler_cfg,
        grpo,
        score,
        reference=None if args.rollout_only else ref_params,
        num_micro_batches=args.num_micro_batches,
    )
    outs = []  # the sampler's outputs of the current step (several with dynamic sampling)

    sampled = rollout_module.generate

    def generate(*a, **k):
        outs.append(sampled(*a, **k))
        return outs[-1]

    rollout_module.generate = generate
    setup_s = time.perf_counter() - t0
    compiled_before = dict(COMPILES)
    steps = []
    ahead = None
    if max_staleness > 0:
        ahead = AheadRollouts(
            rollout,
            _Batches(batches),
            lambda i: jax.random.fold_in(jax.random.key(SEED), i),
            max_staleness,
            0,
            len(batches),
        )
        ahead.publish(state.params, 0)
    for i, rows in enumerate(batches):
        t_start = time.perf_counter()
        outs.clear()
        if ahead is None:
            rollout.update_params(state.params, i)
            batch = rollout(rows, jax.random.fold_in(jax.random.key(SEED), i))
        else:
            batch = ahead.get(i)
        t_update = time.perf_counter()
        if args.rollout_only:  # the same params every step; no update metrics
            update_metrics = {}
        else:
            state, update_metrics = update(state, batch)
            jax.block_until_ready(state)
        if ahead is not None:
            ahead.publish(state.params, i + 1)
        t_end = time.perf_counter()
        m = step_metrics(
            batch, update_metrics, {"time/train_s": t_end - t_update, "time/step_s": t_end - t_start}
        )
        prompt_mask = np.asarray(batch.prompt_mask)
        step = {
            "step_s": m["time/step_s"],
            "rollout_s": m["time/rollout_s"],
            "rewards_s": m["time/rewards_s"],
            "reference_s": m["time/reference_s"],
            "update_s": m["time/train_s"],
            "prompt_bucket": int(prompt_mask.shape[1]),
            "mean_prompt_len": float(prompt_mask.sum(1).mean()),
            "mean_completion_len": float(batch.host.completion_lengths.mean()),
            "reward_mean": m["rewards/total/mean"],
            "compiled": {
                "reference": _cache_size(token_logprobs),
                "train_step": _cache_size(train_step),
                "programs_so_far": COMPILES["programs"],  # every program, the sampler's included
                "compile_s_so_far": round(COMPILES["seconds"], 2),
            },
        }
        step.update(decode_work(outs))
        step["rollout_s_per_useful_token"] = step["rollout_s"] / max(step["useful_tokens"], 1)
        step["staleness"] = i - batch.host.policy_version
        step["rollout_wait_s"] = t_update - t_start
        steps.append(step)
        print(f"grpax step {i}: " + json.dumps(step), flush=True)
    if ahead is not None:
        ahead.close()
    rollout_module.generate = sampled
    return {"setup_s": setup_s, "steps": steps, "compiled_before_steps": compiled_before}


def decode_work(outs) -> dict:
    """Useful tokens, decode row-steps and the fraction of them past EOS of one step's sampler outputs, and a
    hash of the sampled tokens (each row's completion up to its length: equal hashes = the same completions)."""
    useful = sum(int(np.asarray(o.lengths).sum()) for o in outs)
    digest = hashlib.sha256()
    for o in outs:
        ids = np.asarray(o.completion_ids)
        for row, length in zip(ids, np.asarray(o.lengths), strict=True):
            digest.update(np.asarray(row[:length], np.int64).tobytes() + b"|")
    row_steps = 0
    for o in outs:
        lengths = np.asarray(o.lengths)
        # counted by the sampler; else every row ran every step (the loop ends when the longest row does)
        row_steps += getattr(o, "decode_row_steps", 0) or len(lengths) * (int(lengths.max()) - 1)
    after_first = useful - sum(len(o.lengths) for o in outs)  # the first token comes from the prefill
    # every row to the end, on the same rollout (retirement changes no token): the parent's decode work
    full = sum(len(o.lengths) * (int(np.asarray(o.lengths).max()) - 1) for o in outs)
    return {
        "useful_tokens": useful,
        "decode_row_steps": row_steps,
        "past_eos": 1 - after_first / max(row_steps, 1),
        "past_eos_without_retirement": 1 - after_first / max(full, 1),
        "completions_sha256": digest.hexdigest()[:16],
    }


def write_hf_folder(params, cfg, tokenizer, folder: Path) -> None:
    """The same float32 weights as a Hugging Face ``LlamaForCausalLM`` folder (what TRL loads by path)."""
    from safetensors.numpy import save_file

    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32"), indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(cfg, tokenizer), indent=2))
    tensors = {name: np.ascontiguousarray(w, np.float32) for name, w in iter_hf_tensors(params, cfg)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(folder))


def bench_trl(folder: Path, batches, args) -> dict:
    """TRL ``GRPOTrainer`` on the same prompts; returns per-step phase times."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    for rows in batches:  # TRL tokenizes the rendered text itself: check it gets grpax's prompt ids
        for row in rows:
            assert tokenizer(text=row["text"])["input_ids"] == row["prompt_ids"], "prompt ids differ"
    dataset = Dataset.from_list(
        [
            {"prompt": r["text"], "question": r["question"], "gold": r["gold"]}
            for rows in batches
            for r in rows
        ]
    )

    def gsm8k_total(prompts, completions, question, gold, **kwargs):
        return reward_total(question, completions, gold)

    timers: dict[str, float] = {}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate(*a, **k)
            finally:
                timers["rollout_s"] = timers.get("rollout_s", 0.0) + time.perf_counter() - t

        def _calculate_rewards(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._calculate_rewards(*a, **k)
            finally:
                timers["rewards_s"] = timers.get("rewards_s", 0.0) + time.perf_counter() - t

        def _generate_and_score_completions(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                timers["prepare_s"] = timers.get("prepare_s", 0.0) + time.perf_counter() - t

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timers.clear()
            timers["begin"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_s = time.perf_counter() - timers["begin"]
            step = {
                "step_s": step_s,
                "rollout_s": timers["rollout_s"],
                "rewards_s": timers["rewards_s"],
                "reference_s": timers["prepare_s"] - timers["rollout_s"] - timers["rewards_s"],
                "update_s": step_s - timers["prepare_s"],
            }
            steps.append(step)
            print(f"TRL step {len(steps) - 1}: " + json.dumps(step), flush=True)

    num_rows = args.num_prompts * args.num_generations
    config = TRLConfig(
        output_dir=str(folder / "trl_out"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
        per_device_train_batch_size=num_rows,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        beta=BETA,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",  # token-mean over the batch, grpax's default loss_agg_mode
        scale_rewards="group",
        learning_rate=3e-6,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.99,
        max_grad_norm=0.1,
        lr_scheduler_type="constant",
        max_steps=len(batches),
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=SEED,
        disable_tqdm=True,
    )
    trainer = TimedGRPOTrainer(
        model=str(folder),
        reward_funcs=gsm8k_total,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    setup_s = time.perf_counter() - t0
    t = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t
    return {"setup_s": setup_s, "steps": steps, "train_s": train_s}


def roofline(cfg, num_rows: int, prompt_len: float, new_tokens: int, bw: float, flops: float) -> dict:
    """Lower bounds in seconds per phase of one GRPO step (module docstring), float32."""
    itemsize = 4
    D, L, N, K, H, V = (
        cfg.hidden_dim,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    )
    body = cfg.num_params() - V * D * (1 if cfg.tie_word_embeddings else 2)  # layer matmuls (+ norms)
    head = V * D  # vocab projection

    def attn_flops(q_tokens: float, kv_len: float) -> float:
        return 4 * L * N * H * q_tokens * kv_len  # QK^T and PV

    total_len = prompt_len + new_tokens
    prefill = 2 * num_rows * prompt_len * body + attn_flops(num_rows * prompt_len, prompt_len / 2)
    decode_step_flops = 2 * num_rows * (body + head) + attn_flops(num_rows, prompt_len + new_tokens / 2)
    kv_bytes = 2 * L * num_rows * (prompt_len + new_tokens / 2) * K * H * itemsize
    decode_step_bytes = cfg.num_params() * itemsize + kv_bytes
    decode = new_tokens * max(decode_step_flops / flops, decode_step_bytes / bw)
    # Reference / policy forward: all tokens through the layers, only completion tokens through the vocab.
    fwd = 2 * num_rows * total_len * body + 2 * num_rows * new_tokens * head
    fwd += attn_flops(num_rows * total_len, total_len / 2)
    phases = {
        "rollout_s": prefill / flops + decode,
        "reference_s": fwd / flops,
        "update_s": 3 * fwd / flops,
    }
    phases["step_s"] = sum(phases.values())
    phases["vocab_fraction_of_fwd_flops"] = 2 * num_rows * new_tokens * head / fwd
    return phases


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_prompts", type=int, default=4)
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--warmup_steps", type=int, default=1)
    ap.add_argument("--steady_steps", type=int, default=3)
    ap.add_argument("--torch_threads", type=int, default=2)
    ap.add_argument(
        "--num_micro_batches",
        type=int,
        default=1,
        help="grpax reference/update row blocks (train_rl's default: 1)",
    )
    ap.add_argument(
        "--remat_policy",
        default="full",
        help="grpax remat of each layer: none | dots | minimal | full (train_rl's)",
    )
    ap.add_argument(
        "--max_staleness",
        default="0",
        help="comma-separated max_staleness values run side by side on the same batches (e.g. 0,1: the "
        "synchronous step and rollouts one step ahead in a thread); each adds a 'grpax@N' row",
    )
    ap.add_argument(
        "--stop_tokens",
        action="store_true",
        help="grpax stops rows at the model's stop tokens (TRL still decodes new_tokens: use with --skip_trl)",
    )
    ap.add_argument(
        "--rollout_only",
        action="store_true",
        help="grpax: the rollout only (no reference pass, no update; the params stay the initial ones), e.g. "
        "to compare samplers on the same batches where the update is too slow to repeat",
    )
    ap.add_argument("--skip_trl", action="store_true")
    ap.add_argument("--skip_grpax", action="store_true")
    ap.add_argument("--json_out", default="")
    add_gsm8k_dir_option(ap)
    args = ap.parse_args()
    train_file = gsm8k_file(args.gsm8k_dir, "train")

    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    bw, flops = measure_bandwidth(), measure_matmul()
    print(
        f"measured: memory bandwidth {bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s (jnp f32)",
        flush=True,
    )

    t0 = time.perf_counter()
    source = read_gguf(default_gguf_path())
    cfg = from_hf_config(
        source.hf_config, dtype="float32", weight_dtype="float32", remat_policy=args.remat_policy
    )
    params = load_params_from_tensors(source.get_tensor, source.has_tensor, cfg)
    tokenizer = source.tokenizer()
    load_s = time.perf_counter() - t0
    num_steps = args.warmup_steps + args.steady_steps
    batches = load_batches(tokenizer, args.num_prompts, num_steps, train_file)
    prompt_len = float(np.mean([len(r["prompt_ids"]) for rows in batches for r in rows]))
    print(f"model load {load_s:.1f} s; mean prompt length {prompt_len:.1f} tokens", flush=True)

    results: dict = {"load_average_start": os.getloadavg(), "bandwidth": bw, "matmul_flops": flops}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_hf_folder(params, cfg, tokenizer, folder)
        if not args.skip_grpax:
            for n in [int(x) for x in args.max_staleness.split(",")]:
                name = "grpax" if n == 0 else f"grpax@{n}"
                results[name] = bench_grpax(params, cfg, tokenizer, batches, args, max_staleness=n)
                results[name]["setup_s"] += load_s
                results[f"load_average_after_{name}"] = os.getloadavg()
        del params
        if not args.skip_trl:
            results["trl"] = bench_trl(folder, batches, args)
            results["load_average_after_trl"] = os.getloadavg()

    roof = roofline(cfg, args.num_prompts * args.num_generations, prompt_len, args.new_tokens, bw, flops)
    results["roofline"] = roof
    keys = ("step_s", "rollout_s", "reference_s", "update_s")
    print(
        f"\nGRPO step, SmolLM2-135M-Instruct float32 CPU, {args.num_prompts} prompts x G={args.num_generations}, "
        f"{args.new_tokens} new tokens, mean prompt {prompt_len:.0f} tokens, beta {BETA}; "
        f"steady = median of {args.steady_steps} steps after {args.warmup_steps} warm-up"
    )
    header = f"{'system':<9}{'start-up s':>11}{'1st step s':>11}{'steady s':>10}{'rollout':>9}{'ref':>7}"
    print(header + f"{'update':>8}{'rewards':>9}{'vs TRL':>8}{'of roof':>9}")
    summary = {}
    names = [n for n in results if n == "grpax" or n.startswith("grpax@")] + ["trl"]
    for name in names:
        if name not in results:
            continue
        steady_steps = results[name]["steps"][args.warmup_steps :]
        med = {k: _median(steady_steps, k) for k in (*keys, "rewards_s")}
        first = results[name]["steps"][0]["step_s"]
        # Start-up: load + construction, plus what the first step costs beyond a steady one (compile, warm-up).
        startup = results[name]["setup_s"] + max(first - med["step_s"], 0.0)
        summary[name] = {"startup_s": startup, "first_step_s": first, **med}
    for name, s in summary.items():
        ratio = summary["trl"]["step_s"] / s["step_s"] if "trl" in summary else float("nan")
        print(
            f"{name:<9}{s['startup_s']:>11.1f}{s['first_step_s']:>11.1f}{s['step_s']:>10.1f}{s['rollout_s']:>9.1f}"
            f"{s['reference_s']:>7.1f}{s['update_s']:>8.1f}{s['rewards_s']:>9.2f}{ratio:>7.2f}x"
            f"{roof['step_s'] / s['step_s']:>9.1%}"
        )
    print(
        f"{'roofline':<9}{'':>11}{'':>11}{roof['step_s']:>10.1f}{roof['rollout_s']:>9.1f}{roof['reference_s']:>7.1f}"
        f"{roof['update_s']:>8.1f}   (vocab projection = {roof['vocab_fraction_of_fwd_flops']:.0%} of forward FLOPs)"
    )
    results["summary"] = summary
    print("\ndecode work (steady medians): rollout ms per useful token, useful tokens, past-EOS row-steps")
    for name in names:
        if name in results and name != "trl":
            steady_steps = results[name]["steps"][args.warmup_steps :]
            work = {
                k: _median(steady_steps, k)
                for k in ("rollout_s_per_useful_token", "useful_tokens", "past_eos")
            }
            summary[name].update(work)
            print(
                f"{name:<9}{1e3 * work['rollout_s_per_useful_token']:>8.1f} ms {work['useful_tokens']:>8.0f}"
                f"{work['past_eos']:>8.1%}"
            )
    if any(n.startswith("grpax@") for n in summary):
        print(
            "\noverlap = (rollout + reference + rewards + update) / step: above 1 when the rollout thread hides "
            "part of its time behind the update"
        )
        for name, s in summary.items():
            if name.startswith("grpax"):
                busy = s["rollout_s"] + s["reference_s"] + s["rewards_s"] + s["update_s"]
                s["overlap"] = busy / s["step_s"]
                print(f"{name:<9} {1 / s['step_s']:.4f} steps/s  overlap {s['overlap']:.2f}")
    print(f"load average after: {os.getloadavg()}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
