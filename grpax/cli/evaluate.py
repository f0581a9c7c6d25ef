"""``grpax evaluate``: GSM8K accuracy of a checkpoint, or of completions made elsewhere (e.g. vLLM)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from grpax.config import ConfigError, field
from grpax.rewards.gsm8k import get_reward_config

DESCRIPTION = (
    "Evaluate a checkpoint on the GSM8K test split (num_test_batches x eval_batch_size questions, 4 x 16 as "
    "train_rl by default; num_test_batches=-1: all of it), "
    "greedy or sampled with num_eval_passes samples per question; prints accuracy, partial_accuracy, "
    "format_accuracy, mean_reward, pass@k and maj@k with 95% intervals. With completions_path=FILE.jsonl "
    "(fields question, answer, completion) it scores completions made elsewhere, no model needed. "
    "output_path=DIR writes DIR/results.jsonl and DIR/summary.json."
)


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    load_parameters_path: str = field("", "checkpoint to evaluate (<base>/0/items or an actor checkpoint)")
    completions_path: str = field("", "score this JSONL of completions instead of sampling a model")
    model_name: str = field(
        "smollm2-135m-Instruct", "model registry name: picks the model preset (prompt, rewards, dtypes)"
    )
    dataset_name: str = field("openai/gsm8k", "Hub name, a folder with test.jsonl, or a file")
    eval_split: str = field("test", "split to evaluate")
    num_test_batches: int = field(
        4, "evaluate num_test_batches * eval_batch_size questions, as train_rl (-1: the whole split)"
    )
    eval_batch_size: int = field(16, "questions per generate call")
    num_eval_passes: int = field(1, "samples per question (k of pass@k and maj@k)")
    eval_sampling_strategy: str = field("greedy", "greedy | standard | liberal (MaxText rl.yml)")
    max_prefill_predict_length: int = field(256, "max prompt tokens (longer prompts are dropped, counted)")
    max_target_length: int = field(512, "max prompt + completion tokens")
    prompt_preset: str = field("maxtext", "prompt wording: maxtext | smollm2_demo (model presets pick one)")
    reward_preset: str = field(
        "maxtext", "reward values: maxtext | tunix | simple | smollm2_demo (model presets pick one)"
    )
    response_prefix: str = field("", "with completions_path: text the completions continue from")
    seed: int = field(0, "sampling seed")
    scan_layers: bool = field(True, "stacked layers")
    weight_dtype: str = field("float32", "parameter dtype")
    dtype: str = field("float32", "activation dtype")
    output_path: str = field("", "folder for results.jsonl and summary.json")
    hardware: str = field("cpu", "cpu | gpu | tpu")
    skip_jax_distributed_system: bool = field(True, "do not call jax.distributed.initialize")


CONFIG = EvaluateConfig


def _print_summary(summary: dict) -> None:
    for key, value in summary.items():
        if key.endswith("_ci95"):
            continue
        ci = summary.get(f"{key}_ci95")
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        if ci:
            text += f"  (95% CI {ci[0]:.4f} .. {ci[1]:.4f})"
        print(f"{key:<20} {text}")


def run(config: EvaluateConfig) -> int:
    from grpax.eval.keys import validate_eval_keys

    reward_config = get_reward_config(config.reward_preset)
    validate_eval_keys(config, allow_no_eval=False)
    if config.completions_path:
        from grpax.data.gsm8k import extract_gold
        from grpax.eval.metrics import load_completions_file, score_records, summarize

        records_in = load_completions_file(config.completions_path)
        golds = [extract_gold(r["answer"]) or r["answer"] for r in records_in]
        records = score_records(
            [r["question"] for r in records_in],
            golds,
            [r["completion"] for r in records_in],
            reward_config,
            response_prefix=config.response_prefix,
        )
        summary = summarize(records, config.num_eval_passes)
        if config.output_path:
            out = Path(config.output_path)
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _print_summary(summary)
        return 0
    if not config.load_parameters_path:
        raise ConfigError("pass load_parameters_path=<checkpoint> or completions_path=<file.jsonl>")
    from grpax import distributed
    from grpax.checkpoint.orbax import load_model
    from grpax.data.gsm8k import prepare_rows
    from grpax.data.prompts import get_prompt_preset
    from grpax.data.tokenizer import stop_token_ids
    from grpax.eval.evaluate import evaluate
    from grpax.eval.keys import EVAL_STRATEGIES
    from grpax.models.registry import check_context_length
    from grpax.sampler.engine import SamplerConfig

    what = f"max_target_length={config.max_target_length}"
    check_context_length(config.max_target_length, what, config.load_parameters_path)
    distributed.maybe_initialize(config.skip_jax_distributed_system)
    params, model_cfg, tokenizer = load_model(
        config.load_parameters_path,
        scan_layers=config.scan_layers,
        weight_dtype=config.weight_dtype,
        dtype=config.dtype,
    )
    preset = get_prompt_preset(config.prompt_preset)
    limit = config.num_test_batches * config.eval_batch_size if config.num_test_batches > 0 else -1
    rows = prepare_rows(
        tokenizer,
        config.dataset_name,
        config.eval_split,
        preset,
        config.max_prefill_predict_length,
        limit,
        need=("dataset_name", "eval_split", 1),
    )
    stops = stop_token_ids(tokenizer, model_cfg)
    sampler_cfg = SamplerConfig(
        max_prompt_length=config.max_prefill_predict_length,
        max_completion_length=config.max_target_length - config.max_prefill_predict_length,
        stop_token_ids=stops,
        pad_token_id=model_cfg.pad_token_id if model_cfg.pad_token_id is not None else stops[0],
        **EVAL_STRATEGIES[config.eval_sampling_strategy],
    )
    summary = evaluate(
        params,
        model_cfg,
        tokenizer,
        rows,
        prompt_preset=preset,
        reward_config=reward_config,
        sampler_cfg=sampler_cfg,
        batch_size=config.eval_batch_size,
        num_eval_passes=config.num_eval_passes,
        seed=config.seed,
        output_path=config.output_path or None,
    )
    _print_summary(summary)
    return 0
