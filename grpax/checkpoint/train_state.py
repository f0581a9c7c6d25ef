"""Resumable GRPO training checkpoints (Orbax ``CheckpointManager``).

Layout under ``<base_output_directory>/<run_name>/checkpoints/``::

    config.json, tokenizer files          model description, so the actor loads on its own
    actor/<step>/model_params/            the actor's weights (``grpax to_huggingface load_parameters_path=...``)
    actor/<step>/opt_state/               optax state
    actor/<step>/train_meta/              JSON: step, data-iterator position, RNG seed, metrics history

Orbax writes each step into a temporary folder and renames it when complete, so an interrupted save (Ctrl-C,
a crash, a full disk) never shadows the last good step: ``latest_step`` only sees finished ones. Each step's
``train_meta`` also holds a digest of every array of both trees (``grpax.checkpoint.digests``), checked on
restore (and by ``restore_params`` on export), so a step whose data files were damaged afterwards is refused by
name instead of resuming or exporting garbage.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpax import interrupts
from grpax.checkpoint import digests
from grpax.errors import ConfigError

META_FILE = (
    "metadata"  # the JSON file of ``actor/<step>/train_meta``, as Orbax's JsonCheckpointHandler names it
)


class _OrbaxThreadErrors(logging.Filter):
    """Drops Orbax's "<thread>.run() raised an exception" records: the same exception reaches the caller, which
    reports it in one line; the records add 40-400 lines of tracebacks from its writer threads around it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return ".run() raised an exception" not in record.getMessage()


_THREAD_FILTER = _OrbaxThreadErrors()


def tensorstore_status(error: BaseException) -> tuple[str, str] | None:
    """``(status, message)`` of the tensorstore error inside an Orbax read or write failure (``OUT_OF_RANGE`` of a
    truncated file, ``DATA_LOSS``, ``RESOURCE_EXHAUSTED`` of a full disk), or None for any other error.

    Orbax raises tensorstore's ``ValueError("OUT_OF_RANGE: Error reading ...")`` itself, or wraps it in a plain
    ``Exception("Encountered error while reading array index ...")`` (a restore onto device shardings), so
    the exception's causes are searched too.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        status = re.match(r"([A-Z][A-Z_]+): ", str(e))
        if isinstance(e, ValueError) and status is not None:
            return status.group(1), str(e)
        e = e.__cause__ or e.__context__
    return None


class _UnretrievedTensorstoreErrors(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" / "_GatheringFuture exception was never retrieved"
    records of tensorstore errors: a failed save or restore has reported the first one in one line; Orbax's
    other concurrent writes (or reads) fail the same way and are logged, with a traceback each, when their
    futures are collected (12-16 records on a full disk)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        unretrieved = "exception was never retrieved" in str(record.msg)
        return not (unretrieved and exc is not None and tensorstore_status(exc) is not None)


_ASYNCIO_FILTER = _UnretrievedTensorstoreErrors()


def _closed_loop_callback(exc_type, exc: BaseException, tb) -> bool:
    """A tensorstore write finishing after Orbax closed its event loop (a failed save): its native callback
    calls ``loop.call_soon_threadsafe`` and prints "RuntimeError: Event loop is closed" through
    ``sys.unraisablehook`` or, from another callback, ``PyErr_Print`` (``sys.excepthook``), once per pending write
    (40-170 lines on a full disk), around the save's one-line error."""
    if exc_type is not RuntimeError or str(exc) != "Event loop is closed" or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return code.co_name == "_check_closed" and code.co_filename.endswith(
        os.path.join("asyncio", "base_events.py")
    )


def _abandoned_orbax_coroutine(unraisable) -> bool:
    """An Orbax read or write coroutine collected unfinished after another of the same restore or save failed
    (a truncated file, a full disk): its ``except`` turns the ``GeneratorExit`` into "Exception: Encountered
    error while reading array index" with a 40-line TensorStore spec (or, at interpreter exit, an ImportError),
    printed through ``sys.unraisablehook`` once per abandoned array after the one-line error."""
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine object
    return code is not None and os.path.join("orbax", "checkpoint") in code.co_filename


