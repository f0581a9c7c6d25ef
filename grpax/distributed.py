"""Multi-process (multi-host) start-up: ``jax.distributed.initialize`` from keys or the environment.

One Python process runs per host (per TPU VM, per GPU node, or several on one machine for CPU tests); all of
them run the same program over one global mesh (``grpax.sharding.create_mesh``). Each process reads only its
own rows of the data (``local_rows``) and ``grpax.sharding.shard_batch`` assembles the global batch.

Resolution order, as MaxText's ``skip_jax_distributed_system`` / ``jax_distributed_initialization`` keys:
``skip`` wins; explicit arguments; then ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``; then JAX's own cluster auto-detection when a launcher's variables are set (SLURM, Open
MPI, ``COORDINATOR_ADDRESS``, multislice ``MEGASCALE_*``) or on a Cloud TPU VM. Otherwise the run is
single-process and nothing is initialised. Must run before anything touches a JAX device.

``fetch`` reads arrays that span several processes back to every host (``process_allgather``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

# (TPU_SKIP_MDS_QUERY is not one: it is set in non-TPU environments too.)
_TPU_ENV_VARS = ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE")
# Launchers whose environment JAX's cluster auto-detection reads (``jax.distributed.initialize()``).
_CLUSTER_ENV_VARS = (
    "COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


def _on_cloud_tpu() -> bool:
    """True on a TPU VM, judged without starting a JAX backend (which would make initialize fail)."""
    if any(os.environ.get(v) for v in _TPU_ENV_VARS):
        return True
    return Path("/dev/accel0").exists() or Path("/dev/vfio/0").exists()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _cluster_env() -> list[str]:
    """Names of the set environment variables of a multi-process launcher that JAX auto-detects."""
    return [name for name in _CLUSTER_ENV_VARS if os.environ.get(name)]


def maybe_initialize(
    skip: bool = False,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts JAX's multi-process runtime when the run spans several processes (the one implementation).

    Every command calls this before anything touches a JAX device.

    Args:
      skip: ``skip_jax_distributed_system=true``: never initialise.
      coordinator_address: ``host:port`` of process 0 (default ``$JAX_COORDINATOR_ADDRESS``).
      num_processes: total processes (default ``$JAX_NUM_PROCESSES``).
      process_id: this process, 0..num_processes-1 (default ``$JAX_PROCESS_ID``).

    Returns:
      True when the distributed runtime is (now or already) initialised, False for a single-process run.

    Raises:
      ValueError: a process count or id without the other two values, or a non-integer variable.
    """
    if skip:
        log.debug("skip_jax_distributed_system=true: not initialising jax.distributed")
        return False
    if jax.distributed.is_initialized():
        return True
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    count = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if count is not None and count <= 1 and not address:
        return False
    cluster = _cluster_env()
    if count is None and pid is None and not address and not cluster and not _on_cloud_tpu():
        return False
    # Collectives between CPU processes (tests, CPU hosts) need gloo; it only affects the CPU client.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if count is not None or pid is not None:
        if not (address and count is not None and pid is not None):
            raise ValueError(
                "multi-process run needs coordinator_address, num_processes and process_id together "
                f"(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); got {address=}, "
                f"{count=}, {pid=}"
            )
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=pid)
    elif coordinator_address:
        jax.distributed.initialize(coordinator_address=coordinator_address)  # the launcher gives the rest
    else:
        # JAX reads $JAX_COORDINATOR_ADDRESS itself and takes the process count and id from the launcher
        # (SLURM, Open MPI, Kubernetes) or the TPU metadata server.
        log.info("initialising jax.distributed (found %s)", ", ".join(cluster) or "a Cloud TPU VM")
        jax.distributed.initialize()
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def fetch(tree: Any) -> Any:
    """The full host value (numpy) of every array leaf, also of arrays that span other processes' devices.

    A leaf that is not fully addressable (a global array sharded over several processes) is gathered with
    ``multihost_utils.process_allgather`` (a collective: every process must call ``fetch`` on the same
    arrays in the same order); other leaves go through ``np.asarray``. Non-array leaves are returned as is.
    """

    def one(x):
        if isinstance(x, jax.Array):
            if x.is_fully_addressable or x.is_fully_replicated:
                return np.asarray(x)
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x) if isinstance(x, np.ndarray) else x

    return jax.tree.map(one, tree)


def local_rows(global_rows: int) -> slice:
    """This process's contiguous share of a global batch of ``global_rows`` rows.

    Process p gets rows ``[p * n, (p + 1) * n)`` with ``n = global_rows / process_count()``; passing those
    rows to ``grpax.sharding.shard_batch`` rebuilds the global batch in row order.

    Raises:
      ValueError: if ``global_rows`` is not a multiple of the process count.
    """
    count = jax.process_count()
    if global_rows % count:
        raise ValueError(f"global batch of {global_rows} rows does not split over {count} processes")
    n = global_rows // count
    start = jax.process_index() * n
    return slice(start, start + n)
