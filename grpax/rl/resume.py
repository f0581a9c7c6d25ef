"""Resume bookkeeping of a run folder: its paths, the recorded config, and restore or fresh start.

A run's ``config.json`` records the keys it was started with; a resume (the same ``run_name``) is refused when
a key of ``RESUME_FIXED_KEYS`` changed, and other changes are logged and appended to ``config_changes.jsonl``.
Who may write the folder at all is ``grpax.rl.run_folder``'s job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from grpax.checkpoint.train_state import TrainCheckpointer, check_step_meta
from grpax.config import ConfigError, redacted
from grpax.data.iterator import PromptIterator
from grpax.data.tokenizer import save_tokenizer
from grpax.models.registry import ModelConfig, to_hf_config
from grpax.rl.metrics_writer import MetricsWriter, read_jsonl
from grpax.rl.train_step import TrainState

if TYPE_CHECKING:
    from grpax.rl.train_config import TrainConfig

log = logging.getLogger("grpax.train")


@dataclasses.dataclass
class RunPaths:
    """The folders of a run: ``<base_output_directory>/<run_name>``, its checkpoints and evaluations."""

    run_dir: Path
    checkpoints: Path
    eval_dir: Path

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunPaths:
        run_dir = Path(cfg.base_output_directory) / cfg.run_name
        return cls(run_dir, run_dir / "checkpoints", run_dir / "eval")


# Keys a resumed run cannot change: the saved data order, groups and weights (and their layout, scan_layers)
# follow from them (weight_dtype: a 16-bit run's optimizer state also holds the float32 master copy); lora_alpha
# and use_rslora scale the trained adapters (a new scale would rescale what they learnt). The dataset keys may change (a new dataset continues at the saved position).
RESUME_FIXED_KEYS = (
    "batch_size",
    "num_generations",
    "seed",
    "model_name",
    "load_parameters_path",
    "scan_layers",
    "weight_dtype",
    "lora_rank",
    "lora_alpha",
    "use_rslora",
    "lora_target_modules",
    "lora_base_dtype",
)


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The config as ``config.json`` holds it (JSON types; ``load_parameters_path`` made absolute, so that a
    resume from another working folder compares the same folder; secret values redacted, ``grpax.config.redact``)."""
    record = redacted(json.loads(json.dumps(dataclasses.asdict(cfg))))  # no secret in clear on disk
    if record["load_parameters_path"]:
        record["load_parameters_path"] = str(Path(record["load_parameters_path"]).absolute())
    return record


def check_resume(cfg: TrainConfig, paths: RunPaths, latest: int) -> dict[str, tuple[Any, Any]]:
    """Checks that ``cfg`` can continue the run whose latest checkpoint is at step ``latest``.

    Returns:
      ``{key: (saved, current)}`` for each key that differs from the run's ``config.json`` (empty without one).

    Raises:
      ConfigError: ``num_batches`` is below ``latest``, or a key of ``RESUME_FIXED_KEYS`` changed; the latest
        step's ``train_meta`` or a line of ``metrics.jsonl`` is damaged (names the file and the fix).
    """
    # The run's small files first, so that a damaged one stops the resume before the model loads.
    if (paths.checkpoints / "actor" / str(latest)).is_dir():
        check_step_meta(paths.checkpoints / "actor", latest)
    if (paths.run_dir / "metrics.jsonl").exists():
        read_jsonl(paths.run_dir / "metrics.jsonl")
    if cfg.num_batches < latest:
        raise ConfigError(
            f"run {paths.run_dir} already has a checkpoint at step {latest}, past num_batches="
            f"{cfg.num_batches}: raise num_batches to >= {latest} to continue (or re-evaluate) it, or pass a "
            "new run_name"
        )
    saved_path = paths.run_dir / "config.json"
    if not saved_path.exists():
        return {}
    try:
        saved = json.loads(saved_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{saved_path} is not valid JSON ({e}): restore it, or delete it to resume without the key check"
        ) from None
    current = config_record(cfg)
    unset = "<unset>"
    changes = {
        key: (saved.get(key, unset), current.get(key, unset))
        for key in sorted({*saved, *current})
        if saved.get(key, unset) != current.get(key, unset)
    }
    old_path = changes.get("load_parameters_path", ("", ""))[0]
    # The same folder spelled differently is no change; a relative path saved by an older grpax cannot be
    # compared (it was relative to the folder that run started in), so it is not held against the resume.
    if old_path and (
        not Path(old_path).is_absolute()
        or Path(old_path).resolve() == Path(cfg.load_parameters_path).resolve()
    ):
        del changes["load_parameters_path"]
    fixed = [key for key in RESUME_FIXED_KEYS if key in changes and key in saved]
    if fixed:
        listed = ", ".join(f"{key}={changes[key][0]!r} (now {changes[key][1]!r})" for key in fixed)
        raise ConfigError(
            f"run {paths.run_dir} was started with {listed}; a resumed run cannot change "
            f"{', '.join(fixed)}: pass the saved values to continue it, or pass a new run_name"
        )
    # After the refusal: a resume that does not happen has no learning rate to jump.
    warn_on_schedule_change(saved, current, changes, latest)
    return changes


# The keys the learning-rate schedule is built from (``grpax.rl.optim.optimizer_from_config``).
SCHEDULE_KEYS = (
    "learning_rate",
    "num_batches",
    "learning_rate_schedule_steps",
    "num_iterations",
    "warmup_ratio",
    "lr_schedule",
    "end_lr_ratio",
)


