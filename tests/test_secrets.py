"""Secrets stay secret (issue 27, item 6): the values of keys named like *token, *secret*, *password* never
appear in clear in what a command prints, logs or writes, whether it succeeds or fails."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from conftest import tiny_run_keys

from grpax.cli.main import main
from grpax.config import REDACTED, is_secret, redacted

TOKEN = "hf_SeCrEt123"


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_which_keys_are_secret():
    assert [
        k
        for k in ("hf_access_token", "token", "wandb_api_key", "db_password", "client_secret")
        if is_secret(k)
    ]
    assert not any(
        is_secret(k) for k in ("tokenizer_path", "tokenizer_type", "stop_token_ids", "num_eval_passes")
    )
    assert redacted(
        {"hf_access_token": TOKEN, "run_name": "x", "inner": {"password": "p"}, "api_key": ""}
    ) == {
        "hf_access_token": REDACTED,
        "run_name": "x",
        "inner": {"password": REDACTED},
        "api_key": "",  # unset stays visibly unset
    }


def _everything(capsys, caplog, folder) -> str:
    out = capsys.readouterr()
    files = [p.read_bytes().decode("utf-8", "replace") for p in folder.rglob("*") if p.is_file()]
    return "\n".join([out.out, out.err, caplog.text, *files])


def test_the_token_is_in_no_output_of_a_succeeding_or_a_failing_run(
    tiny_checkpoint, tmp_path, capsys, caplog
):
    caplog.set_level(logging.INFO)
    export = [
        "to_huggingface",
        f"load_parameters_path={tiny_checkpoint}",
        f"base_output_directory={tmp_path}/hf",
    ]
    assert main([*export, f"hf_access_token={TOKEN}"]) == 0
    keys = tiny_run_keys(tmp_path / "no_checkpoint", tmp_path / "runs", dataset_name=str(tmp_path / "none"))
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items()), f"hf_access_token={TOKEN}"]) == 2
    assert main(["to_native", f"hf_access_token={TOKEN}", "--help"]) == 0
    text = _everything(capsys, caplog, tmp_path)
    assert "hf_access_token=<redacted>" in text  # the note is still given, without the value
    assert TOKEN not in text


def test_config_json_holds_no_secret(tmp_path):
    from grpax.rl.resume import RunPaths, config_record, write_config
    from grpax.rl.train_config import TrainConfig

    @dataclasses.dataclass(frozen=True)
    class WithSecret(TrainConfig):
        wandb_api_key: str = ""

    cfg = WithSecret(**tiny_run_keys(tmp_path / "ckpt", tmp_path, dataset_name="d"), wandb_api_key=TOKEN)
    assert config_record(cfg)["wandb_api_key"] == REDACTED
    paths = RunPaths.of(cfg)
    paths.run_dir.mkdir(parents=True)
    write_config(paths, cfg)
    assert TOKEN not in (paths.run_dir / "config.json").read_text()
