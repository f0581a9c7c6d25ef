"""Helpers shared by the command-line modules: hardware selection and JAX's persistent compilation cache."""

from __future__ import annotations

import logging
import os

from grpax.config import JAX_CACHE_DIR_HELP, ConfigError  # noqa: F401 - the key's doc, for its users

HARDWARE = ("cpu", "gpu", "tpu", "gpu_multiprocess")
log = logging.getLogger("grpax")


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


def compilation_cache_dir(jax_cache_dir: str) -> str | None:
    """The folder of JAX's persistent compilation cache for the key ``jax_cache_dir`` (``JAX_CACHE_DIR_HELP``);
    None when it is off."""
    if not jax_cache_dir.strip():
        return None
    if jax_cache_dir == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "grpax", "jax")
    return os.path.expanduser(jax_cache_dir)


def enable_compilation_cache(jax_cache_dir: str) -> str | None:
    """Points JAX's persistent compilation cache at ``compilation_cache_dir(jax_cache_dir)`` (None: off).

    Call it before the first compilation (JAX reads the folder once). JAX keeps programs that took at least
    ``jax_persistent_cache_min_compile_time_secs`` (1 s) to compile. A folder that cannot be created turns the
    cache off with one warning: a run never fails for its cache.

    Returns:
      The folder in use, or None.
    """
    import jax

    path = compilation_cache_dir(jax_cache_dir)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            log.warning(
                "jax_cache_dir=%s: cannot create %s (%s): no compilation cache", jax_cache_dir, path, e
            )
            path = None
    jax.config.update("jax_compilation_cache_dir", path)
    return path
