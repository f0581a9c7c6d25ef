"""A run's own results re-score to what the run reported (issue 27, item 9): results.jsonl stores the response
prefix its completions continue, and ``grpax evaluate completions_path=`` prepends it again."""

from __future__ import annotations

import dataclasses
import json

import pytest

from grpax.cli.main import main
from grpax.config import build_config
from grpax.eval.metrics import summarize
from grpax.rl.train_config import TrainConfig
from grpax.tasks import build_task


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_rescoring_a_runs_results_gives_what_the_run_reported(tmp_path, capsys):
    task = build_task(build_config(TrainConfig, ["load_parameters_path=/x", "model_name="]))
    task.preset = dataclasses.replace(task.preset, response_prefix="<reasoning>")
    rows = [{"question": "1 + 1?", "answer": "#### 2", "gold": "2"}] * 2
    records = task.records(rows, ["one and one</reasoning>\n<answer>2</answer>", "no idea"])
    reported = summarize(records, 2, task.is_correct)
    assert reported["format_accuracy"] == 0.5  # the layout needs the prefix's <reasoning>
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "rescored"
    assert main(["evaluate", f"completions_path={path}", "num_eval_passes=2", f"output_path={out}"]) == 0
    rescored = json.loads((out / "summary.json").read_text())
    for key in ("accuracy", "format_accuracy", "mean_reward"):
        assert rescored[key] == reported[key], key  # before: format_accuracy 0.0, a lower mean reward
