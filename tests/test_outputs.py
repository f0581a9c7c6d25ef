"""No silent overwrite (issue 27, item 3): ``evaluate`` and ``generate`` refuse an existing output unless
``overwrite=true`` (before any model loads), and write each file atomically."""

from __future__ import annotations

import json
import os

import pytest

from grpax.cli.main import main
from grpax.files import write_text_atomic


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _completions(tmp_path):
    path = tmp_path / "completions.jsonl"
    records = [{"question": "q1", "answer": "#### 3", "completion": "<answer>3</answer>"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_evaluate_refuses_to_replace_a_runs_results_unless_asked(tmp_path, capsys):
    out = tmp_path / "run" / "eval" / "after"
    out.mkdir(parents=True)
    (out / "results.jsonl").write_text("the run's own results\n")
    args = [
        "evaluate",
        f"completions_path={_completions(tmp_path)}",
        "num_eval_passes=1",
        f"output_path={out}",
    ]
    assert main(args) == 2
    err = _one_line(capsys)
    assert f"{out / 'results.jsonl'} already exists" in err and "overwrite=true" in err, err
    assert (out / "results.jsonl").read_text() == "the run's own results\n"
    assert main([*args, "overwrite=true"]) == 0
    assert json.loads((out / "results.jsonl").read_text().splitlines()[0])["correct"] is True
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl", "summary.json"]  # no temporary left


def test_generate_refuses_an_existing_file_before_loading_a_model(tmp_path, capsys):
    target = tmp_path / "metrics.jsonl"
    target.write_text('{"step": 1}\n')
    args = ["generate", f"load_parameters_path={tmp_path}/no_model", "prompt=hi", f"output_path={target}"]
    assert main(args) == 2
    err = _one_line(capsys)
    assert f"output_path={str(target)!r}: {target} already exists" in err, err
    assert target.read_text() == '{"step": 1}\n'


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(target, "new\n" * 1000)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]
