"""The paired before/after test and the before/after table, against hand-computed values."""

import json
import math

import pytest

from grpax.eval.compare import (
    PAIRED_METRICS,
    compare,
    compare_eval_folders,
    question_values,
    sign_test_p_value,
)
from grpax.rl.results import format_before_after, publish
from grpax.tasks.answers import is_correct
from grpax.tasks.base import UserRewards
from grpax.tasks.custom import CustomTask
from grpax.tasks.math import MathTask
from grpax.tasks.prompts import get_prompt_preset


def _record(question: str, answer: str, extracted: str | None, formatted: bool = False) -> dict:
    return {
        "question": question,
        "answer": answer,
        "completion": "...",
        "extracted_answer": extracted,
        "correct": extracted == answer,
        "close": extracted == answer,
        "formatted": formatted,
    }


@pytest.mark.parametrize(
    "up, down, p",
    [
        (4, 1, 2 * (1 + 5) / 2**5),  # 0.375
        (9, 1, 2 * (1 + 10) / 2**10),  # 0.021484375
        (8, 0, 2 / 2**8),  # 0.0078125
        (3, 3, 1.0),  # 2 * 42 / 64 > 1: capped
        (0, 0, 1.0),  # nothing changed
    ],
)
def test_sign_test_p_value(up, down, p):
    assert sign_test_p_value(up, down) == pytest.approx(p, rel=1e-12)
    assert sign_test_p_value(down, up) == pytest.approx(p, rel=1e-12)  # two-sided


def test_question_values_with_two_samples():
    records = [_record("q", "4", "4", formatted=True), _record("q", "4", "5")]
    values = question_values(records, is_correct)["q"]
    assert math.isnan(values.pop("mean_reward"))  # no rewards in these records: nothing to average
    # maj@k: the 4-vs-5 tie goes to the first seen, "4"
    assert values == {
        "accuracy": 0.5,
        "partial_accuracy": 0.5,
        "format_accuracy": 0.5,
        "pass@k": 1.0,
        "maj@k": 1.0,
    }


def test_compare_counts_the_questions_that_moved():
    # 10 questions: right before on q0 only, after on q0..q8; q0's layout is exact after, none before.
    before = [_record(f"q{i}", "1", "1" if i == 0 else "2") for i in range(10)]
    after = [_record(f"q{i}", "1", "1" if i < 9 else "2", formatted=i == 0) for i in range(10)]
    after.append(_record("only after", "1", "1"))  # not paired: left out
    result = compare(before, after, is_correct)
    assert result["num_questions"] == 10 and result["alpha"] == 0.05
    assert set(result["metrics"]) == set(PAIRED_METRICS)
    acc = result["metrics"]["accuracy"]
    assert (acc["up"], acc["down"], acc["change"]) == (8, 0, pytest.approx(0.8))
    assert acc["p_value"] == pytest.approx(2 / 2**8)
    fmt = result["metrics"]["format_accuracy"]
    assert (fmt["up"], fmt["down"], fmt["p_value"]) == (1, 0, 1.0)


def test_compare_eval_folders(tmp_path):
    for tag, extracted in (("before", "2"), ("after", "1")):
        (tmp_path / tag).mkdir()
        lines = [json.dumps(_record(f"q{i}", "1", extracted)) for i in range(3)]
        (tmp_path / tag / "results.jsonl").write_text("\n".join(lines) + "\n")
    result = compare_eval_folders(tmp_path / "before", tmp_path / "after", is_correct)
    assert result["metrics"]["accuracy"]["up"] == 3 and result["num_questions"] == 3
    assert compare_eval_folders(tmp_path / "before", tmp_path / "missing", is_correct) is None


