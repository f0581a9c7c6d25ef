"""The run folder ``<base_output_directory>/<run_name>``: one job at a time (``run.lock``), never a folder that is not
a grpax run, no empty folder left by a failed start.

The checks run before the model loads (after the dataset checks, which touch no run folder), so these runs point
at a checkpoint that does not exist: a job that gets past them fails on the load instead, with another message.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import restore_params
from grpax.cli.main import main
from grpax.config import ConfigError
from grpax.rl.run_folder import RunLock, check_run_folder, claim_run_folder

REPO = Path(__file__).resolve().parents[1]


def _args(tmp_path, **overrides) -> list[str]:
    keys = tiny_run_keys(tmp_path / "no-such-checkpoint", tmp_path / "out", **overrides)  # the real GSM8K
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


# Test-only: a step-2 checkpoint write that lasts 3 s (the signal lands while Orbax's temporary folder exists).
SLOW_SAVE = """
import sys, time
import orbax.checkpoint as ocp
from grpax.checkpoint.orbax import restore_params
from grpax.cli.main import main
real = ocp.PyTreeCheckpointHandler.async_save
async def slow_save(self, directory, *args, **kwargs):
    if str(directory).split("/")[-2].startswith("2.orbax-checkpoint-tmp"):
        time.sleep(3)
    return await real(self, directory, *args, **kwargs)
ocp.PyTreeCheckpointHandler.async_save = slow_save
sys.exit(main(sys.argv[1:]))
"""


def _start_train(tiny_checkpoint, tmp_path, *, slow_save: bool) -> subprocess.Popen:
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, num_batches=3, checkpoint_period=1, num_test_batches=0)
    args = ["train_rl", *(f"{k}={v}" for k, v in keys.items())]
    entry = ["-c", SLOW_SAVE] if slow_save else ["-m", "grpax.cli.main"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, *entry, *args], stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(predicate, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    start = time.monotonic()
    while not predicate():
        assert proc.poll() is None, f"train_rl ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}"
        assert time.monotonic() - start < timeout_s
        time.sleep(0.005)


def _message_lines(stderr: str) -> list[str]:
    """stderr without log lines and progress bars (the bar redraws with carriage returns)."""
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines()]
    return [line for line in lines if line and not re.match(r"\d\d:\d\d:\d\d |grpo:", line)]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("where", ["step", "checkpoint"])
def test_interrupt_is_one_line_and_the_run_resumes(tiny_checkpoint, tmp_path, signum, where):
    actor = tmp_path / "run" / "checkpoints" / "actor"
    proc = _start_train(tiny_checkpoint, tmp_path, slow_save=where == "checkpoint")
    if where == "step":  # step 2 compiles for seconds after the step-1 checkpoint (a Ctrl-C there segfaulted)
        _wait_for(lambda: (actor / "1").is_dir(), proc)
        time.sleep(1)
    else:
        _wait_for(lambda: any(p.name.startswith("2.orbax-checkpoint-tmp") for p in actor.glob("*")), proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)

    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr, stderr[-3000:]
    saved = sorted(int(p.name) for p in actor.iterdir() if p.name.isdigit())
    # During a step: after step 1's checkpoint, step 2 or 3 (step 2 no longer compiles again, so the signal may
    # land in step 3); during step 2's save: that save is finished first.
    last = saved[-1] if where == "step" else 2
    assert 1 <= last < 3
    assert _message_lines(stderr) == [
        f"grpax train_rl: interrupted ({signal.Signals(signum).name}); the checkpoints saved so far are kept "
        f"(last: step {last}): the same command resumes from it"
    ]
    # An interrupted save is finished first; no temporary folder is left.
    assert sorted(p.name for p in actor.iterdir()) == [str(step) for step in range(1, last + 1)]
    logged = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the step after the last checkpoint may have logged its metrics before the signal landed (before its own
    # save): the resumed run trains it again and its line is replaced (checked after the rerun below)
    assert logged in (list(range(1, last + 1)), list(range(1, last + 2)) if where == "step" else None), logged
    restore_params(actor / str(last) / "model_params")

    rerun = _start_train(
        tiny_checkpoint, tmp_path, slow_save=False
    )  # takes the lock the interrupted run held
    _, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stderr[-3000:]
    assert f"from step {last}" in stderr
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]
    assert sorted(p.name for p in actor.iterdir()) == ["1", "2", "3"]


def test_a_signal_during_a_save_waits_for_it_and_a_second_one_does_not():
    from grpax import interrupts

    previous = signal.getsignal(signal.SIGTERM)
    with interrupts.handled():
        with pytest.raises(interrupts.Interrupted) as e:
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)  # the handler runs here and only notes the signal
                finished = True
        assert finished and e.value.signum == signal.SIGTERM
        with pytest.raises(interrupts.Interrupted) as e:
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGINT)  # pressed again: raises inside the block
                time.sleep(0.01)
                pytest.fail("the second signal did not interrupt the save")
        assert e.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_signal_lost_in_a_gc_callback_is_raised_at_the_next_safe_point(capsys):
    """The handler's exception is dropped when it fires inside a gc callback (as inside jax's _xla_gc_callback)."""
    import gc

    from grpax import interrupts

    def callback(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs here; its Interrupted is printed and ignored by gc

    with interrupts.handled():
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        with pytest.raises(interrupts.Interrupted) as e:
            interrupts.raise_pending()
        assert e.value.signum == signal.SIGINT
        interrupts.raise_pending()  # raised once
    assert "Traceback" not in capsys.readouterr().err  # the dropped exception is not printed either


def test_temporary_folder_of_an_abandoned_save_is_removed(tmp_path):
    import jax.numpy as jnp

    from grpax.checkpoint.train_state import TrainCheckpointer

    checkpointer = TrainCheckpointer(tmp_path)
    checkpointer.save(1, {"w": jnp.ones(3)}, {"m": jnp.zeros(3)}, {"step": 1})
    checkpointer.close()
    abandoned = tmp_path / "actor" / "2.orbax-checkpoint-tmp-1764650000"  # a save killed half-way
    (abandoned / "model_params").mkdir(parents=True)
    checkpointer = TrainCheckpointer(tmp_path)
    assert checkpointer.latest_step() == 1
    checkpointer.save(2, {"w": jnp.ones(3)}, {"m": jnp.zeros(3)}, {"step": 2})
    checkpointer.close()
    assert sorted(p.name for p in (tmp_path / "actor").iterdir()) == ["1", "2"]


def test_a_killed_runs_reference_copy_goes_at_the_next_start_of_any_run_beside_it(tmp_path):
    """Issue 27 item 5: kill -9 left <run>/.reference (0.54 GB for 135M) until that same run started again."""
    killed, live = tmp_path / "killed", tmp_path / "live"
    for run in (killed, live):
        (run / ".reference").mkdir(parents=True)
        (run / ".reference" / "0.npy").write_bytes(b"\0" * 1024)
        RunLock(run).release()  # a run.lock that its (dead) holder left
    holder = RunLock(live)  # a live job holds this one
    with claim_run_folder(tmp_path / "new", main_process=True):
        assert not (killed / ".reference").exists()
        assert (live / ".reference" / "0.npy").exists()
    holder.release()
