"""``grpax evaluate``: a task's accuracy (GSM8K by default) of a checkpoint, or of completions made elsewhere."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from grpax.config import ConfigError, SamplingKeys, check_engine_keys, field, read_model_config
from grpax.eval.keys import EvalKeys
from grpax.files import check_output, write_text_atomic
from grpax.tasks import TaskConfig, build_task, validate_task_keys

DESCRIPTION = (
    "Evaluate a checkpoint on a task's test split (task=gsm8k by default; math, or custom with your own "
    "reward functions, as train_rl takes them; num_test_batches x eval_batch_size questions, 4 x 16 as "
    "train_rl by default; num_test_batches=-1: all of it), "
    "greedy or sampled with num_eval_passes samples per question; prints accuracy, partial_accuracy, "
    "format_accuracy, mean_reward, pass@k and maj@k with 95% intervals. With completions_path=FILE.jsonl "
    "(fields completion plus the task's columns: question, answer for gsm8k) it scores completions made "
    "elsewhere, no model needed. output_path=DIR writes DIR/results.jsonl and DIR/summary.json."
)


@dataclasses.dataclass(frozen=True)
class EvaluateConfig(EvalKeys, TaskConfig, SamplingKeys):
    load_parameters_path: str = field("", "checkpoint to evaluate (<base>/0/items or an actor checkpoint)")
    completions_path: str = field(
        "",
        "score this file of completions instead of sampling a model (JSONL; Parquet too for task=math|custom; "
        "not with load_parameters_path), "
        "each question's num_eval_passes samples on consecutive lines",
    )
    model_name: str = field(
        "smollm2-135m-Instruct", "model registry name: picks the model preset (prompt, rewards, dtypes)"
    )
    dataset_name: str = field(
        "openai/gsm8k", "Hub name, a folder with test.jsonl or test.parquet, or a .jsonl / .parquet file"
    )
    hf_eval_files: str = field(
        "",
        "the rows' files (MaxText key), read instead of dataset_name's eval_split: a path or glob of .jsonl / "
        ".parquet files, or hf://datasets/<owner>/<name>/<glob> (the datasets library, online)",
    )
    eval_split: str = field("test", "split to evaluate")
    num_test_batches: int = field(
        4, "evaluate num_test_batches * eval_batch_size questions, as train_rl (-1: the whole split)"
    )
    eval_batch_size: int = field(16, "questions per generate call")
    max_prefill_predict_length: int = field(256, "max prompt tokens (longer prompts are dropped, counted)")
    max_target_length: int = field(512, "max prompt + completion tokens")
    response_prefix: str = field(
        "",
        "with completions_path: text the completions continue from ('' = the response_prefix the file's lines "
        "store, as a run's eval/<tag>/results.jsonl does; the prompt preset's own is not applied to a file)",
    )
    seed: int = field(0, "sampling seed")
    output_path: str = field("", "folder for results.jsonl and summary.json")
    overwrite: bool = field(False, "replace results.jsonl / summary.json already in output_path")

    def eval_dataset(self) -> tuple[str, str]:
        """(the key that names the rows, its value): hf_eval_files when set, else dataset_name."""
        return (
            ("hf_eval_files", self.hf_eval_files)
            if self.hf_eval_files
            else ("dataset_name", self.dataset_name)
        )


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


def _write(output_path: str, records: list[dict], summary: dict) -> None:
    write_text_atomic(Path(output_path) / "results.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    write_text_atomic(Path(output_path) / "summary.json", json.dumps(summary, indent=2) + "\n")


def _check_groups(config: EvaluateConfig, questions: list[str]) -> None:
    """Raises ConfigError unless the file splits into runs of num_eval_passes lines of one question each."""
    k, path = config.num_eval_passes, config.completions_path
    if not questions:
        raise ConfigError(f"completions_path={path!r} holds no completions: one JSON object per line")
    if len(questions) % k:
        raise ConfigError(
            f"completions_path={path!r} holds {len(questions)} completions, not a multiple of num_eval_passes={k}: "
            "set num_eval_passes to the samples per question"
        )
    for start in range(0, len(questions), k):
        if len(set(questions[start : start + k])) != 1:
            raise ConfigError(
                f"completions_path={path!r}: lines {start + 1}-{start + k} mix questions, but num_eval_passes={k} "
                "reads each question's samples from consecutive lines: reorder the file or set num_eval_passes"
            )


def _response_prefix(config: EvaluateConfig, lines: list) -> str:
    """The text the file's completions continue: ``response_prefix`` when given, else the one its lines store
    (grpax's own results.jsonl records it), else ''.

    Raises:
      ConfigError: the lines store different prefixes and response_prefix is not given.
    """
    stored = {
        r["response_prefix"]
        for r in lines
        if isinstance(r, dict) and isinstance(r.get("response_prefix"), str)
    }
    if config.response_prefix or not stored:
        return config.response_prefix
    if len(stored) > 1:
        raise ConfigError(
            f"completions_path={config.completions_path!r}: its lines store {len(stored)} different response_prefix "
            "values: pass response_prefix=<the text the completions continue> to score them all alike"
        )
    return stored.pop()


def _score_file(config: EvaluateConfig, task) -> tuple[list[dict], dict]:
    """Scores completions_path with the task (its rewards, its check); returns records and summary.

    Raises:
      ConfigError: the file is missing, empty, has a line without ``completion`` or not an object, or does not
        split into groups of num_eval_passes consecutive lines of one question.
    """
    from grpax.eval.metrics import summarize

    path = Path(config.completions_path).expanduser()
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"completions_path={config.completions_path!r} {what} (relative to {Path.cwd()}): pass "
            f"{task.completions_file} completion and the task's columns"
        )
    rows, completions, lines = task.read_completions(path, f"completions_path={config.completions_path!r}")
    task.preset = dataclasses.replace(task.preset, response_prefix=_response_prefix(config, lines))
    _check_groups(config, [r["question"] for r in rows])
    records = task.records(rows, completions)
    return records, summarize(records, config.num_eval_passes, task.is_correct, config.eval_mode)


def run(config: EvaluateConfig) -> int:
    from grpax.eval.keys import validate_eval_keys

    validate_eval_keys(config, allow_no_eval=False)
    validate_task_keys(config)
    check_engine_keys(
        config, config.max_target_length, "max_target_length", (("num_eval_passes", config.num_eval_passes),)
    )
    if config.output_path:
        check_output("output_path", config.output_path, config.overwrite, ("results.jsonl", "summary.json"))
    if config.completions_path and config.load_parameters_path:
        raise ConfigError(
            f"completions_path={config.completions_path!r} and load_parameters_path={config.load_parameters_path!r}: "
            "pass one (completions_path scores that file and samples no model; load_parameters_path samples the "
            "checkpoint)"
        )
    task = build_task(config)
    if config.completions_path:
        records, summary = _score_file(config, task)
        if config.output_path:
            _write(config.output_path, records, summary)
        _print_summary(summary)
        return 0
    if not config.load_parameters_path:
        raise ConfigError("pass load_parameters_path=<checkpoint> or completions_path=<file.jsonl>")
    summary = _sample_and_score(config, task)
    _print_summary(summary)
    return 0


def _sample_and_score(config: EvaluateConfig, task) -> dict:
    """The checkpoint's completions of the evaluation rows, scored with ``task`` (written to output_path): the
    summary."""
    from grpax import distributed
    from grpax.checkpoint.orbax import load_model
    from grpax.data.prompts import prepare_rows
    from grpax.data.tokenizer import stop_token_ids
    from grpax.eval.evaluate import evaluate
    from grpax.eval.keys import eval_sampling
    from grpax.sampler.keys import sampler_config
    from grpax.sampler.paging import check_memory_fraction

    # The checkpoint's config.json, read once: the context check here, the load below.
    what = f"max_target_length={config.max_target_length}"
    model_cfg, _ = read_model_config(config.load_parameters_path, config, config.max_target_length, what)
    key, dataset = config.eval_dataset()
    try:  # before the model loads: a wrong path or column is named at once, with the keys that chose it
        task_rows = task.load_rows(dataset, config.eval_split)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}={dataset!r} (eval_split={config.eval_split!r}): {e}") from None
    distributed.maybe_initialize(config.skip_jax_distributed_system)
    check_memory_fraction(config.hbm_utilization_vllm)
    params, model_cfg, tokenizer = load_model(config.load_parameters_path, model_cfg)
    limit = config.num_test_batches * config.eval_batch_size if config.num_test_batches > 0 else -1
    rows = prepare_rows(
        tokenizer,
        dataset,
        config.eval_split,
        task.preset,
        config.max_prefill_predict_length,
        limit,
        need=(key, "eval_split", 1),
        load=lambda dataset, split: task_rows,
        render=_renderer(config, task, tokenizer),
    )
    sampler_cfg = sampler_config(
        config.max_prefill_predict_length,
        config.max_target_length - config.max_prefill_predict_length,
        stop_token_ids(tokenizer, model_cfg),
        model_cfg.pad_token_id,
        **eval_sampling(config),
        **config.engine_keys(),
    )
    return evaluate(
        params,
        model_cfg,
        tokenizer,
        rows,
        task=task,
        sampler_cfg=sampler_cfg,
        batch_size=config.eval_batch_size,
        num_eval_passes=config.num_eval_passes,
        eval_mode=config.eval_mode,
        seed=config.seed,
        output_path=config.output_path or None,
        trajectories=_trajectories(config, task, tokenizer, model_cfg, sampler_cfg),
    )


def _renderer(config: EvaluateConfig, task, tokenizer):
    """With ``environment``: a row's prompt as the environment renders it (measured against
    max_prefill_predict_length with its instructions), else None."""
    if not config.environment:
        return None
    from grpax.sampler.multi_turn import prompt_renderer
    from grpax.tasks import environment_factory

    return prompt_renderer(tokenizer, environment_factory(config), task.preset)


def _trajectories(config: EvaluateConfig, task, tokenizer, model_cfg, sampler_cfg):
    """With ``environment``: the multi-turn sampler (the same environment as training), else None."""
    if not config.environment:
        return None
    from grpax.sampler.multi_turn import trajectory_sampler
    from grpax.tasks import environment_factory, multi_turn_config

    env = environment_factory(config)
    return trajectory_sampler(task, tokenizer, env, model_cfg, sampler_cfg, multi_turn_config(config))