def _paired_maj_at_k(tmp_path, task, rows, before, after) -> dict:
    """The paired maj@k that ``publish`` writes for a task's before/after completions of one question each."""
    for tag, completions in (("before", before), ("after", after)):
        records = task.records([r for r in rows for _ in range(3)], completions)
        (tmp_path / "eval" / tag).mkdir(parents=True)
        (tmp_path / "eval" / tag / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    results = {"before": {"accuracy": 0.0}, "after": {"accuracy": 0.0}}  # summaries: both evaluations ran
    publish(results, tmp_path, tmp_path / "eval", "", 1, task.is_correct)
    assert json.loads((tmp_path / "results.json").read_text())["paired"] == results["paired"]
    return results["paired"]["metrics"]["maj@k"]


def test_paired_maj_at_k_uses_the_math_tasks_check(tmp_path):
    # The majority answer after is \frac{1}{2}: math-verify equals it to the gold 0.5, GSM8K's check does not.
    task = MathTask(get_prompt_preset("math"))
    rows = task.rows_from([{"problem": "Half of 1?", "answer": "0.5"}], "test")
    before = [r"\boxed{3}", r"\boxed{3}", r"\boxed{\frac{1}{2}}"]
    after = [r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}", r"\boxed{3}"]
    assert not is_correct(r"\frac{1}{2}", "0.5") and task.is_correct(r"\frac{1}{2}", "0.5")
    maj = _paired_maj_at_k(tmp_path, task, rows, before, after)
    assert (maj["up"], maj["down"], maj["change"]) == (1, 0, 1.0)


def test_paired_maj_at_k_uses_the_custom_tasks_check(tmp_path):
    # The majority answer before is "$1,000": GSM8K's check equals it to 1000 by value, the custom task's
    # check (the answer column, spelled the same) does not; after, "1000" is right for both.
    rewards = UserRewards({"any": lambda prompts, completions, **kw: [1.0] * len(completions)}, {"any": 1.0})
    task = CustomTask(get_prompt_preset("plain"), rewards)
    rows = task.rows_from([{"prompt": "Ten hundreds?", "answer": "1000"}], "test")
    tagged = "<answer>{}</answer>".format
    before = [tagged("$1,000"), tagged("$1,000"), tagged("7")]
    after = [tagged("1000"), tagged("1000"), tagged("7")]
    assert is_correct("$1,000", "1000") and not task.is_correct("$1,000", "1000")
    maj = _paired_maj_at_k(tmp_path, task, rows, before, after)
    assert (maj["up"], maj["down"], maj["change"]) == (1, 0, 1.0)


def _summary(accuracy, ci, reward, questions=32):
    summary = {"num_questions": questions}
    for name in ("accuracy", "partial_accuracy", "format_accuracy", "pass@k", "maj@k"):
        summary[name], summary[f"{name}_ci95"] = accuracy, ci
    summary["mean_reward"], summary["mean_reward_ci95"] = reward, [reward - 0.25, reward + 0.25]
    return summary


def test_format_before_after_with_intervals_and_the_paired_test():
    before = _summary(0.125, [0.0497, 0.2796], 0.35)
    after = _summary(0.5, [0.3363, 0.6637], 1.3)
    metrics = {name: {"change": 0.375, "up": 12, "down": 0, "p_value": 2 / 2**12} for name in PAIRED_METRICS}
    metrics["format_accuracy"] = {"change": 0.375, "up": 4, "down": 1, "p_value": 0.375}
    table = format_before_after(before, after, {"num_questions": 32, "alpha": 0.05, "metrics": metrics})
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "before", "after", "change", "paired", "p"]
    assert lines[1].split() == [
        "accuracy",
        "0.125",
        "[0.05,",
        "0.28]",
        "0.500",
        "[0.34,",
        "0.66]",
        "+0.375",
        "0.000488",
    ]
    assert lines[3].split()[-2:] == ["+0.375", "0.375"]  # format_accuracy
    assert lines[4].split() == [
        "mean_reward",
        "0.350",
        "[0.10,",
        "0.60]",
        "1.300",
        "[1.05,",
        "1.55]",
        "+0.950",
        "0.000488",  # the sign test on each question's mean reward
    ]
    assert lines[7].split() == ["questions", "32", "32"]
    assert lines[8] == (
        "change larger than the noise (exact sign test on the 32 paired questions, p < 0.05): accuracy, "
        "partial_accuracy, mean_reward, pass@k, maj@k; within the noise: format_accuracy"
    )


def test_format_before_after_without_evaluations():
    assert (
        format_before_after(None, None) == "evaluation skipped (num_test_batches=0): no before/after metrics"
    )
    only_after = format_before_after(None, _summary(0.5, [0.3363, 0.6637], 1.3)).splitlines()
    assert only_after[1].split() == ["accuracy", "-", "0.500", "[0.34,", "0.66]", "-", "-"]
    assert len(only_after) == 8  # no paired test without a "before"
    only_before = format_before_after(_summary(0.5, [0.3363, 0.6637], 1.3), None).splitlines()
    assert only_before[-1] == "evaluation after training skipped (num_test_batches=0)"


def test_paired_mean_reward_counts_questions_by_their_mean_points():
    """Per question, the mean total reward of its samples (abstentions skipped); the sign test on the changes."""

    def scored(question, *totals):
        return [dict(_record(question, "1", "2"), rewards={"total": t}) for t in totals]

    before = (
        scored("a", 0.0, 1.0) + scored("b", 0.5, 0.5) + scored("c", 2.0, 2.0) + scored("d", math.nan, 1.0)
    )
    after = (
        scored("a", 1.0, 2.0)
        + scored("b", 1.0, 1.0)
        + scored("c", 1.0, 2.0)
        + scored("d", math.nan, math.nan)
    )
    # a: 0.5 -> 1.5 (up), b: 0.5 -> 1.0 (up), c: 2.0 -> 1.5 (down), d: 1.0 -> every sample abstained (left out)
    result = compare(before, after, is_correct)["metrics"]["mean_reward"]
    assert (result["up"], result["down"]) == (2, 1)
    assert result["change"] == pytest.approx((1.0 + 0.5 - 0.5) / 3)
    assert result["p_value"] == pytest.approx(sign_test_p_value(2, 1)) and result["p_value"] == 1.0
    totals = compare(before, after, is_correct)["metrics"]
    assert totals["accuracy"]["change"] == 0.0  # the other metrics keep all four questions
