"""Is the before/after change of an evaluation larger than the noise? A paired test on the same questions.

``grpax train_rl`` evaluates the same test questions before and after training, so the two evaluations are
paired: each question's value before and after (its fraction of correct samples, or its mean reward) are
compared directly,
which removes the question-to-question spread that makes the two separate 95% intervals overlap even for a
real gain. The test is the two-sided exact sign test on the per-question differences: questions that went up
("up") against those that went down ("down"), ties dropped, under H0 each changed question goes either way
with probability 1/2. With one sample per question (greedy evaluation) the values are 0 or 1 and this is the
exact form of McNemar's test (McNemar 1947) on the discordant questions. It assumes no distribution and is
exact at any size, at the price of ignoring how large each question's change is (which matters only with
several samples per question).

maj@k is judged with the task's own answer check (``Task.is_correct``: GSM8K's numbers, math-verify for
``task=math``, the answer column for ``task=custom``), the same one ``grpax.eval.metrics.summarize`` uses, so the
paired test and the summary agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from grpax.eval.metrics import majority_answer, total_reward

AnswerCheck = Callable[[str | None, str], bool]

PAIRED_METRICS = ("accuracy", "partial_accuracy", "format_accuracy", "mean_reward", "pass@k", "maj@k")
ALPHA = 0.05  # a change with p < ALPHA is called larger than the noise


def sign_test_p_value(up: int, down: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven if each side had probability 1/2.

    Args:
      up: questions whose value rose; down: questions whose value fell (ties are not counted).

    Returns:
      p in [0, 1]: 2 * P(X <= min(up, down)) for X ~ Binomial(up + down, 1/2), at most 1; 1.0 when nothing
      changed.

    Example:
      >>> sign_test_p_value(4, 1)  # 2 * (C(5,0) + C(5,1)) / 2^5
      0.375
    """
    n = up + down
    tail = sum(math.comb(n, i) for i in range(min(up, down) + 1)) / 2**n
    return min(1.0, 2 * tail)


def question_values(records: Sequence[dict], check: AnswerCheck) -> dict[str, dict[str, float]]:
    """Each question's value of the ``PAIRED_METRICS``, from its records (all samples of it, in any order).

    Args:
      records: scored completions (``Task.records``; ``eval/<tag>/results.jsonl`` lines).
      check: whether a majority answer equals the gold one, ``check(answer, gold)`` (the task's ``is_correct``).

    Returns:
      ``{question: {metric: value}}``: the fraction of its samples correct / close / formatted, pass@k (any
      sample correct) and maj@k (the majority answer correct), each in [0, 1]; mean_reward, the mean total
      reward of its samples in points (NaN when every sample abstained).
    """
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["question"], []).append(r)

    def mean(flags: list[bool]) -> float:
        return sum(flags) / len(flags)

    def mean_points(rs: list[dict]) -> float:
        points = [x for x in (total_reward(r) for r in rs) if not math.isnan(x)]
        return sum(points) / len(points) if points else math.nan

    out = {}
    for question, rs in groups.items():
        correct = [bool(r["correct"]) for r in rs]
        out[question] = {
            "accuracy": mean(correct),
            "partial_accuracy": mean([bool(r["close"]) for r in rs]),
            "format_accuracy": mean([bool(r["formatted"]) for r in rs]),
            "mean_reward": mean_points(rs),
            "pass@k": float(any(correct)),
            "maj@k": float(check(majority_answer([r["extracted_answer"] for r in rs]), rs[0]["answer"])),
        }
    return out


def compare(before: Sequence[dict], after: Sequence[dict], check: AnswerCheck) -> dict:
    """Paired comparison of two evaluations' records on the questions they share.

    Args:
      before, after: scored completion records of the two evaluations.
      check: maj@k's answer check, ``check(answer, gold)`` (the task's ``is_correct``).

    Returns:
      ``{"num_questions": Q paired, "alpha": ALPHA, "metrics": {name: {"change", "up", "down", "p_value"}}}``:
      ``change`` is the mean over the Q questions of after - before (in the metric's units: a proportion, or
      points; questions without a mean reward on either side are left out), ``up`` / ``down`` count the
      questions that rose / fell, ``p_value`` is ``sign_test_p_value(up, down)``.
    """
    b, a = question_values(before, check), question_values(after, check)
    shared = [q for q in b if q in a]
    metrics = {}
    for name in PAIRED_METRICS:
        diffs = [a[q][name] - b[q][name] for q in shared if not math.isnan(a[q][name] - b[q][name])]
        up, down = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        change = sum(diffs) / len(diffs) if diffs else math.nan
        metrics[name] = {"change": change, "up": up, "down": down, "p_value": sign_test_p_value(up, down)}
    return {"num_questions": len(shared), "alpha": ALPHA, "metrics": metrics}


def compare_eval_folders(before_dir: str | Path, after_dir: str | Path, check: AnswerCheck) -> dict | None:
    """``compare`` (maj@k judged by ``check``) of the ``results.jsonl`` in two evaluation folders; None when
    either file is absent."""
    files = [Path(before_dir) / "results.jsonl", Path(after_dir) / "results.jsonl"]
    if not all(f.is_file() for f in files):
        return None
    before, after = ([json.loads(line) for line in f.read_text().splitlines() if line] for f in files)
    return compare(before, after, check)