def _unraisablehook(previous):
    def hook(unraisable):
        args = (unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
        if not (_closed_loop_callback(*args) or _abandoned_orbax_coroutine(unraisable)):
            previous(unraisable)

    hook.grpax_closed_loop_filter = True
    return hook


def quiet_orbax_thread_errors() -> None:
    """Installs ``_OrbaxThreadErrors`` on the ``absl`` logger Orbax logs through and
    ``_UnretrievedTensorstoreErrors`` on the ``asyncio`` logger, and drops tensorstore's "Event loop is closed"
    callbacks of a failed save (from ``sys.unraisablehook`` and ``sys.excepthook``) and Orbax's abandoned
    coroutines of a failed restore or save (from ``sys.unraisablehook``); once; every other exception is printed
    as before."""
    for name, log_filter in (("absl", _THREAD_FILTER), ("asyncio", _ASYNCIO_FILTER)):
        logger = logging.getLogger(name)
        if log_filter not in logger.filters:
            logger.addFilter(log_filter)
    if not getattr(sys.unraisablehook, "grpax_closed_loop_filter", False):
        sys.unraisablehook = _unraisablehook(sys.unraisablehook)
    if not getattr(sys.excepthook, "grpax_closed_loop_filter", False):
        sys.excepthook = _excepthook(sys.excepthook)


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        if not _closed_loop_callback(exc_type, exc, tb):
            previous(exc_type, exc, tb)

    hook.grpax_closed_loop_filter = True
    return hook


class SaveFailedError(ConfigError):
    """A checkpoint write failed (a full or read-only disk); the message names the folder and what is kept."""


class DamagedStepError(ConfigError):
    """A finished checkpoint step whose files were damaged afterwards; the message names the file and the fix."""


def read_train_meta(step_dir: Path) -> dict:
    """The ``train_meta`` JSON of a step folder (``actor/<step>``).

    Raises:
      DamagedStepError: the file is missing, truncated or not a JSON object with ``step``.
    """
    path = step_dir / "train_meta" / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedStepError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise DamagedStepError(
            f"{path} is truncated or not valid JSON ({' '.join(str(e).split())})"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise DamagedStepError(f"{path} holds {str(meta)[:60]!r}, not a train_meta record with 'step'")
    return meta


def check_step_meta(actor_dir: Path, step: int) -> dict:
    """``read_train_meta`` of ``actor_dir/<step>``, its error carrying the fix (``damaged_step``)."""
    try:
        return read_train_meta(actor_dir / str(step))
    except DamagedStepError as e:
        raise damaged_step(actor_dir, step, str(e)) from None


def damaged_array(status: str, message: str) -> str:
    """``"model_params array embed failed with OUT_OF_RANGE"``: the item and array a tensorstore read error names
    (``'... "embed/c/0/0" in OCDBT database at local file ".../actor/2/model_params/"'``), as far as it names them."""
    leaf = re.search(r'in "([^"/]+)/', message)
    item = re.search(r'local file "[^"]*/(model_params|opt_state)/?"', message)
    where = " ".join(
        x for x in ((item.group(1) if item else ""), (f"array {leaf.group(1)}" if leaf else "")) if x
    )
    return f"{where or 'an array'} failed with {status}"


def damaged_step(actor_dir: Path, step: int, what: str) -> DamagedStepError:
    """The one-line error for a damaged step ``actor_dir/<step>``: ``what`` is wrong; delete the step to resume
    from the one before it (named, with the steps kept), or, with none kept, start afresh."""
    step_dir = actor_dir / str(step)
    names = [p.name for p in actor_dir.iterdir()] if actor_dir.is_dir() else []
    earlier = sorted(int(n) for n in names if n.isdigit() and int(n) < step)
    fix = (
        f"delete {step_dir} and run the same command to resume from step {earlier[-1]} (kept: "
        f"{', '.join(map(str, earlier))})"
        if earlier
        else f"no earlier step is kept: delete {step_dir} to start the run afresh, or pass a new run_name"
    )
    return DamagedStepError(f"checkpoint step {step} is damaged: {what}; {fix}")


class TrainCheckpointer:
    """Saves and restores (params, opt_state, meta) per step, keeping the newest ``max_to_keep``.

    Args:
      directory: ``<run>/checkpoints``; steps go to ``directory/actor/<step>``.
      max_to_keep: number of step checkpoints kept (MaxText ``max_num_checkpoints_to_keep``).
      use_zarr3, use_ocdbt: Orbax storage options (MaxText ``checkpoint_storage_use_*``).
      use_compression: zstd-compress the chunks (Orbax's default is True). Off here: trained float32 weights
        and optimizer moments shrink by under a tenth, while compressing holds every encoded chunk in host
        memory until the save ends (about the state's size again, measured in docs/benchmarks.md). Reading
        either kind of checkpoint needs no setting.
      background: write each step's files in a background thread (Orbax's async save; MaxText's
        ``async_checkpointing``): ``save`` returns once the arrays are copied to host memory, so training goes
        on (and may donate them) while the files are written; the next ``save``, ``wait`` and ``close`` wait for
        the write and raise its failure (``SaveFailedError`` naming the step). False: ``save`` returns when
        the step is on disk.
    """

    def __init__(
        self,
        directory: str | Path,
        max_to_keep: int = 3,
        use_zarr3: bool = True,
        use_ocdbt: bool = True,
        use_compression: bool = False,
        background: bool = False,
    ):
        self.directory = Path(directory).absolute()
        self.background = background
        self._writing: int | None = None
        quiet_orbax_thread_errors()
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        tree_handler = ocp.PyTreeCheckpointHandler(
            use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, use_compression=use_compression
        )
        for item in ("model_params", "opt_state"):
            registry.add(item, ocp.args.PyTreeSave, tree_handler)
            registry.add(item, ocp.args.PyTreeRestore, tree_handler)
        registry.add("train_meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        registry.add("train_meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            enable_async_checkpointing=background,
            cleanup_tmp_directories=True,  # the temporary folder of an abandoned save
        )
        self.manager = ocp.CheckpointManager(
            self.directory / "actor", options=options, handler_registry=registry
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The finished steps, oldest first."""
        return sorted(self.manager.all_steps())

    def damaged(self, step: int, what: str) -> DamagedStepError:
        """The one-line error for a damaged ``step`` (``damaged_step``)."""
        return damaged_step(self.directory / "actor", step, what)

    def check_meta(self, step: int) -> dict:
        """Reads and checks step ``step``'s ``train_meta`` (cheap: before any model is loaded).

        Raises:
          DamagedStepError: it is missing, truncated or not a train_meta record (names the file and the fix).
        """
        return check_step_meta(self.directory / "actor", step)

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Writes step ``step``: on disk when it returns, or (``background``) copied to host memory and written
        by a background thread, after an earlier background write has finished.

        A Ctrl-C or SIGTERM during the write takes effect once it is complete (``grpax.interrupts``; a background
        write is waited for on the way out, ``close``); a second one abandons it, and its temporary folder is
        removed when the run resumes.

        Raises:
          SaveFailedError: this step's write, or an earlier background one, failed (a full disk: the step named).
        """
        with interrupts.deferred():
            self.wait()
            self._named_failure(step, lambda: self._write(step, params, opt_state, meta))
            if self.background:
                self._writing = step
            else:
                self._named_failure(step, self.manager.wait_until_finished)

    @property
    def writing(self) -> int | None:
        """The step whose files a background write is writing (``background``), None when none is under way."""
        return self._writing

    def wait(self) -> None:
        """Waits for a background write (``background``); a no-op when none is under way.

        Raises:
          SaveFailedError: the write failed (the step named, and the last finished one kept).
        """
        step, self._writing = self._writing, None
        if step is not None:
            self._named_failure(step, self.manager.wait_until_finished)

    def _named_failure(self, step: int, write) -> None:
        """Runs ``write`` (part of step ``step``'s save); tensorstore's failure becomes ``SaveFailedError``."""
        try:
            write()
        except (
            Exception
        ) as e:  # tensorstore: "RESOURCE_EXHAUSTED: Error writing ...: No space left on device"
            found = tensorstore_status(e)
            if found is None:
                raise
            status, message = found
            os_error = re.search(r"Failed to write .*?: ([^\[]+?)\s*\[os_error_code", message)
            reason = os_error.group(1) if os_error else status
            kept = [s for s in self.steps() if s != step]
            raise SaveFailedError(
                f"writing checkpoint step {step} to {self.step_dir(step)} failed: {reason} ({status}); "
                f"{f'the last finished step {kept[-1]} is kept' if kept else 'no step had been saved yet'}: free "
                "space there (or pass a base_output_directory with room), then run the same command to resume"
            ) from None

    def _write(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        meta = {
            **meta,
            "digests": digests.trees_digests({"model_params": params, "opt_state": opt_state}),
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                model_params=ocp.args.PyTreeSave(params),
                opt_state=ocp.args.PyTreeSave(opt_state),
                train_meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def restore(self, step: int, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        """Restores step ``step`` onto the shardings and dtypes of ``params_like`` / ``opt_state_like``.

        Returns:
          (params, opt_state, meta) with the same tree structure as the templates.
        """

        def restore_args(tree):
            return jax.tree.map(
                lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype, global_shape=x.shape), tree
            )

        def as_saved(tree):
            # Orbax stores NamedTuples (optax states) as plain containers; restore into the template's structure.
            return jax.tree.map(lambda x: x, tree)

        self.check_meta(step)
        try:
            restored = self._restore(step, params_like, opt_state_like, restore_args, as_saved)
        except Exception as e:  # tensorstore: "OUT_OF_RANGE: Error reading ...", maybe wrapped by Orbax
            found = tensorstore_status(e)
            if found is None:
                raise
            raise self.damaged(
                step, f"reading {damaged_array(*found)} (a truncated or corrupt data file)"
            ) from e
        saved = restored.train_meta.get("digests") or {}
        for item in ("model_params", "opt_state"):
            bad = digests.mismatches(getattr(restored, item), saved.get(item, {}))
            if bad:
                raise self.damaged(
                    step,
                    f"{self.step_dir(step) / item} array {bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} "
                    "differs from the digest written with it (a corrupt or overwritten data file)",
                )
        meta = {k: v for k, v in restored.train_meta.items() if k != "digests"}
        return restored.model_params, restored.opt_state, meta

    def _restore(self, step, params_like, opt_state_like, restore_args, as_saved):
        return self.manager.restore(
            step,
            args=ocp.args.Composite(
                model_params=ocp.args.PyTreeRestore(
                    as_saved(params_like), restore_args=restore_args(params_like)
                ),
                opt_state=ocp.args.PyTreeRestore(
                    as_saved(opt_state_like), restore_args=restore_args(opt_state_like)
                ),
                train_meta=ocp.args.JsonRestore(),
            ),
        )

    def step_dir(self, step: int) -> Path:
        return self.directory / "actor" / str(step)

    def close(self) -> None:
        """Waits for a background write (its failure raised, ``wait``), then closes Orbax's manager."""
        try:
            self.wait()
        finally:
            self.manager.close()


def lora_meta(params_path: Path) -> dict | None:
    """The ``lora`` record of the training step holding ``params_path`` (``.../actor/<step>/model_params``),
    or None (a full fine-tune, or not a training step)."""
    meta_file = params_path.parent / "train_meta" / "metadata"
    if params_path.name != "model_params" or not meta_file.is_file():
        return None
    try:
        return json.loads(meta_file.read_text()).get("lora")
    except ValueError:
        return None
