"""Resumable GRPO training checkpoints (Orbax ``CheckpointManager``).

Layout under ``<base_output_directory>/<run_name>/checkpoints/``::

    config.json, tokenizer files          model description, so the actor loads on its own
    actor/<step>/model_params/            the actor's weights (``grpax to_huggingface load_parameters_path=...``)
    actor/<step>/opt_state/               optax state
    actor/<step>/train_meta/              JSON: step, data-iterator position, RNG seed, metrics history

Orbax writes each step into a temporary folder and renames it when complete, so an interrupted save (Ctrl-C,
a crash, a full disk) never shadows the last good step: ``latest_step`` only sees finished ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpax import interrupts


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
    """

    def __init__(
        self,
        directory: str | Path,
        max_to_keep: int = 3,
        use_zarr3: bool = True,
        use_ocdbt: bool = True,
        use_compression: bool = False,
    ):
        self.directory = Path(directory).absolute()
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
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True,  # the temporary folder of an abandoned save
        )
        self.manager = ocp.CheckpointManager(
            self.directory / "actor", options=options, handler_registry=registry
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Writes step ``step`` and waits until it is complete on disk.

        A Ctrl-C or SIGTERM during the write takes effect once it is complete (``grpax.interrupts``); a second
        one abandons it, and its temporary folder is removed when the run resumes.
        """
        with interrupts.deferred():
            self._save(step, params, opt_state, meta)

    def _save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                model_params=ocp.args.PyTreeSave(params),
                opt_state=ocp.args.PyTreeSave(opt_state),
                train_meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

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

        restored = self.manager.restore(
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
        return restored.model_params, restored.opt_state, dict(restored.train_meta)

    def step_dir(self, step: int) -> Path:
        return self.directory / "actor" / str(step)

    def close(self) -> None:
        self.manager.close()
