"""Evaluation of a policy on a task: sample, score with the task's rewards and check, summarise with CIs.

The same function serves ``grpax evaluate`` and the GRPO trainer (before, during and after training), so
numbers are comparable across both. Metrics: accuracy, partial_accuracy, format_accuracy, mean_reward,
pass@k and maj@k (``grpax.eval.metrics``); what counts as correct, close and formatted is the task's
(``grpax.tasks``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from tqdm.auto import tqdm

from grpax import prng
from grpax.eval.metrics import summarize
from grpax.files import write_text_atomic
from grpax.models.registry import ModelConfig
from grpax.sampler.engine import generate
from grpax.sampler.keys import SamplerConfig

if TYPE_CHECKING:
    from grpax.tasks.base import Task

log = logging.getLogger("grpax.evaluate")


def decode_completions(tokenizer: Any, completion_ids: np.ndarray, completion_mask: np.ndarray) -> list[str]:
    """Decodes each row's masked completion tokens to text (special tokens such as EOS dropped)."""
    rows = [
        ids[mask.astype(bool)].tolist()
        for ids, mask in zip(np.asarray(completion_ids), np.asarray(completion_mask), strict=True)
    ]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


TURN_FIELDS = ("turns", "tool_calls", "tool_errors")  # per record of a multi-turn evaluation


def evaluate(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    task: Task,
    sampler_cfg: SamplerConfig,
    batch_size: int,
    num_eval_passes: int = 1,
    eval_mode: str = "pass",
    seed: int = 0,
    output_path: str | Path | None = None,
    desc: str = "eval",
    trajectories: Callable | None = None,
) -> dict:
    """Samples ``num_eval_passes`` completions per question and returns the summary metrics.

    Args:
      params: model params (any sharding).
      model_cfg: the model's config.
      tokenizer: HF tokenizer (decodes the completions).
      rows: the task's rows as ``grpax.data.prompts.prepare_rows`` gives them (``Task.load_rows``'s
        ``question``, ``gold`` and columns, and ``prompt_ids``: the prompt rendered with ``task.preset``
        and tokenised once).
      task: scores and judges the completions (``Task.records``).
      sampler_cfg: sampling settings (greedy for the usual accuracy).
      batch_size: questions per generate call (rows per call = batch_size * num_eval_passes).
      num_eval_passes: samples per question (k of pass@k and maj@k).
      eval_mode: which metric is the summary's ``score`` (``grpax.eval.metrics.summarize``).
      seed: sampling seed.
      output_path: a folder to write ``results.jsonl`` (one record per completion) and ``summary.json``.
      desc: progress-bar label.
      trajectories: multi-turn sampling with an environment (``grpax.sampler.multi_turn.trajectory_sampler``):
        ``(params, rows, key, num_generations) -> MultiTurnOutput``; the records then hold each trajectory's
        text (observations included), ``turns``, ``tool_calls`` and ``tool_errors``, and the summary their means
        per completion (``turns``, ``tool_calls``, ``tool_errors``). None: single-turn ``generate``.

    Returns:
      The summary dict of ``grpax.eval.metrics.summarize`` (num_questions, accuracy, partial_accuracy,
      format_accuracy, mean_reward, pass@k, maj@k, score, with 95% intervals).

    Raises:
      ValueError: if ``rows`` is empty or ``batch_size`` / ``num_eval_passes`` < 1.
      RewardFunctionError: a user reward function misbehaved (``grpax.tasks.base``).
    """
    if not rows:
        raise ValueError("evaluate: no questions to evaluate (num_test_batches or the eval split is empty)")
    if batch_size < 1 or num_eval_passes < 1:
        raise ValueError(
            f"evaluate: batch_size={batch_size} and num_eval_passes={num_eval_passes} must be >= 1"
        )
    prompt_ids = [row["prompt_ids"] for row in rows]
    key = prng.key(seed)
    records: list[dict] = []
    starts = range(0, len(rows), batch_size)
    for i, start in enumerate(
        tqdm(starts, desc=desc, unit="batch", leave=False, disable=jax.process_index() != 0)
    ):
        batch_rows = rows[start : start + batch_size]
        if trajectories is not None:
            out = trajectories(params, batch_rows, prng.fold_in(key, i), num_eval_passes)
            completions = out.texts
        else:
            out = generate(
                params,
                prompt_ids[start : start + batch_size],
                model_cfg,
                sampler_cfg,
                prng.fold_in(key, i),
                num_generations=num_eval_passes,
                num_slots=batch_size * num_eval_passes,  # a short last batch: the full batches' programs
            )
            completions = decode_completions(tokenizer, out.completion_ids, out.completion_mask)
        batch_records = task.records([row for row in batch_rows for _ in range(num_eval_passes)], completions)
        for j, (record, reason) in enumerate(zip(batch_records, out.finish_reason, strict=True)):
            record["finish_reason"] = reason
            if trajectories is not None:
                record.update({k: int(getattr(out, k)[j]) for k in TURN_FIELDS})
        records.extend(batch_records)
    summary = summarize(records, num_eval_passes, task.is_correct, eval_mode)
    if trajectories is not None:
        summary.update({k: float(np.mean([r[k] for r in records])) for k in TURN_FIELDS})
    if output_path is not None and jax.process_index() == 0:  # each file atomically: never half a file
        write_text_atomic(Path(output_path) / "results.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        write_text_atomic(Path(output_path) / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
