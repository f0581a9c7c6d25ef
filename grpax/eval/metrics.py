"""Evaluation metrics for sampled completions of any task, with 95% confidence intervals (pure numpy).

Inputs are grouped per question: ``k`` sampled completions for each of ``Q`` questions. Proportions
(accuracy, partial accuracy, format accuracy) use the Wilson score interval (Wilson 1927), which stays inside
[0, 1] and behaves at 0% and 100%; the mean reward uses the normal approximation mean +- 1.96 * std / sqrt(N).
``pass@k`` is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"), 1 - C(n - c, k) / C(n, k) per question; ``maj@k`` is the majority vote over the extracted answers.
Both are averaged over questions, and their interval is the Wilson interval of that mean with N = Q.

What counts as correct, close and formatted is the task's (``Task.records``, ``grpax.tasks``); ``summarize`` reads
those records and takes the task's answer check (``Task.is_correct``) for maj@k, so these statistics know no task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from grpax.tasks.answers import normalize_number

Z_95 = 1.959963984540054
# MaxText rl.yml's eval_mode: which metric is the evaluation's score (its evaluate_rl.score_responses)
EVAL_MODES = {"pass": "pass@k", "maj": "maj@k", "pass_at_1": "accuracy"}


@dataclass(frozen=True)
class Estimate:
    """A metric value with its sample size and 95% confidence interval.

    Attributes:
        value: the point estimate.
        n: the number of samples it averages (completions, or questions for pass@k / maj@k).
        ci95: (low, high) bounds of the 95% interval.
    """

    value: float
    n: int
    ci95: tuple[float, float]


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a proportion.

    Args:
        successes: number of successes (may be fractional, e.g. a sum of pass@k estimates).
        n: number of trials.
        z: normal quantile (1.96 for 95%).

    Returns:
        (low, high); (nan, nan) if n == 0.

    Example:
        >>> [round(x, 4) for x in wilson_interval(3, 4)]
        [0.3006, 0.9544]
    """
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At p = 0 or 1 the exact bound is 0 or 1; rounding would otherwise give 0.9999999999999999.
    lo = 0.0 if successes <= 0 else max(0.0, center - half)
    hi = 1.0 if successes >= n else min(1.0, center + half)
    return (lo, hi)


def _flat(values: Sequence[Sequence]) -> list:
    return [v for group in values for v in group]


def proportion(flags: Sequence[Sequence[bool]]) -> Estimate:
    """Fraction of all completions whose flag is set: accuracy, partial accuracy or format accuracy.

    Args:
        flags: per question, per sample flags [Q][k] (correct, within 10% of gold, exact layout).

    Returns:
        Estimate with n = number of completions and a Wilson interval.

    Example:
        >>> proportion([[True, False], [True, True]]).value
        0.75
    """
    flat = _flat(flags)
    n = len(flat)
    s = float(sum(bool(f) for f in flat))
    return Estimate(s / n if n else math.nan, n, wilson_interval(s, n))


def total_reward(record: dict) -> float:
    """A scored record's total reward in points: its ``rewards["total"]``, else the sum of its non-NaN rewards;
    NaN when every function abstained."""
    rewards = record.get("rewards") or {}
    if "total" in rewards:
        return float(rewards["total"])
    values = [float(v) for v in rewards.values() if not math.isnan(float(v))]
    return sum(values) if values else math.nan