def warn_on_schedule_change(saved: dict, current: dict, changes: dict, step: int) -> None:
    """Warns (one line) when a resume's changed keys rebuild the learning-rate schedule so that the rate at
    ``step`` differs from the saved run's: a longer run's cosine restarts its decay from higher up, a new
    ``learning_rate`` jumps at once."""
    from grpax.rl.config import schedule_steps
    from grpax.rl.optim import make_lr_schedule

    changed = [k for k in SCHEDULE_KEYS if k in changes]
    if not changed:
        return

    def rate(c: dict) -> float:
        iters, length = int(c.get("num_iterations", 1)), int(c.get("learning_rate_schedule_steps", -1))
        schedule = make_lr_schedule(
            float(c["learning_rate"]),
            schedule_steps(int(c["num_batches"]), length, iters),
            warmup_ratio=float(c.get("warmup_ratio", 0.0)),
            schedule=str(c.get("lr_schedule", "cosine")),
            end_lr_ratio=float(c.get("end_lr_ratio", 0.0)),
        )
        return float(schedule(step * iters))

    try:
        before, after = rate(saved), rate(current)
    except (KeyError, TypeError, ValueError):  # a config.json of an older grpax: nothing to compare
        return
    if abs(after - before) > 1e-6 * max(abs(before), abs(after), 1e-30):
        log.warning(
            "resuming at step %d with changed %s: the learning-rate schedule is rebuilt, so the learning rate "
            "jumps from %.3g (the saved run's schedule) to %.3g at this step",
            step,
            ", ".join(f"{k} ({changes[k][0]!r} -> {changes[k][1]!r})" for k in changed),
            before,
            after,
        )


def write_config(paths: RunPaths, cfg: TrainConfig) -> None:
    """Writes ``config.json`` atomically (other processes may read it to check a resume)."""
    tmp = paths.run_dir / "config.json.tmp"
    tmp.write_text(json.dumps(config_record(cfg), indent=2) + "\n")
    tmp.replace(paths.run_dir / "config.json")


def write_model_files(folder: Path, model_cfg: ModelConfig, tokenizer: Any) -> None:
    """config.json and tokenizer beside the actor checkpoints, so ``load_model`` finds them."""
    if jax.process_index() != 0 or (folder / "config.json").exists():
        return
    tmp = folder.with_name(folder.name + ".tmp-model-files")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(
            json.dumps(to_hf_config(model_cfg, model_cfg.weight_dtype), indent=2)
        )
        save_tokenizer(tokenizer, tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        code = re.search(
            r"os error (\d+)", str(e)
        )  # tokenizers' Rust writer: a bare Exception on a full disk
        if isinstance(e, OSError) or code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(tmp)) from None
    folder.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        item.rename(folder / item.name)
    tmp.rmdir()


def restore_or_start(
    cfg: TrainConfig,
    paths: RunPaths,
    main_process: bool,
    checkpointer: TrainCheckpointer,
    writer: MetricsWriter,
    state: TrainState,
    iterator: PromptIterator,
    changes: dict[str, tuple[Any, Any]],
) -> tuple[TrainState, int, dict | None]:
    """Restores the latest checkpoint into ``state`` and ``iterator``, or prepares a fresh start.

    Args:
      changes: ``check_resume``'s changed keys (recorded in ``config_changes.jsonl`` once restored).

    Returns:
      (state, the step to start from, the saved "before" evaluation summary or None).

    Raises:
      ConfigError: the saved data position is past the end of the training prompts (a smaller dataset).
    """
    latest = checkpointer.latest_step()
    if latest is None:
        # A fresh start re-runs everything: lines of an attempt killed before its first checkpoint go.
        if stale := len(writer.records()):
            log.warning(
                "%s has no checkpoint: starting afresh, its %d metrics lines (and TensorBoard points) are dropped",
                paths.run_dir,
                stale,
            )
        writer.truncate_after(-1)
        if main_process:
            paths.run_dir.mkdir(parents=True, exist_ok=True)
            write_config(paths, cfg)
        return state, 0, None
    new_params, opt_state, meta = checkpointer.restore(latest, state.params, state.opt_state)
    # The step placed as the fresh state's (the update's output placement): no second compile of the update.
    step = jax.device_put(jnp.asarray(meta["optimizer_step"], jnp.int32), state.step.sharding)
    state = TrainState(params=new_params, opt_state=opt_state, step=step)
    try:
        iterator.load_state_dict(meta["iterator"])
    except ValueError:  # a smaller dataset than the run was trained on
        key, dataset = cfg.train_dataset()
        raise ConfigError(
            f"run {paths.run_dir} stopped at prompt {meta['iterator']['index']} of an epoch of its training prompts, "
            f"past the {len(iterator.rows)} prompts of {key}={dataset!r} (train_split="
            f"{cfg.train_split!r}) now: resume with the dataset it was trained on (a larger one continues at the "
            "saved position), or pass a new run_name"
        ) from None
    start_step = meta["step"]
    # A finished run (start_step == num_batches) is evaluated again: its old "after" line goes too.
    writer.truncate_after(start_step, drop_eval_at_step=start_step == cfg.num_batches)
    if changes and main_process:
        record = {"step": start_step, "time": round(time.time(), 3), "changes": changes}
        with (paths.run_dir / "config_changes.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        write_config(paths, cfg)
    elif main_process and not (paths.run_dir / "config.json").exists():  # so later resumes can be checked
        write_config(paths, cfg)
    log.info("resumed %s from step %d", paths.checkpoints, start_step)
    return state, start_step, meta.get("eval_before")
