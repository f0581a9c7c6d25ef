"""Helpers shared by the command-line modules: hardware selection."""

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
