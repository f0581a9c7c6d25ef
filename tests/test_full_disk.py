"""A full disk is one line naming where (issue 27, item 7), reproduced on a 3 MB tmpfs: the reference copy
("6291456 requested and 3141504 written"), the model files beside the checkpoints (tokenizers' bare
``Exception: No space left on device (os error 28)``), TensorBoard's flush on the way out (which replaced the
first error), and the safetensors writer of ``to_huggingface`` (``SafetensorError`` traceback)."""

from __future__ import annotations

import errno
import sys

import jax.numpy as jnp
import pytest

from grpax.config import ConfigError


def test_a_full_disk_inside_a_run_names_the_run_folder(tmp_path):
    from grpax.rl.run_folder import claim_run_folder

    with pytest.raises(
        ConfigError, match=rf"writing the run folder {tmp_path / 'run'} failed: No space left on "
    ):
        with claim_run_folder(tmp_path / "run", main_process=True):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "x"))
    with pytest.raises(FileNotFoundError):  # other OS errors pass as they are
        with claim_run_folder(tmp_path / "run", main_process=True):
            raise FileNotFoundError("dataset")


def test_the_reference_copy_on_a_full_disk_names_its_file_and_leaves_nothing(tmp_path, monkeypatch):
    from grpax.rl import reference

    def short_write(path, array):
        raise OSError("6291456 requested and 3141504 written")

    monkeypatch.setattr(reference.np, "save", short_write)
    with pytest.raises(
        OSError, match=r"writing the reference model's copy .* failed: 6291456 requested"
    ) as e:
        reference.FrozenParams({"w": jnp.ones(4)}, tmp_path / ".reference")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / ".reference" / "0.npy")
    assert not (tmp_path / ".reference").exists()


def test_the_model_files_on_a_full_disk_are_an_os_error(tmp_path, monkeypatch, tiny_checkpoint):
    from grpax.checkpoint.orbax import load_model
    from grpax.rl import resume

    _, cfg, tokenizer = load_model(tiny_checkpoint)

    def full(tokenizer, folder):
        raise Exception("No space left on device (os error 28)")  # noqa: TRY002 - what tokenizers raises

    monkeypatch.setattr(resume, "save_tokenizer", full)
    with pytest.raises(OSError) as e:
        resume.write_model_files(tmp_path / "checkpoints", cfg, tokenizer)
    assert e.value.errno == errno.ENOSPC and not list(tmp_path.iterdir())


def test_a_tensorboard_flush_on_a_full_disk_does_not_hide_the_first_error(tmp_path):
    from grpax.rl.metrics_writer import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True)

    class Full:
        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    writer._tb = Full()
    writer.close()  # warns, does not raise
    writer.close()


def test_to_huggingface_on_a_full_disk_is_one_line(tiny_checkpoint, tmp_path, monkeypatch):
    from grpax.checkpoint import convert

    class SafetensorError(Exception):
        pass

    def full(*args):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(convert, "_write_safetensors", full)
    with pytest.raises(
        ConfigError, match=r"writing the safetensors under .*hf failed \(Error while serializing"
    ):
        convert.to_huggingface(tiny_checkpoint, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() or not list((tmp_path / "hf").iterdir())


def test_closed_event_loop_callbacks_of_a_failed_save_are_not_printed(capsys, monkeypatch):
    """A full disk during a checkpoint: tensorstore's pending writes call back into Orbax's closed event loop
    and Python printed "RuntimeError: Event loop is closed" (about 40 lines) around the one-line error. Only
    that exact callback error is dropped; any other unraisable exception is still printed."""
    import asyncio
    import types

    from grpax.checkpoint import train_state

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(u.exc_value))
    train_state.quiet_orbax_thread_errors()
    train_state.quiet_orbax_thread_errors()  # installed once
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        closed = e
    other = ValueError("something else")

    def unraisable(exc):
        return types.SimpleNamespace(
            exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__, err_msg=None, object=None
        )

    sys.unraisablehook(unraisable(closed))
    sys.unraisablehook(unraisable(other))
    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))  # not from asyncio's check: printed
    assert [str(e) for e in printed] == ["something else", "Event loop is closed"]


def test_closed_event_loop_errors_printed_by_native_callbacks_are_dropped(monkeypatch):
    """Issue 45: on a full disk without OCDBT (a file per chunk), tensorstore's callbacks printed "RuntimeError:
    Event loop is closed" through PyErr_Print, that is ``sys.excepthook`` (28 tracebacks, 169 lines), after the
    one-line error. Only that exact error is dropped."""
    import asyncio

    from grpax.checkpoint import train_state

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda t, e, tb: printed.append(e))
    train_state.quiet_orbax_thread_errors()
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        closed = e
    sys.excepthook(type(closed), closed, closed.__traceback__)
    other = ValueError("something else")
    sys.excepthook(type(other), other, None)
    assert [str(e) for e in printed] == ["something else"]
