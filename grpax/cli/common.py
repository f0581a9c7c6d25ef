"""Helpers shared by the command-line modules: hardware selection and multi-host start-up."""

from __future__ import annotations

import logging
import os

from grpax.config import ConfigError

log = logging.getLogger(__name__)

HARDWARE = ("cpu", "gpu", "tpu", "gpu_multiprocess")
# Environment variables that mean "this process is one of several" (JAX's cluster auto-detection reads them).
_MULTIHOST_ENV = (
    "JAX_COORDINATOR_ADDRESS",
    "COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


def select_hardware(hardware: str) -> None:
    """Validates ``hardware`` and sets ``JAX_PLATFORMS`` from it unless the user already set it.

    Must run before JAX initialises a backend.

    Raises:
      ConfigError: if ``hardware`` is not one of cpu, gpu, tpu, gpu_multiprocess.
    """
    if hardware not in HARDWARE:
        raise ConfigError(f"hardware={hardware!r}: expected one of {', '.join(HARDWARE)}")
    if not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = {"gpu_multiprocess": "cuda"}.get(
            hardware, "cuda" if hardware == "gpu" else hardware
        )


def maybe_initialize_distributed(skip: bool) -> bool:
    """Calls ``jax.distributed.initialize()`` when not ``skip`` and a multi-host environment is detected.

    Args:
      skip: MaxText's ``skip_jax_distributed_system``; True never initialises.

    Returns:
      Whether ``jax.distributed.initialize()`` was called.
    """
    if skip:
        return False
    present = [name for name in _MULTIHOST_ENV if os.environ.get(name)]
    if not present:
        return False
    import jax

    log.info("initialising jax.distributed (found %s)", ", ".join(present))
    jax.distributed.initialize()
    return True
