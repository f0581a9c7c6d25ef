"""The frozen reference policy's params (host memory is handed back between phases by ``grpax.host_memory``).

The reference model (beta > 0) is a second copy of the weights that only the reference pass reads (the trainer
stores it rounded to the compute dtype, as the forward reads it: ``grpax.models.llama.round_as_read``). On a CPU
host, where "device" memory is the process's own, ``FrozenParams`` writes it once to raw files and maps them
at each use: the pages are read for the reference pass and unmapped after it, so the copy holds no memory
while the sampler and the update run (a 135M-parameter float32 model: 0.54 GB of the 4 GB the CPU job fits
in). On accelerators (or with several processes) the params stay on the devices, or with
``reference_memory=pinned_host`` in the host's memory (JAX's ``pinned_host`` memory kind): copied to the devices
for each reference pass and dropped after it, so the devices hold them only during that pass (Llama 3.1 8B
in bfloat16: 15 GiB less on one GPU for the update, 16 GB over the host link per step).
"""

from __future__ import annotations

import errno
import gc
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from grpax.host_memory import release_host_memory  # noqa: F401  (the trainer's and the rollout's import)


class FrozenParams:
    """Params that never change, held on the devices, in host memory, or memory-mapped from ``folder``.

    Args:
      params: the params tree (kept as it is in device memory: pass a copy if the caller donates its own).
      folder: where to write the leaves (created, emptied first); None keeps them in memory. Map them
        only on a single CPU process: ``jax.device_put`` of a mapped file then reads it in place.
      host_memory: keep them in the host's pinned memory (each leaf placed as before, ``memory_kind`` pinned_host)
        and copy them to the devices for each ``apply`` only (no ``folder``).
    """

    def __init__(self, params: Any, folder: Path | None = None, host_memory: bool = False):
        self.folder = folder
        self._devices = None  # with host_memory: each leaf's placement on the devices
        if folder is None:
            if host_memory:
                self._devices = jax.tree.map(lambda x: x.sharding, params)
                params = jax.tree.map(
                    lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), params
                )
            self._params = params
            return
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        # Removed when this object goes, at exit, or by close(); a killed run's folder goes at its next start.
        self._remove = weakref.finalize(self, shutil.rmtree, folder, True)
        leaves, self._treedef = jax.tree.flatten(params)
        self._leaves = []  # (file, shape, dtype, sharding)
        for i, leaf in enumerate(leaves):
            path = folder / f"{i}.npy"
            try:  # raw bytes: np.load cannot map an extension dtype such as bfloat16
                np.save(path, np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8))
            except OSError as e:  # numpy says only "N requested and M written" on a full disk
                self._remove()
                raise OSError(
                    errno.ENOSPC,
                    f"writing the reference model's copy ({leaf.nbytes / 1e9:.2f} GB for this weight) failed: "
                    f"{e}; it needs the model's size free in the run folder",
                    str(path),
                ) from None
            self._leaves.append((path, leaf.shape, leaf.dtype, leaf.sharding))

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(params, *args, **kwargs)``, waited for; mapped leaves are unmapped, and leaves held in host
        memory dropped from the devices, before it returns."""
        if self._devices is not None:
            params = jax.device_put(self._params, self._devices)  # host -> devices, for this pass only
            try:
                return jax.block_until_ready(fn(params, *args, **kwargs))
            finally:
                del params
        if self.folder is None:
            return jax.block_until_ready(fn(self._params, *args, **kwargs))
        params = jax.tree.unflatten(
            self._treedef,
            [
                jax.device_put(np.load(path, mmap_mode="r").view(dtype).reshape(shape), sharding)
                for path, shape, dtype, sharding in self._leaves
            ],
        )
        try:
            return jax.block_until_ready(fn(params, *args, **kwargs))
        finally:
            del params
            gc.collect()  # an array aliasing a mapped file is freed by the cycle collector, not at its last use

    def close(self) -> None:
        """Removes the mapped files (a no-op in device memory)."""
        if self.folder is not None:
            self._remove()


def offload_folder(run_dir: Path) -> Path | None:
    """Where to map the reference params: ``<run_dir>/.reference`` on a single CPU process, else None."""
    if jax.process_count() == 1 and jax.default_backend() == "cpu":
        return run_dir / ".reference"
    return None
