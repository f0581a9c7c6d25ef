"""Seconds per GRPO step with tools (``environment=calculator``) against a single-turn step of the same budget.

SmolLM2-135M-Instruct (the embedded GGUF, dequantised to float32) on GSM8K train prompts (``smollm2_demo``
preset, rewards ``smollm2_demo``), P prompts x G trajectories per step, float32 on CPU. Both steps are the
trainer's: a ``Rollout`` (single-turn) or ``MultiTurnRollout`` (the calculator between the turns, tag format,
``max_turns`` turns of at most ``max_turn_tokens`` model tokens) then ``make_update``. Same for both:

* the prompt text: the environment's ``reset`` renders it (the calculator instruction included), and the
  single-turn step gets those same token ids, so the prefill is the same work;
* the token budget: the single-turn ``max_completion_length`` is the multi-turn trajectory's (``--budget``:
  model and observation tokens after the prompt); stop tokens (EOS, end of turn) end a row in both;
* the model and its weights: one ``TrainState``, updated by both arms in turn (so the two steps of a repeat
  sample from params one small update apart);
* the batch of each repeat: repeat r samples the same P questions in both arms (fresh PRNG keys per arm).

The arms alternate, and their order flips every repeat (M S, S M, M S, ...), so that a load that drifts over
the run (a shared machine) falls on both. The first step of each arm compiles and is reported apart (warm-up);
the table is the median over ``--repeats`` of: step, rollout, reference and update seconds, model tokens
(``completion_mask`` 1) and the step's seconds per model token; the multi-turn arm also its turns, tool calls,
observation tokens per trajectory. The ratio multi / single is of the medians.

``--environment lines`` swaps the calculator for ``LineTool``, which answers every line: an untrained SmolLM2
rarely calls the calculator (a calculator step is then a single-turn step with pauses), while with ``lines``
every trajectory takes its turns, so the machinery's cost (pauses, host round trips, observations fed into the
cache) is what the ratio shows.

With the calculator, ``--prompt_preset smollm2_calculator`` (an example that calls it), a low ``--temperature``
(the untrained model calls it greedily on 4 of 32 test questions, at T 0.7 on none) and
``--load_parameters_path`` (a checkpoint trained to call it, e.g. a ``train_rl`` run's ``model_params``) make
the calculator arm take turns. ``--max_prompt_length`` bounds the rendered prompt (rows longer are skipped).

Usage: python benchmarks/multi_turn_bench.py [--num_prompts 2] [--num_generations 4] [--budget 192]
       [--max_turns 4] [--max_turn_tokens 64] [--repeats 3] [--environment calculator|lines]
       [--prompt_preset smollm2_demo] [--temperature 0.9] [--beta 0.08] [--max_prompt_length 384]
       [--load_parameters_path DIR] [--json_out FILE] [--gsm8k_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from grpax.checkpoint.gguf import default_gguf_path, read_gguf
from grpax.checkpoint.hf import load_params_from_tensors
from grpax.checkpoint.orbax import load_model
from grpax.data.tokenizer import stop_token_ids
from grpax.models.registry import from_hf_config
from grpax.rl.config import GRPOConfig
from grpax.rl.multi_turn import MultiTurnRollout
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout, task_scorer
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.rl.trainer import step_metrics
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.multi_turn import encode, render_prompt
from grpax.tasks.environment import MultiTurnConfig, calculator_environment
from grpax.tasks.gsm8k import GSM8KTask
from grpax.tasks.gsm8k_rewards import get_reward_config
from grpax.tasks.prompts import get_prompt_preset

sys.path.insert(0, str(Path(__file__).parent))
from rollout_bench import add_gsm8k_dir_option, gsm8k_file  # noqa: E402

PRESET = "smollm2_demo"
TOP_K, SEED = 50, 42


def load_batches(
    task, tokenizer, path: Path, num_prompts: int, num_steps: int, max_prompt_length: int
) -> list[list[dict]]:
    """``num_steps`` batches of ``num_prompts`` shuffled GSM8K rows, each with ``prompt_ids``: the prompt as the
    calculator environment renders it (what both arms prefill)."""
    rows = task.load_rows(str(path), "train")
    order = np.random.default_rng(SEED).permutation(len(rows))
    env = calculator_environment()
    picked = []
    for i in order:
        row = dict(rows[i])
        row["prompt_ids"] = encode(tokenizer, render_prompt(tokenizer, env, row, task.preset))
        if len(row["prompt_ids"]) <= max_prompt_length:
            picked.append(row)
        if len(picked) == num_prompts * num_steps:
            break
    return [picked[i * num_prompts : (i + 1) * num_prompts] for i in range(num_steps)]


class LineTool:
    """A stand-in tool environment that answers every line the model writes (stop string ``"\\n"``) with
    ``<result>ok</result>``: every trajectory takes turns until ``max_turns`` or a budget, whatever the model
    writes, so the turn machinery's cost is measured even for a model that never calls the calculator."""

    stop_strings = ("\n",)

    def reset(self, row):
        return calculator_environment().reset(row)  # the calculator's prompt: the same prefill as its arm

    def step(self, text):
        return "<result>ok</result>\n", 0.0, False