def mean_reward(rewards: Sequence[Sequence[float]]) -> Estimate:
    """Mean total reward over completions, NaN (abstained) values skipped.

    Args:
        rewards: per question, per sample total reward [Q][k], in points.

    Returns:
        Estimate with n = number of non-NaN values and interval mean +- 1.96 * std / sqrt(n) (std with
        ddof=1; zero width when n == 1), clipped to the range of the values seen: on a few samples of a bounded
        reward (0 / 1 points) the normal interval would run past the possible range (-0.07 .. 1.07).

    Example:
        >>> mean_reward([[1.0, 3.0], [2.0, float("nan")]]).value
        2.0
    """
    x = np.asarray(_flat(rewards), dtype=np.float64)
    x = x[~np.isnan(x)]
    n = int(x.size)
    if n == 0:
        return Estimate(math.nan, 0, (math.nan, math.nan))
    mean = float(x.mean())
    half = Z_95 * float(x.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return Estimate(mean, n, (max(mean - half, float(x.min())), min(mean + half, float(x.max()))))


def pass_at_k_unbiased(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question: 1 - C(n - c, k) / C(n, k).

    Args:
        n: samples drawn.
        c: correct samples among them.
        k: the k in pass@k (k <= n).

    Returns:
        The probability that at least one of k samples drawn without replacement is correct.

    Raises:
        ValueError: if k > n or c > n.

    Example:
        >>> pass_at_k_unbiased(n=4, c=1, k=2)
        0.5
    """
    if k > n or c > n or k < 1:
        raise ValueError(f"need 1 <= k <= n and c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k(correct: Sequence[Sequence[bool]], k: int | None = None) -> Estimate:
    """Mean unbiased pass@k over questions.

    Args:
        correct: per question, per sample correctness [Q][n].
        k: the k in pass@k; defaults to the samples per question (then it is "any sample correct").

    Returns:
        Estimate with n = number of questions and a Wilson interval.

    Raises:
        ValueError: if a question has fewer than k samples.

    Example:
        >>> pass_at_k([[True, False], [False, False]]).value
        0.5
    """
    values = [pass_at_k_unbiased(len(g), sum(bool(x) for x in g), k or len(g)) for g in correct]
    q = len(values)
    s = float(sum(values))
    return Estimate(s / q if q else math.nan, q, wilson_interval(s, q))


def _vote_key(answer: str) -> str:
    value = normalize_number(answer)
    return answer.strip() if value is None else repr(round(value, 6))


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent answer; numbers vote together by value; ties go to the first seen.

    Args:
        answers: extracted answers of one question's samples (None = no answer, no vote).

    Returns:
        The first-seen spelling of the winning answer, or None if nobody answered.

    Example:
        >>> majority_answer(["18", None, "$18.00", "20", "20"])
        '18'
    """
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for a in answers:
        if a is None:
            continue
        key = _vote_key(a)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, a)
    if not counts:
        return None
    best = max(counts.values())
    winner = next(k for k in first if counts[k] == best)  # dicts keep first-seen order
    return first[winner]


def maj_at_k(
    answers: Sequence[Sequence[str | None]],
    golds: Sequence[str],
    k: int | None = None,
    *,
    check: Callable[[str | None, str], bool],
) -> Estimate:
    """Fraction of questions whose majority answer over the first k samples is correct.

    Args:
        answers: per question, per sample extracted answers [Q][n] (None = no answer).
        golds: gold answers [Q].
        k: samples used per question; defaults to all.
        check: whether the majority answer equals the gold one, ``check(answer, gold)`` (the task's ``is_correct``).

    Returns:
        Estimate with n = number of questions and a Wilson interval.

    Raises:
        ValueError: if answers and golds differ in length.

    Example:
        >>> same = lambda answer, gold: answer == gold
        >>> maj_at_k([["3", "4", "4"], ["1", "2", None]], ["4", "2"], check=same).value  # the 1-vs-2 tie goes to "1"
        0.5
    """
    if len(answers) != len(golds):
        raise ValueError(f"answers ({len(answers)}) and golds ({len(golds)}) must have the same length")
    flags = [check(majority_answer(list(a)[: k or len(a)]), g) for a, g in zip(answers, golds, strict=True)]
    q = len(flags)
    s = float(sum(flags))
    return Estimate(s / q if q else math.nan, q, wilson_interval(s, q))


def summarize(
    records: Sequence[dict],
    num_samples: int,
    check: Callable[[str | None, str], bool],
    eval_mode: str = "pass",
) -> dict[str, float | int | str | list[float]]:
    """Summary metrics of scored records, ``num_samples`` consecutive records per question.

    Args:
        records: from ``Task.records`` (or dicts with ``question``, ``answer``, ``extracted_answer``, ``correct``,
            ``close``, ``formatted`` and ``rewards``; ``rewards["total"]`` is the mean reward's value when present).
        num_samples: completions per question (the k of pass@k and maj@k).
        check: maj@k's answer check, ``check(answer, gold)`` (the task's ``is_correct``).
        eval_mode: which metric is the ``score`` (MaxText's key, ``EVAL_MODES``): ``pass`` = pass@k (a question
            scores when any of its samples is correct), ``maj`` = maj@k (its majority answer is), ``pass_at_1`` =
            accuracy (the fraction of its samples that are, averaged).

    Returns:
        ``num_questions``, ``num_completions``, ``accuracy``, ``partial_accuracy``, ``format_accuracy``,
        ``mean_reward``, ``pass@k``, ``maj@k``, ``score`` (one of them, as ``eval_mode`` names it; ``eval_mode``
        is in the dict too) and for each metric ``<name>_ci95`` = [low, high].

    Raises:
        ValueError: if the record count is not a multiple of num_samples, or a group mixes questions.

    Example:
        >>> recs = [{"question": "q", "answer": "4", "extracted_answer": a, "correct": a == "4", "close": a == "4",
        ...          "formatted": True, "rewards": {"total": float(a == "4")}} for a in ("4", "5")]
        >>> s = summarize(recs, num_samples=2, check=lambda answer, gold: answer == gold)
        >>> s["accuracy"], s["pass@k"], s["maj@k"], s["score"]
        (0.5, 1.0, 1.0, 1.0)
    """
    if num_samples < 1 or len(records) % num_samples:
        raise ValueError(f"{len(records)} records do not split into groups of num_samples={num_samples}")
    groups = [list(records[i : i + num_samples]) for i in range(0, len(records), num_samples)]
    for g in groups:
        if len({r["question"] for r in g}) != 1:
            raise ValueError(
                f"records for one question must be consecutive: a group of {num_samples} mixes questions "
                f"(first: {g[0]['question'][:60]!r})"
            )

    metrics = {
        "accuracy": proportion([[bool(r["correct"]) for r in g] for g in groups]),
        "partial_accuracy": proportion([[bool(r["close"]) for r in g] for g in groups]),
        "format_accuracy": proportion([[bool(r["formatted"]) for r in g] for g in groups]),
        "mean_reward": mean_reward([[total_reward(r) for r in g] for g in groups]),
        "pass@k": pass_at_k([[bool(r["correct"]) for r in g] for g in groups], num_samples),
        "maj@k": maj_at_k(
            [[r["extracted_answer"] for r in g] for g in groups],
            [g[0]["answer"] for g in groups],
            check=check,
        ),
    }
    summary: dict[str, float | int | list[float]] = {
        "num_questions": len(groups),
        "num_completions": len(records),
    }
    for name, est in metrics.items():
        summary[name] = est.value
        summary[f"{name}_ci95"] = [est.ci95[0], est.ci95[1]]
    summary["eval_mode"] = eval_mode
    summary["score"], summary["score_ci95"] = (
        summary[EVAL_MODES[eval_mode]],
        summary[f"{EVAL_MODES[eval_mode]}_ci95"],
    )
    return summary


__all__ = [
    "EVAL_MODES",
    "Estimate",
    "maj_at_k",
    "majority_answer",
    "mean_reward",
    "proportion",
    "pass_at_k",
    "pass_at_k_unbiased",
    "summarize",
    "wilson_interval",
]
