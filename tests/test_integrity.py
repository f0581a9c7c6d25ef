"""Nothing poisoned (issue 27): checkpoint digests checked on restore and export, damaged small files refused
before the model loads, non-finite weights never exported, and every such error one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import BrokenCheckpointError, restore_params, save_params
from grpax.checkpoint.train_state import DamagedStepError, TrainCheckpointer
from grpax.config import ConfigError


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def _params():
    return {
        "embed": jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64),
        "layers": {"wq": jnp.ones((2, 64, 64), jnp.bfloat16)},
    }


def _opt_state():
    return {"mu": jnp.linspace(0, 1, 4096, dtype=jnp.float32), "count": jnp.zeros((), jnp.int32)}


def _damage(folder: Path) -> None:
    """Overwrites 4 KiB in the middle of the largest data file under ``folder`` (Orbax/OCDBT chunks)."""
    data = max((p for p in folder.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        f.write(os.urandom(4096))


def _two_steps(tmp_path: Path) -> TrainCheckpointer:
    checkpointer = TrainCheckpointer(tmp_path / "checkpoints")
    for step in (1, 2):
        checkpointer.save(step, _params(), _opt_state(), {"step": step})
    return checkpointer


@pytest.mark.parametrize("item", ["model_params", "opt_state"])
def test_a_damaged_step_is_refused_on_restore_naming_the_array_and_the_previous_step(tmp_path, item):
    checkpointer = _two_steps(tmp_path)
    params, opt_state, meta = checkpointer.restore(2, _params(), _opt_state())
    assert meta == {"step": 2}  # the digests stay inside the checkpoint
    _damage(checkpointer.step_dir(2) / item)
    with pytest.raises(DamagedStepError) as e:
        checkpointer.restore(2, _params(), _opt_state())
    message = str(e.value)
    assert "\n" not in message and f"actor/2/{item} array" in message, message
    assert "resume from step 1" in message and f"delete {checkpointer.step_dir(2)}" in message, message
    checkpointer.close()


def test_a_damaged_trained_actor_is_refused_on_export(tmp_path):
    checkpointer = _two_steps(tmp_path)
    checkpointer.close()
    params_dir = checkpointer.step_dir(2) / "model_params"
    restore_params(params_dir)  # intact: reads
    _damage(params_dir)
    with pytest.raises(BrokenCheckpointError, match=r"array (embed|layers\.wq) differs .* \(kept: 1\)"):
        restore_params(params_dir)


def test_a_truncated_train_meta_or_a_bad_metrics_line_stops_a_resume_before_the_model_loads(tmp_path):
    from grpax.rl.resume import RunPaths, check_resume
    from grpax.rl.train_config import TrainConfig

    cfg = TrainConfig(**tiny_run_keys(tmp_path / "ckpt", tmp_path, dataset_name="unused"))
    paths = RunPaths.of(cfg)
    checkpointer = TrainCheckpointer(paths.checkpoints)
    checkpointer.save(2, _params(), _opt_state(), {"step": 2})
    checkpointer.close()
    meta = paths.checkpoints / "actor" / "2" / "train_meta" / "metadata"
    good = meta.read_text()
    meta.write_text(good[:30])
    with pytest.raises(DamagedStepError, match=rf"{meta} is truncated .*no earlier step is kept: delete"):
        check_resume(cfg, paths, 2)
    meta.write_text(good)
    (paths.run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n[1, 2]\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl line 2 holds '\[1, 2\]', not a metrics record"):
        check_resume(cfg, paths, 2)


def test_to_huggingface_refuses_non_finite_weights(tiny_checkpoint, tmp_path):
    from grpax.checkpoint.convert import to_huggingface

    params = restore_params(tiny_checkpoint)
    params["layers"]["wq"].flat[5] = np.nan
    save_params(params, tmp_path / "nan" / "0" / "items")
    shutil.copy(tiny_checkpoint.parents[1] / "config.json", tmp_path / "nan" / "config.json")
    with pytest.raises(BrokenCheckpointError, match=r"holds 1 NaN/inf weights \(the first in layers.wq\)"):
        to_huggingface(tmp_path / "nan" / "0" / "items", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_a_non_finite_update_is_one_line_with_exit_2(monkeypatch, capsys, tmp_path):
    from grpax.cli import train_rl
    from grpax.cli.main import main
    from grpax.rl.trainer import NonFiniteError

    def diverge(config, fit=None):
        raise NonFiniteError("step 1: the update made weights NaN/inf and nothing of this step was saved")

    monkeypatch.setattr(train_rl, "train", diverge)
    keys = tiny_run_keys(tmp_path / "ckpt", tmp_path, dataset_name="unused")
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpax train_rl: error: step 1: the update made weights NaN/inf"), err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_config_json_of_another_size_is_refused_before_sampling(tiny_checkpoint, tmp_path):
    from grpax.checkpoint.orbax import load_model

    base = tmp_path / "model"
    shutil.copytree(tiny_checkpoint.parents[1], base)
    config = json.loads((base / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        BrokenCheckpointError, match=r"weight layers\.\w+ has shape \[2, .*\[3, .*num_layers=3"
    ) as e:
        load_model(base / "0" / "items")
    assert f"does not match {base / 'config.json'}" in str(e.value)


def test_a_read_only_base_output_directory_or_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    from grpax.cli import train_rl
    from grpax.cli.main import main
    from grpax.rl import run_folder

    if os.geteuid() == 0:  # root writes anywhere: a file in the way fails the same mkdir
        (tmp_path / "ro").write_text("not a folder")
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(
        ConfigError, match=r"cannot write the run folder .*ro/sub/run .*pass a base_output_directory"
    ):
        with run_folder.claim_run_folder(tmp_path / "ro" / "sub" / "run", True):
            pass

    def full_disk(config, fit=None):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / ".reference" / "embed"))

    monkeypatch.setattr(train_rl, "train", full_disk)
    keys = tiny_run_keys(tmp_path / "ckpt", tmp_path, dataset_name="unused")
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "No space left on device" in err and ".reference/embed" in err, err


def test_a_full_disk_during_a_checkpoint_is_one_line_without_orbax_thread_tracebacks(
    tmp_path, monkeypatch, caplog
):
    """Reproduced on a 300 KB tmpfs: Orbax's writer threads logged 4 tracebacks (230 lines) around the error."""
    import logging

    from grpax.checkpoint.train_state import SaveFailedError

    checkpointer = _two_steps(tmp_path)
    tensorstore = (
        'RESOURCE_EXHAUSTED: Error writing "w/c/0/0" in OCDBT database at local file "/x/": Failed writing: '
        "\"/x/d/24c7\": Failed to write 770375 bytes to file 7: No space left on device [os_error_code='28']"
    )

    def full_disk(*args):
        logging.getLogger("absl").error(
            "[thread=array_type_handler] _SignalingThread.run() raised an exception: %s", tensorstore
        )
        raise ValueError(tensorstore)

    monkeypatch.setattr(checkpointer, "_write", full_disk)
    with caplog.at_level(logging.INFO):
        with pytest.raises(SaveFailedError) as e:
            checkpointer.save(3, _params(), _opt_state(), {"step": 3})
    assert str(e.value).startswith(
        f"writing checkpoint step 3 to {checkpointer.step_dir(3)} failed: No space left on device (RESOURCE_EXHAUSTED); "
        "the last finished step 2 is kept"
    )
    assert "raised an exception" not in caplog.text
    checkpointer.close()


