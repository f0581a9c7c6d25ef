"""Helpers shared by the command-line modules: hardware selection and multi-host start-up."""

from __future__ import annotations

import os

from grpax.config import ConfigError

HARDWARE = ("cpu", "gpu", "tpu", "gpu_multiprocess")


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
    """Starts ``jax.distributed`` for a multi-process run: ``grpax.distributed.maybe_initialize(skip)``.

    Every command initialises through ``grpax.distributed.maybe_initialize`` (the one implementation: JAX_*
    variables, launcher auto-detection, Cloud TPU); this name stays for the CLI modules.

    Args:
      skip: MaxText's ``skip_jax_distributed_system``; True never initialises.

    Returns:
      Whether the distributed runtime is initialised.
    """
    from grpax import distributed

    return distributed.maybe_initialize(skip)
