"""Builds the CPU kernels from source at first use and registers them with the XLA FFI.

The kernels (``kernels/*.cc``) are compiled with the machine's C++ compiler (``$CXX``, else ``g++``) for
this CPU (``-march=native``) into one library in a cache folder keyed by sources, jaxlib version, compiler
flags and CPU. When no compiler or FFI headers are found, ``available()`` says why (logged once) and the
sampler keeps XLA's ops (``grpax.sampler.backend.select_backend``).

Environment: ``GRPAX_KERNEL_CACHE`` sets the cache folder (default ``~/.cache/grpax/kernels``);
``GRPAX_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib.version

logger = logging.getLogger(__name__)

_KERNELS = Path(__file__).parent / "kernels"
_SOURCES = tuple(_KERNELS / name for name in ("decode_attention.cc", "matmul.cc", "packed_attention.cc"))
_HEADERS = (_KERNELS / "parallel.h", _KERNELS / "simd.h")
_FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
# FFI target name -> the library's handler symbol.
TARGETS = {
    "grpax_paged_attention_update": "GrpaxPagedAttentionUpdate",
    "grpax_matmul": "GrpaxMatmul",
    "grpax_pack": "GrpaxPack",
    "grpax_packed_attention": "GrpaxPackedAttention",
}


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    """Compiles the kernels (or finds them in the cache); returns the shared library's path.

    Raises:
      RuntimeError: no compiler, no FFI headers, or the compiler failed (its output in the message).
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    include = jax.ffi.include_dir()
    if not (Path(include) / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"XLA FFI headers not found under {include}")
    key = hashlib.sha256()
    # The FFI headers and the runtime the library is loaded into both come with jaxlib.
    for part in (
        *(path.read_bytes() for path in (*_SOURCES, *_HEADERS)),
        jaxlib.version.__version__.encode(),
        cxx.encode(),
        " ".join(_FLAGS).encode(),
    ):
        key.update(part)
    key.update(_cpu_signature().encode())
    cache = Path(os.environ.get("GRPAX_KERNEL_CACHE") or Path.home() / ".cache" / "grpax" / "kernels")
    lib = cache / key.hexdigest()[:16] / "libgrpax_cpu_kernels.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{include}", *map(str, _SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU kernels: %s", lib)
    return lib


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernels' shared library, built (or found in the cache) and loaded once per process."""
    return ctypes.cdll.LoadLibrary(str(_build()))


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernels once per process; returns None, or why they are unavailable."""
    if os.environ.get("GRPAX_CPU_KERNELS", "1") == "0":
        return "turned off by GRPAX_CPU_KERNELS=0"
    if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):
        return f"jax {jax.__version__} has no jax.ffi"
    try:
        lib = _library()
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None


def available() -> bool:
    """True when the CPU kernels are built and registered (builds them on the first call)."""
    reason = _load()
    if reason is not None:
        _warn_once(reason)
    return reason is None


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("CPU kernels unavailable, the sampler uses XLA's ops: %s", reason)


def require() -> None:
    """Builds and registers the kernels if needed; raises RuntimeError (with the reason) if they cannot be."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {reason}")