def _truncate(folder: Path) -> None:
    """Cuts the largest data file under ``folder`` to half its size (a copy or a disk that stopped short)."""
    data = max((p for p in folder.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(data, data.stat().st_size // 2)


@pytest.mark.parametrize("item", ["model_params", "opt_state"])
def test_a_truncated_step_is_one_line_naming_the_step_the_array_and_the_fix(tmp_path, item, monkeypatch):
    """Issue 45: Orbax wraps tensorstore's OUT_OF_RANGE in a plain Exception on a restore onto devices, which
    came out as a 172-line traceback naming no step; the reads it abandoned then printed "Exception ignored in:
    <coroutine ...>" with a 40-line TensorStore spec each through sys.unraisablehook."""
    import gc
    import sys

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(u.exc_value))
    checkpointer = _two_steps(tmp_path)  # installs grpax's hook over the recorder
    _truncate(checkpointer.step_dir(2) / item)
    with pytest.raises(DamagedStepError) as e:
        checkpointer.restore(2, _params(), _opt_state())
    message = str(e.value)
    del e  # its traceback holds the abandoned reads
    checkpointer.close()
    gc.collect()
    assert printed == []
    assert "\n" not in message, message
    assert message.startswith(f"checkpoint step 2 is damaged: reading {item} array "), message
    assert "failed with OUT_OF_RANGE (a truncated or corrupt data file)" in message, message
    assert f"delete {checkpointer.step_dir(2)} and run the same command to resume from step 1" in message


def test_a_truncated_step_on_export_names_the_steps_kept_not_a_reconversion(tmp_path):
    checkpointer = _two_steps(tmp_path)
    checkpointer.close()
    params_dir = checkpointer.step_dir(2) / "model_params"
    _truncate(params_dir)
    with pytest.raises(BrokenCheckpointError) as e:
        restore_params(params_dir)
    message = str(e.value)
    assert "\n" not in message and "failed with OUT_OF_RANGE" in message, message
    assert message.endswith(
        f"pass another step's {checkpointer.step_dir(2).parent}/<step>/model_params (kept: 1)"
    )


def test_unretrieved_tensorstore_errors_of_orbax_futures_are_not_logged(caplog):
    """A full disk during a checkpoint: Orbax's other concurrent writes fail too, and asyncio logged each
    ("_GatheringFuture exception was never retrieved", with its traceback) after the one-line error. Only
    tensorstore errors are dropped; any other unretrieved exception is still logged."""
    import asyncio
    import gc
    import logging

    from grpax.checkpoint import train_state

    train_state.quiet_orbax_thread_errors()
    loop = asyncio.new_event_loop()
    tensorstore = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "0.mu.layers.wq.a/c/0/0/0" in OCDBT database at local file "/x/": '
        "Failed to write 770375 bytes to file 7: No space left on device [os_error_code='28']"
    )
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for exc in (tensorstore, ValueError("something else")):
            future = loop.create_future()
            future.set_exception(exc)
            del future
            gc.collect()
    loop.close()
    logged = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [str(r.exc_info[1]) for r in logged] == ["something else"]


def test_a_trees_digests_are_one_program_and_each_arrays_own():
    """A checkpoint's digests compile one program for the whole tree (each distinct leaf shape was a program of
    its own: a compile each on an accelerator), with every array's digest as computed alone."""
    import jax.numpy as jnp

    from grpax.checkpoint import digests
    from grpax.compiles import CompileLog

    tree = {
        "a": jnp.arange(1000, dtype=jnp.float32) * 0.37,
        "b": {"c": np.arange(12, dtype=np.int32).reshape(3, 4), "d": jnp.ones((5,), jnp.bfloat16)},
        "m": np.array([True, False]),
        "x": np.float64(1.0),  # 8-byte: no digest
    }
    with CompileLog() as log:
        whole = digests.tree_digests(tree)
    assert [p.name for p in log.programs] == ["_sums"]
    assert whole == {
        k: digests.array_digest(v)
        for k, v in [("a", tree["a"]), ("b.c", tree["b"]["c"]), ("b.d", tree["b"]["d"]), ("m", tree["m"])]
    }
    assert (
        whole["b.c"] == "int32[3, 4]:b9a6881c6dd33522"
    )  # the digests written before: checkpoints still check
    assert digests.mismatches({**tree, "a": tree["a"] + 1}, whole) == ["a"]


def test_a_steps_two_trees_digest_in_one_program():
    """``trees_digests``: the params' and the optimizer state's digests of a checkpoint in one program, each tree's
    equal to its own ``tree_digests``."""
    import jax.numpy as jnp

    from grpax.checkpoint import digests
    from grpax.compiles import CompileLog

    params = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3), "b": jnp.ones((7,), jnp.float32)}
    opt_state = ({"mu": {"w": jnp.zeros((2, 3), jnp.bfloat16)}}, {"count": jnp.int32(3)})
    with CompileLog() as log:
        both = digests.trees_digests({"model_params": params, "opt_state": opt_state})
    assert [p.name for p in log.programs] == ["_sums"]
    assert both == {
        "model_params": digests.tree_digests(params),
        "opt_state": digests.tree_digests(opt_state),
    }
    assert set(both["opt_state"]) == {"0.mu.w", "1.count"}


