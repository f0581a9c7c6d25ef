"""Input that used to be accepted silently (issue 27, items 8 and 10): YAML nulls, booleans and duplicate keys,
run names that leave base_output_directory, GSM8K rows without a usable question or gold answer; and a GSM8K
dataset's own columns reaching the user's reward functions by name."""

from __future__ import annotations

import json

import pytest

from grpax.config import ConfigError, build_config
from grpax.rl.train_config import TrainConfig, validate
from grpax.tasks import build_task

KEYS = ["load_parameters_path=/some/ckpt", "model_name="]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "model_name: null\n",
            r"model_name: None \(YAML reads null as no value\): .* model_name: '' for none",
        ),
        (
            "run_name: no\n",
            r"run_name: False \(YAML reads false as a boolean\): quote a text value \(run_name: 'no'\)",
        ),
        ("num_batches: 2\nbeta: 0\nnum_batches: 3\n", r"key 'num_batches' is given twice \(lines 1 and 3\)"),
        ("run_name: [a, b]\n", r"run_name: \['a', 'b'\] is a YAML list: expected one text value"),
    ],
)
def test_yaml_nulls_booleans_and_duplicate_keys_are_refused(tmp_path, text, message):
    path = tmp_path / "run.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        build_config(TrainConfig, [str(path), "load_parameters_path=/some/ckpt"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "a/b", ".."])
def test_a_run_name_that_leaves_base_output_directory_is_refused(name):
    with pytest.raises(
        ConfigError, match=r"run_name=.*: expected one folder name inside base_output_directory"
    ):
        validate(build_config(TrainConfig, [*KEYS, f"run_name={name}"]))


def _gsm8k(tmp_path, rows):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_task(build_config(TrainConfig, KEYS))


GOOD = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"question": None}, r"row 2 has no value in column 'question'"),
        (
            {"question": {"text": "hi"}},
            r"row 2 column 'question' \(prompt_field\) holds .*not the question's text",
        ),
        ({"answer": float("nan")}, r"row 2 has no value in column 'answer'"),
        (
            {"answer": "So it is\n#### Infinity"},
            r"row 2 column 'answer' \(answer_field\) ends in 'Infinity', not a finite",
        ),
        ({"answer": "So it is\n#### "}, r"row 2 column 'answer' \(answer_field\) ends in '', not a finite"),
        ({"answer": "NaN"}, r"ends in 'NaN', not a finite"),
    ],
)
def test_gsm8k_rows_without_a_usable_question_or_gold_answer_are_named(tmp_path, bad, message):
    task = _gsm8k(tmp_path, [GOOD, {**GOOD, **bad}])
    with pytest.raises(ValueError, match=message):
        task.load_rows(str(tmp_path), "train")


def test_a_gsm8k_datasets_own_columns_reach_the_reward_functions_by_name(tmp_path):
    rewards = tmp_path / "r.py"
    rewards.write_text(
        "def exact(prompts, completions, target, answer, **kwargs):\n"
        "    return [float(c.strip().endswith(t) and t == a) for c, t, a in zip(completions, target, answer)]\n"
    )
    (tmp_path / "train.jsonl").write_text(json.dumps({"problem": "1 + 1?", "target": "2"}) + "\n")
    keys = [*KEYS, "prompt_field=problem", "answer_field=target", f"reward_functions_path={rewards}"]
    task = build_task(build_config(TrainConfig, [*keys, "reward_functions=[exact]"]))
    rows = task.load_rows(str(tmp_path), "train")
    assert task.score(rows * 2, ["2", "3"])["exact"] == [1.0, 0.0]  # before: KeyError 'target'
