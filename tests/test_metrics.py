"""Evaluation metrics against hand-computed values on a small hand-made predictions list."""

import json
import math

import pytest

from grpax.data.prompts import PromptPreset
from grpax.eval.metrics import (
    maj_at_k,
    majority_answer,
    mean_reward,
    pass_at_k,
    pass_at_k_unbiased,
    proportion,
    summarize,
    wilson_interval,
)
from grpax.tasks.answers import is_correct
from grpax.tasks.gsm8k import GSM8KTask, load_completions_file
from grpax.tasks.gsm8k_rewards import get_reward_config

# 3 questions x 4 samples: the extracted answers (None = no answer) and gold answers.
GOLDS = ["18", "5", "100"]
ANSWERS = [
    ["18", "18.00", "20", None],  # 2 correct; 18 and 18.00 vote together
    ["4", "6", "6", "5"],  # 1 correct; majority 6 is wrong
    ["95", "90", None, None],  # 0 correct; both within 10%; the 95-vs-90 tie goes to 95
]
CORRECT = [[True, True, False, False], [False, False, False, True], [False, False, False, False]]
CLOSE = [[True, True, False, False], [False, False, False, True], [True, True, False, False]]


def test_wilson_interval_hand_computed():
    # p = 0.25, n = 12: center 0.310624, half-width 0.221684.
    lo, hi = wilson_interval(3, 12)
    assert (lo, hi) == pytest.approx((0.088942, 0.532305), abs=1e-5)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 10)[1] == pytest.approx(0.277532, abs=1e-5)  # 3.8415 / 13.8415
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_accuracy_partial_and_format():
    acc = proportion(CORRECT)
    assert (acc.value, acc.n) == (0.25, 12)
    assert acc.ci95 == pytest.approx((0.088942, 0.532305), abs=1e-5)
    part = proportion(CLOSE)
    assert (part.value, part.n) == (pytest.approx(5 / 12), 12)
    fmt = proportion([[True, False], [False, False]])
    assert (fmt.value, fmt.n) == (0.25, 4)