def test_a_trees_digests_hold_no_copy_of_its_arrays():
    """The one program of a checkpoint's digests reduces each array where it lies: no uint32 copy of its bits or
    of its positions (as two separate sums, XLA:CPU wrote both: 3.2 GB of temporaries for SmolLM2's params and
    AdamW state, the main job's peak); the digests written before stay the same (the test above)."""
    import jax

    from grpax.checkpoint import digests

    leaves = [
        jax.ShapeDtypeStruct((30, 576, 1536), jnp.float32),
        jax.ShapeDtypeStruct((49152, 576), jnp.bfloat16),
    ]
    memory = digests._sums.lower(leaves).compile().memory_analysis()
    arguments = 4 * 30 * 576 * 1536 + 2 * 49152 * 576
    assert memory.argument_size_in_bytes == arguments
    assert memory.temp_size_in_bytes < arguments / 100, memory.temp_size_in_bytes


def test_the_tpus_two_sums_are_the_cpus_one_reduction():
    """The digests' two formulations (the CPU's one two-operand reduction, the other platforms' two sums) give
    the same sums, bit for bit, for every digested dtype (sums modulo 2**32: sizes past the wrap included)."""
    import jax

    from grpax.checkpoint import digests

    rng = np.random.default_rng(0)
    arrays = [
        jnp.asarray(rng.standard_normal(300_001), jnp.float32),
        jnp.asarray(rng.standard_normal((7, 129)), jnp.bfloat16),
        jnp.asarray(rng.integers(-(2**31), 2**31 - 1, 5000), jnp.int32),
        jnp.asarray(rng.integers(0, 255, 777), jnp.uint8),
        jnp.asarray(rng.random(33) > 0.5),
    ]
    for x in arrays:
        one, two = jax.jit(digests._one_reduction)(x), jax.jit(digests._two_sums)(x)
        np.testing.assert_array_equal(np.asarray(one), np.asarray(two))


