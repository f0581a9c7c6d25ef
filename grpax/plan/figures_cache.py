"""A compiled program's figures kept beside JAX's persistent compilation cache, so that a second fit check of
the same programs compiles nothing.

The fit check (``grpax.plan.compile_check``) needs of each program only its memory (``memory_analysis``) and
its collectives (read from its HLO). On a second run with the persistent cache warm, obtaining the executable
means reading it back (1-4 s a program on a TPU v5e host), and the run reads it again where it first calls it.
Here the figures are stored per lowered program, keyed by a SHA-256 of the lowered module's text, the devices
(platform, kind, count, the backend's version), JAX's version and XLA's effort settings (``COMPILE_SETTINGS``:
the key ``xla_optimization_level`` or JAX's variables; the same module compiles to other memory figures at
another level), as one small JSON file in ``<compilation cache>/grpax_figures/``: the same key means the same
program for the same compiler, so the same figures. No cache folder (``jax_cache_dir=''``): nothing is kept. A
damaged file is ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import jax

from grpax.plan.collectives import Collective
from grpax.plan.fit_report import Compiled

log = logging.getLogger("grpax.compile_check")
FOLDER = "grpax_figures"
# JAX's settings that go into every compile's options and change what the compiler builds (XLA's effort levels;
# a JAX without one of them, e.g. jax 0.11's no float efforts, keys by those it has)
COMPILE_SETTINGS = (
    "jax_optimization_level",
    "jax_memory_fitting_level",
    "jax_exec_time_optimization_effort",
    "jax_memory_fitting_effort",
)


def _folder() -> Path | None:
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / FOLDER if root else None


def program_key(lowered: jax.stages.Lowered, devices, options: tuple = ()) -> str:
    """The key of a lowered program for ``devices`` (hex SHA-256); ``options``: the compiler options it is
    jitted with (``jax.jit``'s ``compiler_options`` as (name, value) pairs)."""
    d = list(devices)[0]
    backend = getattr(getattr(d, "client", None), "platform_version", "")
    settings = "|".join(str(getattr(jax.config, name, "")) for name in COMPILE_SETTINGS)  # what this JAX has
    ident = f"{jax.__version__}|{d.platform}|{d.device_kind}|{len(list(devices))}|{backend}|{settings}|{options}\n"
    return hashlib.sha256((ident + lowered.as_text()).encode()).hexdigest()


def read(key: str) -> Compiled | None:
    """The figures stored under ``key``, or None (none stored, no cache folder, or an unreadable file)."""
    folder = _folder()
    if folder is None or not (folder / f"{key}.json").is_file():
        return None
    try:
        data = json.loads((folder / f"{key}.json").read_text())
        collectives = data.pop("collectives")
        if collectives is not None:
            collectives = {kind: Collective(**c) for kind, c in collectives.items()}
        return Compiled(**data, collectives=collectives)
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("ignoring the damaged figures file %s: %s", folder / f"{key}.json", e)
        return None


def write(key: str, compiled: Compiled) -> None:
    """Stores ``compiled``'s figures under ``key`` (atomically; a folder that cannot be written is skipped)."""
    folder = _folder()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(compiled)))
        os.replace(tmp, folder / f"{key}.json")
    except OSError as e:
        log.warning("could not keep the figures of %s in %s: %s", compiled.name, folder, e)
