"""Smaller careless-user cases (issue 27, item 11): files named in their errors, a UTF-8 BOM read, the steps
that exist listed, and a resume that changes the learning-rate schedule said out loud."""

from __future__ import annotations

import logging
import shutil

import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import load_model
from grpax.data.datasets import read_rows
from grpax.data.tokenizer import load_tokenizer
from grpax.rl import resume
from grpax.rl.train_config import TrainConfig


def test_a_damaged_tokenizer_json_is_named(tiny_checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint.parents[1], folder)
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{folder / 'tokenizer.json'} .*cannot be read .*copy the model's"):
        load_tokenizer(folder)


def test_a_bom_file_reads_and_a_non_utf8_line_is_numbered(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "q", "answer": "1"}\n')
    assert read_rows(str(path), "train")[0] == [{"question": "q", "answer": "1"}]
    path.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl: line 2 is not UTF-8 \(byte 18 is b'\\xe9'\)"):
        read_rows(str(path), "train")


def test_a_missing_actor_step_lists_the_steps_that_exist(tmp_path):
    actor = tmp_path / "run" / "checkpoints" / "actor"
    for step in (2, 4):
        (actor / str(step) / "model_params").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError, match=rf"{actor / '7' / 'model_params'} does not exist \(.* holds steps 2, 4\)"
    ):
        load_model(actor / "7" / "model_params")


def test_a_resume_that_rebuilds_the_schedule_says_the_learning_rate_jumps(tmp_path, caplog):
    def config(**keys):
        return TrainConfig(**tiny_run_keys(tmp_path / "ckpt", tmp_path / "out", dataset_name="d", **keys))

    cfg = config(num_batches=10, warmup_ratio=0.0)
    paths = resume.RunPaths.of(cfg)
    paths.run_dir.mkdir(parents=True)
    resume.write_config(paths, cfg)
    with caplog.at_level(logging.WARNING, logger="grpax.train"):
        resume.check_resume(config(num_batches=10, warmup_ratio=0.0, eval_batch_size=4), paths, latest=5)
        assert "learning rate jumps" not in caplog.text  # the schedule is the same
        resume.check_resume(config(num_batches=20, warmup_ratio=0.0), paths, latest=5)
    assert "resuming at step 5 with changed num_batches (10 -> 20)" in caplog.text
    assert "the learning rate jumps from 0.0005 (the saved run's schedule) to 0.000854" in caplog.text


def test_the_mean_reward_interval_stays_within_the_values_seen():
    from grpax.eval.metrics import mean_reward

    est = mean_reward([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]])
    assert 0.0 <= est.ci95[0] < est.value < est.ci95[1] == 1.0  # before: 0.62 .. 1.13


def test_to_huggingface_of_a_missing_step_lists_the_steps_that_exist(tmp_path):
    from grpax.checkpoint.convert import to_huggingface

    actor = tmp_path / "run" / "checkpoints" / "actor"
    (actor / "3" / "model_params").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError, match=r"actor/7/model_params does not exist \(.*actor holds steps 3\)"
    ):
        to_huggingface(actor / "7" / "model_params", tmp_path / "hf", progress=False)


def test_rows_that_do_not_divide_the_data_axes_warn_with_the_fix(caplog):
    from grpax.models.sharding_rules import LOGICAL_AXIS_RULES, logical_to_spec

    with caplog.at_level(logging.WARNING):
        spec = logical_to_spec(
            ("batch", None), LOGICAL_AXIS_RULES, shape=(6, 4), mesh_shape={"data": 4}, name="batch"
        )
    assert tuple(spec) == ()  # replicated
    assert (
        "make the rows (batch_size x num_generations, or eval_batch_size x num_eval_passes) a multiple of 4"
        in (caplog.text)
    )