def test_the_digests_compile_for_a_tpu_as_two_fused_sums():
    """Compiled for a TPU v5e (libtpu, no TPU needed): the digest program takes the two-sums formulation, whose
    temporaries are a small fraction of its arguments (as one two-operand reduction: 145 MB for SmolLM2's
    trees), at XLA's least run-time effort."""
    pytest.importorskip("libtpu", reason="the tpu extra brings libtpu; CI installs it")
    import jax

    from grpax.checkpoint import digests
    from grpax.plan.topology import get_topology

    devices = list(get_topology("v5e-1").devices)
    placed = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("x",)), jax.sharding.PartitionSpec())
    leaves = [
        jax.ShapeDtypeStruct((30, 576, 1536), jnp.float32, sharding=placed),
        jax.ShapeDtypeStruct((49152, 576), jnp.bfloat16, sharding=placed),
    ]
    memory = digests._sums.lower(leaves).compile().memory_analysis()
    arguments = 4 * 30 * 576 * 1536 + 2 * 49152 * 576
    assert memory.argument_size_in_bytes == arguments
    assert memory.temp_size_in_bytes < arguments / 100, memory.temp_size_in_bytes


def test_a_background_save_holds_the_arrays_as_they_were_when_it_returned(tmp_path):
    """async_checkpointing: ``save`` returns before the files are written; the update that follows donates the
    saved arrays (the trainer's step does), and the step on disk still holds the values handed to ``save``."""
    checkpointer = TrainCheckpointer(tmp_path / "checkpoints", background=True)
    params, opt_state = _params(), _opt_state()
    expected = jax.tree.map(np.asarray, (params, opt_state))
    checkpointer.save(1, params, opt_state, {"step": 1})
    assert checkpointer.writing == 1
    bump = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)
    params, opt_state = bump((params, opt_state))
    checkpointer.save(2, params, opt_state, {"step": 2})  # waits for step 1's write first
    checkpointer.close()  # waits for step 2's
    reader = TrainCheckpointer(tmp_path / "checkpoints")
    for step, (want_params, want_opt) in ((1, expected), (2, jax.tree.map(np.asarray, (params, opt_state)))):
        got_params, got_opt, meta = reader.restore(step, _params(), _opt_state())
        assert meta == {"step": step}
        jax.tree.map(np.testing.assert_array_equal, (got_params, got_opt), (want_params, want_opt))
    reader.close()


def test_a_failed_background_write_stops_the_next_save_naming_its_step(tmp_path, monkeypatch):
    """The failure of a write under way in the background is raised by the next save (or ``wait`` / ``close``),
    as the one line a failed save gives, naming the step that failed, not the one being saved."""
    from grpax.checkpoint.train_state import SaveFailedError

    checkpointer = TrainCheckpointer(tmp_path / "checkpoints", background=True)
    checkpointer.save(1, _params(), _opt_state(), {"step": 1})
    checkpointer.wait()
    checkpointer.save(2, _params(), _opt_state(), {"step": 2})
    tensorstore = (
        'RESOURCE_EXHAUSTED: Error writing "w/c/0/0" in OCDBT database at local file "/x/": Failed writing: '
        "\"/x/d/24c7\": Failed to write 770375 bytes to file 7: No space left on device [os_error_code='28']"
    )
    finished = checkpointer.manager.wait_until_finished

    def full_disk():
        finished()
        raise ValueError(tensorstore)

    monkeypatch.setattr(checkpointer.manager, "wait_until_finished", full_disk)
    with pytest.raises(SaveFailedError) as e:
        checkpointer.save(3, _params(), _opt_state(), {"step": 3})
    assert str(e.value).startswith(
        f"writing checkpoint step 2 to {checkpointer.step_dir(2)} failed: No space left on device "
        "(RESOURCE_EXHAUSTED); the last finished step 1 is kept"
    )
    assert checkpointer.writing is None
    checkpointer.wait()  # the failure was raised once: nothing is under way any more
    monkeypatch.setattr(checkpointer.manager, "wait_until_finished", finished)
    checkpointer.close()
