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


def test_eval_mode_picks_the_score_of_a_rescored_file(tmp_path):
    """MaxText's eval_mode on ``grpax evaluate``: pass (pass@k, the default), maj (maj@k) or pass_at_1 (the
    fraction correct) is the summary's score; the three differ on these completions."""
    task = build_task(build_config(TrainConfig, ["load_parameters_path=/x", "model_name="]))
    rows = [{"question": "1 + 1?", "answer": "#### 2", "gold": "2"}] * 3
    records = task.records(rows, ["<answer>2</answer>", "<answer>3</answer>", "<answer>3</answer>"])
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    scores = {}
    for mode in ("pass", "maj", "pass_at_1"):
        out = tmp_path / mode
        assert main(["evaluate", f"completions_path={path}", "num_eval_passes=3", f"eval_mode={mode}",
                     f"output_path={out}"]) == 0  # fmt: skip
        scores[mode] = json.loads((out / "summary.json").read_text())["score"]
    assert scores == {"pass": 1.0, "maj": 0.0, "pass_at_1": pytest.approx(1 / 3)}


def test_eval_mode_reaches_the_trainers_evaluation_and_its_log(tmp_path, monkeypatch, caplog):
    """train_rl passes eval_mode to its evaluations, logs their score and writes ``eval/score``."""
    import logging
    from types import SimpleNamespace

    from grpax.compiles import CompileLog
    from grpax.rl import trainer

    cfg = build_config(
        TrainConfig, ["load_parameters_path=/x", "model_name=", "eval_mode=maj", "num_eval_passes=3"]
    )
    task = build_task(cfg)
    rows = [{"question": "1 + 1?", "answer": "#### 2", "gold": "2"}] * 3
    records = task.records(rows, ["<answer>2</answer>", "<answer>3</answer>", "<answer>3</answer>"])
    seen, written = {}, {}

    def evaluate(*args, **kwargs):
        seen.update(kwargs)
        return summarize(records, kwargs["num_eval_passes"], task.is_correct, kwargs["eval_mode"])

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    writer = SimpleNamespace(write=lambda step, values, prefix: written.update(values))
    run = SimpleNamespace(
        cfg=cfg, mesh=None, model_cfg=None, tokenizer=None, eval_rows=rows[:1], task=task, eval_sampler_cfg=None,
        paths=SimpleNamespace(eval_dir=tmp_path), writer=writer, programs=CompileLog(),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="grpax.train"):
        summary = trainer._evaluate(run, None, "before", 0)
    assert (
        seen["eval_mode"] == "maj" and summary["score"] == written["score"] == 0.0
    )  # maj@k: "3" won the vote
    assert "score 0.000 (eval_mode=maj: maj@k), accuracy 0.333" in caplog.text