def test_pass_at_k_hand_computed():
    assert pass_at_k_unbiased(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k_unbiased(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k_unbiased(4, 0, 2) == 0.0
    assert pass_at_k_unbiased(4, 3, 2) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k_unbiased(2, 1, 3)

    p4 = pass_at_k(CORRECT)  # k = n = 4: any sample correct -> 1, 1, 0
    assert (p4.value, p4.n) == (pytest.approx(2 / 3), 3)
    assert pass_at_k(CORRECT, 2).value == pytest.approx((5 / 6 + 0.5 + 0) / 3)  # 4/9
    assert pass_at_k(CORRECT, 1).value == pytest.approx(proportion(CORRECT).value)  # pass@1 = accuracy


def test_maj_at_k_hand_computed():
    assert majority_answer(ANSWERS[0]) == "18"
    assert majority_answer(ANSWERS[1]) == "6"
    assert majority_answer(ANSWERS[2]) == "95"
    assert majority_answer(["90", "95"]) == "90"  # ties: first seen
    assert majority_answer([None, None]) is None
    assert majority_answer(["$1,000", "1000", "999"]) == "$1,000"

    maj = maj_at_k(ANSWERS, GOLDS, check=is_correct)
    assert (maj.value, maj.n) == (pytest.approx(1 / 3), 3)
    # With only the first 2 samples, question 2 votes 4 vs 6 -> 4 (wrong), question 3 95 vs 90 -> 95.
    assert maj_at_k(ANSWERS, GOLDS, k=2, check=is_correct).value == pytest.approx(1 / 3)
    assert maj_at_k([["5", "4", "4"]], ["5"], k=1, check=is_correct).value == 1.0
    with pytest.raises(ValueError, match="same length"):
        maj_at_k(ANSWERS, GOLDS[:2], check=is_correct)


def test_mean_reward_normal_interval():
    est = mean_reward([[1.0, 2.0], [3.0, 4.0, float("nan")]])
    # std (ddof=1) = sqrt(5/3) = 1.290994; half-width = 1.959964 * 1.290994 / 2 = 1.265148.
    assert (est.value, est.n) == (2.5, 4)
    assert est.ci95 == pytest.approx((1.234852, 3.765148), abs=1e-5)
    single = mean_reward([[7.0]])
    assert (single.value, single.ci95) == (7.0, (7.0, 7.0))
    assert math.isnan(mean_reward([[float("nan")]]).value)


def completion_for(answer):
    return "I give up." if answer is None else f"<reasoning>work</reasoning>\n<answer>{answer}</answer>"


def gsm8k_records(questions, golds, completions, reward_preset, response_prefix=""):
    """GSM8K's scored records (``Task.records``) of aligned questions, gold answers and completions."""
    task = GSM8KTask(PromptPreset("", response_prefix=response_prefix), get_reward_config(reward_preset))
    return task.records(
        [{"question": q, "gold": g} for q, g in zip(questions, golds, strict=True)], completions
    )


def test_gsm8k_records_and_summarize():
    questions = [f"question {q}" for q in range(3) for _ in range(4)]
    golds = [GOLDS[q] for q in range(3) for _ in range(4)]
    completions = [completion_for(a) for group in ANSWERS for a in group]
    records = gsm8k_records(questions, golds, completions, "simple")

    assert [r["correct"] for r in records] == [c for g in CORRECT for c in g]
    assert [r["extracted_answer"] for r in records[:4]] == ["18", "18.00", "20", None]
    assert records[0]["rewards"] == {"answer_correct": 1.0, "format_exact": 0.1, "total": pytest.approx(1.1)}

    s = summarize(records, num_samples=4, check=is_correct)
    assert set(s) == {
        "num_questions",
        "num_completions",
        "accuracy",
        "partial_accuracy",
        "format_accuracy",
        "mean_reward",
        "pass@k",
        "maj@k",
        "accuracy_ci95",
        "partial_accuracy_ci95",
        "format_accuracy_ci95",
        "mean_reward_ci95",
        "pass@k_ci95",
        "maj@k_ci95",
        "eval_mode",
        "score",
        "score_ci95",
    }
    assert (s["num_questions"], s["num_completions"]) == (3, 12)
    assert s["accuracy"] == 0.25
    assert s["accuracy_ci95"] == pytest.approx([0.088942, 0.532305], abs=1e-5)
    assert s["partial_accuracy"] == pytest.approx(5 / 12)
    assert s["format_accuracy"] == pytest.approx(9 / 12)
    # Totals: q1 1.1 1.1 0.1 0 | q2 0.1 0.1 0.1 1.1 | q3 0.1 0.1 0 0 -> 3.9 / 12.
    assert s["mean_reward"] == pytest.approx(0.325)
    assert s["pass@k"] == pytest.approx(2 / 3)
    assert s["maj@k"] == pytest.approx(1 / 3)
    # eval_mode (MaxText's): the score is pass@k (the default), maj@k or the fraction correct, with its interval
    for mode, value, metric in (
        ("pass", 2 / 3, "pass@k"),
        ("maj", 1 / 3, "maj@k"),
        ("pass_at_1", 0.25, "accuracy"),
    ):
        s = summarize(records, num_samples=4, check=is_correct, eval_mode=mode)
        assert (s["eval_mode"], s["score"], s["score_ci95"]) == (
            mode,
            pytest.approx(value),
            s[f"{metric}_ci95"],
        )


def test_summarize_with_prefix_and_validation():
    records = gsm8k_records(
        ["q"], ["4"], ["2+2</reasoning><answer>4</answer>"], "tunix", response_prefix="<reasoning>"
    )
    assert records[0]["formatted"] and records[0]["correct"]
    assert records[0]["completion"] == "2+2</reasoning><answer>4</answer>"  # stored without the prefix
    assert summarize(records, 1, is_correct)["format_accuracy"] == 1.0
    with pytest.raises(ValueError, match="groups of num_samples=2"):
        summarize(records, 2, is_correct)
    mixed = gsm8k_records(["a", "b"], ["1", "1"], ["1", "1"], "simple")
    with pytest.raises(ValueError, match="consecutive"):
        summarize(mixed, 2, is_correct)


def test_load_completions_file(tmp_path):
    path = tmp_path / "vllm.jsonl"
    lines = [
        {
            "question": "q1",
            "answer": "He pays 2 * 500 = 1,000.\n#### 1,000",
            "completion": "<answer>1000</answer>",
        },
        {"question": "q2", "answer": "72", "completion": "72"},
        {"question": "q3", "answer": 5, "completion": ""},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    rows = load_completions_file(path)
    assert [r["answer"] for r in rows] == ["1000", "72", "5"]
    assert rows[0] == {"question": "q1", "answer": "1000", "completion": "<answer>1000</answer>"}

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 1 lacks field\(s\) \['completion'\]"):
        load_completions_file(bad)
    bad.write_text(json.dumps({"question": "q", "answer": "many", "completion": ""}) + "\n")
    with pytest.raises(ValueError, match="#### N"):
        load_completions_file(bad)
    with pytest.raises(FileNotFoundError):
        load_completions_file(tmp_path / "missing.jsonl")
    bad.write_text("5\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 1 is a JSON int, not an object"):
        load_completions_file(bad)
    bad.write_text("\n\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl holds no completions"):
        load_completions_file(bad)


def test_tensorboard_tags_are_cleaned_without_messages(tmp_path, caplog):
    from grpax.rl.metrics_writer import MetricsWriter, tensorboard_tag

    assert tensorboard_tag("eval/pass@k") == "eval/pass_k"
    assert tensorboard_tag("rewards/total/mean") == "rewards/total/mean"
    writer = MetricsWriter(tmp_path, enabled=True)
    with caplog.at_level("INFO"):  # tensorboardX reports a renamed tag at INFO
        writer.write(1, {"pass@k": 0.5, "maj@k": 0.25}, prefix="eval/")
    writer.close()
    assert not [r for r in caplog.records if "illegal" in r.getMessage()]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["eval/pass@k"] == 0.5


def _writer_with_lines(tmp_path, tail: str):
    from grpax.rl.metrics_writer import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": 0.5})
    writer.write(2, {"loss": 0.25})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(tail)
    return writer


def test_metrics_cut_off_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    writer = _writer_with_lines(tmp_path, '{"step": 3, "loss": 0.1')  # killed mid-append
    with caplog.at_level("WARNING"):
        assert [r["step"] for r in writer.records()] == [1, 2]
    assert any(f"{tmp_path / 'metrics.jsonl'} line 3 is cut off" in r.getMessage() for r in caplog.records)
    writer.truncate_after(2)  # the resume's bookkeeping removes the cut-off text, so the next line is whole
    writer.write(3, {"loss": 0.125})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


def test_metrics_damaged_line_in_the_middle_is_one_line_error(tmp_path):
    from grpax.config import ConfigError

    writer = _writer_with_lines(tmp_path, '{"step": 3, "lo\n{"step": 4}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl line 3 is not valid JSON .*delete that line") as e:
        writer.truncate_after(2)
    assert "\n" not in str(e.value)
    writer.close()


def test_metrics_lines_are_appended_whole_and_synced(tmp_path, monkeypatch):
    from grpax.rl import metrics_writer

    writes, syncs = [], []
    real_write, real_fsync = metrics_writer.os.write, metrics_writer.os.fsync

    def ours(fd):  # TensorBoard writes its event files through os too
        return metrics_writer.os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl")

    monkeypatch.setattr(
        metrics_writer.os, "write", lambda fd, b: (ours(fd) and writes.append(b)) or real_write(fd, b)
    )
    monkeypatch.setattr(
        metrics_writer.os, "fsync", lambda fd: (ours(fd) and syncs.append(fd)) or real_fsync(fd)
    )
    writer = metrics_writer.MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": 0.5, "kl": 0.01})
    writer.close()
    assert writes == [(tmp_path / "metrics.jsonl").read_bytes()] and len(syncs) == 1


def test_metrics_truncate_replaces_the_file_atomically(tmp_path, monkeypatch):
    from grpax.rl import metrics_writer

    writer = _writer_with_lines(tmp_path, "")
    before = (tmp_path / "metrics.jsonl").read_text()

    def killed(src, dst):
        raise KeyboardInterrupt  # a kill before the rename: the old file must still be whole

    monkeypatch.setattr(metrics_writer.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        writer.truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    monkeypatch.undo()
    writer.truncate_after(1)
    writer.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