ENVIRONMENTS = {"calculator": calculator_environment, "lines": LineTool}


def run_step(name, rollout, update, state, rows, key) -> tuple[TrainState, dict]:
    """One trainer step (rollout, then update); its phase times, model tokens and turn metrics."""
    t_start = time.perf_counter()
    rollout.update_params(state.params, 0)
    batch = rollout(rows, key)
    t_update = time.perf_counter()
    state, update_metrics = update(state, batch)
    jax.block_until_ready(state)
    t_end = time.perf_counter()
    m = step_metrics(
        batch, update_metrics, {"time/train_s": t_end - t_update, "time/step_s": t_end - t_start}
    )
    model_tokens = int(batch.host.completion_lengths.sum())
    step = {
        "arm": name,
        "step_s": m["time/step_s"],
        "rollout_s": m["time/rollout_s"],
        "reference_s": m["time/reference_s"],
        "update_s": m["time/train_s"],
        "model_tokens": model_tokens,
        "s_per_model_token": m["time/step_s"] / max(model_tokens, 1),
        "rollout_ms_per_model_token": 1e3 * m["time/rollout_s"] / max(model_tokens, 1),
        "completion_axis": int(batch.completion_ids.shape[1]),
        "reward_mean": m["rewards/total/mean"],
        "load_average": os.getloadavg()[0],
    }
    for k in ("turns", "tool_calls", "tool_use_rate", "tool_errors", "observation_tokens"):
        if f"multi_turn/{k}" in m:
            step[k] = m[f"multi_turn/{k}"]
    print(f"{name}: " + json.dumps(step), flush=True)
    return state, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_prompts", type=int, default=2)
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--budget", type=int, default=192, help="tokens after the prompt (both arms)")
    ap.add_argument("--max_turns", type=int, default=4)
    ap.add_argument("--max_turn_tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="measured steps per arm (after one warm-up each)")
    ap.add_argument("--learning_rate", type=float, default=1e-6)
    ap.add_argument(
        "--environment",
        default="calculator",
        choices=sorted(ENVIRONMENTS),
        help="the multi-turn arm's: calculator (GSM8K's tool), or lines (every line answered: max_turns turns)",
    )
    ap.add_argument("--prompt_preset", default=PRESET, help="smollm2_demo | smollm2_calculator")
    ap.add_argument(
        "--beta", type=float, default=0.08, help="KL coefficient (0: no reference model, 0.54 GB less)"
    )
    ap.add_argument(
        "--temperature", type=float, default=0.9, help="rollout temperature (both arms; top-k 50)"
    )
    ap.add_argument("--max_prompt_length", type=int, default=384, help="longest rendered prompt, tokens")
    ap.add_argument(
        "--load_parameters_path",
        default="",
        help="native params (a train_rl run's checkpoints/actor/<step>/model_params); '' = the GGUF's",
    )
    ap.add_argument("--json_out", default="")
    add_gsm8k_dir_option(ap)
    args = ap.parse_args()
    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}",
        flush=True,
    )
    t0 = time.perf_counter()
    source = read_gguf(default_gguf_path())
    cfg = from_hf_config(source.hf_config, dtype="float32", weight_dtype="float32", remat_policy="full")
    if args.load_parameters_path:
        params, _, _ = load_model(args.load_parameters_path, cfg)
        params = jax.device_put(params)
    else:
        params = jax.device_put(load_params_from_tensors(source.get_tensor, source.has_tensor, cfg))
    tokenizer = source.tokenizer()
    task = GSM8KTask(
        get_prompt_preset(args.prompt_preset), get_reward_config(PRESET), None, "question", "answer"
    )
    batches = load_batches(
        task,
        tokenizer,
        gsm8k_file(args.gsm8k_dir, "train"),
        args.num_prompts,
        args.repeats + 1,
        args.max_prompt_length,
    )
    prompt_len = float(np.mean([len(r["prompt_ids"]) for rows in batches for r in rows]))
    print(f"model load {time.perf_counter() - t0:.1f} s; mean prompt {prompt_len:.1f} tokens", flush=True)

    grpo = GRPOConfig(
        num_generations=args.num_generations,
        beta=args.beta,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_schedule="constant",
        warmup_ratio=0.0,
    )
    optimizer, schedule = optimizer_from_config(grpo, 2 * (args.repeats + 1))
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    update = make_update(make_train_step(cfg, grpo, optimizer, 1, schedule), grpo.num_iterations)
    sampler_cfg = SamplerConfig(
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.budget,
        temperature=args.temperature,
        top_k=TOP_K,
        stop_token_ids=stop_token_ids(tokenizer, cfg),
        pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else 2,
    )
    reference = jax.tree.map(jnp.copy, params) if args.beta else None  # beta 0: no reference pass
    turn_cfg = MultiTurnConfig(max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens)
    arms = {
        "multi": MultiTurnRollout(
            cfg,
            sampler_cfg,
            grpo,
            task,
            tokenizer,
            ENVIRONMENTS[args.environment],
            turn_cfg,
            reference=reference,
        ),
        "single": Rollout(cfg, sampler_cfg, grpo, task_scorer(task, tokenizer), reference=reference),
    }
    steps: list[dict] = []
    for r, rows in enumerate(batches):
        order = ("multi", "single") if r % 2 == 0 else ("single", "multi")
        for name in order:
            key = jax.random.fold_in(jax.random.key(SEED), 2 * r + (name == "single"))
            state, step = run_step(name, arms[name], update, state, rows, key)
            step["repeat"] = r  # repeat 0 compiles: the warm-up
            steps.append(step)

    keys = ("step_s", "rollout_s", "reference_s", "update_s", "model_tokens", "s_per_model_token")
    keys += ("rollout_ms_per_model_token", "completion_axis", "load_average")
    medians = {
        name: {
            k: statistics.median(s[k] for s in steps if s["arm"] == name and s["repeat"] > 0) for k in keys
        }
        for name in arms
    }
    for k in ("turns", "tool_calls", "tool_use_rate", "tool_errors", "observation_tokens"):
        medians["multi"][k] = statistics.median(
            s[k] for s in steps if s["arm"] == "multi" and s["repeat"] > 0
        )
    warm = {name: next(s["step_s"] for s in steps if s["arm"] == name) for name in arms}
    print(
        f"\nGRPO step, SmolLM2-135M-Instruct float32 {jax.default_backend()}, {args.num_prompts} prompts x "
        f"G={args.num_generations}, budget {args.budget} tokens after the prompt (multi-turn: environment "
        f"{args.environment}, prompt_preset {args.prompt_preset}, max_turns "
        f"{args.max_turns}, max_turn_tokens {args.max_turn_tokens}), temperature {args.temperature}, params "
        f"{args.load_parameters_path or 'GGUF'}, mean prompt {prompt_len:.0f} tokens; "
        f"median of {args.repeats} alternating repeats (first step of each arm, compiling: multi "
        f"{warm['multi']:.1f} s, single {warm['single']:.1f} s)"
    )
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name in arms:
        print(f"| {name} | " + " | ".join(f"{medians[name][k]:.4g}" for k in keys) + " |")
    print(
        "| multi / single | "
        + " | ".join(f"{medians['multi'][k] / medians['single'][k]:.2f}" for k in keys)
        + " |"
    )
    m = medians["multi"]
    print(
        f"multi-turn per trajectory: turns {m['turns']:.2f}, tool calls {m['tool_calls']:.2f}, tool use rate "
        f"{m['tool_use_rate']:.2f}, tool errors {m['tool_errors']:.2f}, observation tokens {m['observation_tokens']:.1f}"
    )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {"args": vars(args) | {"gsm8k_dir": str(args.gsm8k_dir)}, "steps": steps, "medians": medians},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
