"""The run folder ``<base_output_directory>/<run_name>``: one job at a time (``run.lock``), never a folder that is not
a grpax run, no empty folder left by a failed start.

The checks run before the model loads, so these runs point at a checkpoint that does not exist: a job that gets
past them fails on the load instead, with another message.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_run_keys

from grpax.cli.main import main
from grpax.config import ConfigError
from grpax.rl.run_folder import RunLock, check_run_folder

REPO = Path(__file__).resolve().parents[1]


def _args(tmp_path, **overrides) -> list[str]:
    keys = tiny_run_keys(
        tmp_path / "no-such-checkpoint", tmp_path / "out", dataset_name=str(tmp_path), **overrides
    )
    return ["train_rl", *(f"{k}={v}" for k, v in keys.items())]


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that holds ``run_dir``'s lock until it is killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from grpax.rl.run_folder import RunLock
        Path({str(run_dir)!r}).mkdir(parents=True, exist_ok=True)
        lock = RunLock(Path({str(run_dir)!r}))
        print("locked", flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_second_job_on_a_locked_run_folder_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "out" / "run"
    holder = _hold_lock(run_dir)
    try:
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')  # the first job's record
        assert main(_args(tmp_path)) == 2
        line = _error_line(capsys)
        assert f"run folder {run_dir} is in use by another grpax train_rl (pid {holder.pid} on host " in line
        assert socket.gethostname() in line and "wait for it to finish, or pass another run_name" in line
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'
        assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "run.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_job_is_stale(tmp_path):
    holder = _hold_lock(tmp_path / "run")
    holder.send_signal(signal.SIGKILL)  # kill -9: no clean-up ran; the kernel dropped the flock
    holder.wait()
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == holder.pid
    lock = RunLock(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=rf"pid {os.getpid()} on host"):
        RunLock(tmp_path / "run")  # held: even this process's second claim is refused
    lock.release()
    RunLock(tmp_path / "run").release()


def test_failed_start_releases_the_lock_and_removes_the_folder_it_created(tmp_path, capsys):
    assert main(_args(tmp_path)) == 2  # the model load fails after the folder was claimed
    assert "no-such-checkpoint" in _error_line(capsys)
    assert not (tmp_path / "out" / "run").exists()
    (tmp_path / "out" / "mine").mkdir()  # a folder the user made is kept, and its lock is released
    assert main(_args(tmp_path, run_name="mine")) == 2
    assert (tmp_path / "out" / "mine" / "run.lock").exists()
    RunLock(tmp_path / "out" / "mine").release()


def test_folder_that_is_not_a_grpax_run_is_refused(tmp_path, capsys):
    export = tmp_path / "out" / "run"  # a Hugging Face export
    export.mkdir(parents=True)
    (export / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    (export / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(_args(tmp_path)) == 2
    assert _error_line(capsys) == (
        f"grpax train_rl: error: run folder {export} exists and is not a grpax run (it holds config.json, "
        "model.safetensors; no metrics.jsonl, checkpoints/actor or train_rl config.json): train_rl never "
        "writes into it; pass another run_name or base_output_directory"
    )
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]


def test_what_marks_a_grpax_run_folder(tmp_path):
    check_run_folder(tmp_path / "absent")
    check_run_folder(tmp_path)  # empty
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"it holds notes\.txt;"):
        check_run_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_run_keys("c", "o", dataset_name="d")))
    check_run_folder(tmp_path)  # a run of an older grpax: config.json with train_rl's keys
    (tmp_path / "config.json").unlink()
    (tmp_path / "checkpoints" / "actor").mkdir(parents=True)
    check_run_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"run folder .*notes\.txt is a file"):
        check_run_folder(tmp_path / "notes.txt")
