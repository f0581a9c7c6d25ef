"""A CPU kernel for decode attention, built from source at first use and called through the XLA FFI.

XLA:CPU runs the decode attention of ``cached_attention`` (one query per row over the KV cache) as generic
reductions and many tiny batched matmuls, about 4x over the time it takes to read the cache once; at batch 64
that was half of every decode step. ``kernels/decode_attention.cc`` reads only the filled slots of each row,
once, shared out over XLA's own intra-op threads (the role Pallas attention kernels play on TPU and GPU in
MaxText and Tunix). It is compiled with the machine's C++ compiler (``$CXX``, else ``g++``) for this CPU
(``-march=native``) into a cache folder keyed by source, jaxlib version, compiler flags and CPU; when no
compiler or FFI headers are found, ``available()`` says why (logged once) and the sampler keeps XLA's path.

Environment: ``GRPAX_KERNEL_CACHE`` sets the cache folder (default ``~/.cache/grpax/kernels``);
``GRPAX_CPU_KERNELS=0`` turns the kernel off.
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
import jax.numpy as jnp
import jaxlib.version

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "decode_attention.cc"
_TARGET = "grpax_decode_attention"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
MAX_GROUP = 8  # query heads per kv head the kernel supports


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    """Compiles the kernel (or finds it in the cache); returns the shared library's path.

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
        _SOURCE.read_bytes(),
        jaxlib.version.__version__.encode(),
        cxx.encode(),
        " ".join(_FLAGS).encode(),
    ):
        key.update(part)
    key.update(_cpu_signature().encode())
    cache = Path(os.environ.get("GRPAX_KERNEL_CACHE") or Path.home() / ".cache" / "grpax" / "kernels")
    lib = cache / key.hexdigest()[:16] / "libgrpax_decode_attention.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU decode-attention kernel: %s", lib)
    return lib


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernel once per process; returns None, or why it is unavailable."""
    if os.environ.get("GRPAX_CPU_KERNELS", "1") == "0":
        return "turned off by GRPAX_CPU_KERNELS=0"
    if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):
        return f"jax {jax.__version__} has no jax.ffi"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.GrpaxDecodeAttention), platform="cpu")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None


def available() -> bool:
    """True when the decode-attention kernel is built and registered (builds it on the first call)."""
    reason = _load()
    if reason is not None:
        _warn_once(reason)
    return reason is None


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("CPU decode-attention kernel unavailable, using XLA's attention: %s", reason)


def decode_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array) -> jax.Array:
    """One query per row over a KV cache in the decode layout, on CPU (``available()`` must be True).

    The same result as ``grpax.models.llama.cached_attention`` with T == 1 and mask ``slot <= position``
    (float32 accumulation; exp by a degree-6 polynomial, ~1e-7 relative).

    Args:
      q: float32 [B, K, G, H] queries, already rotated and scaled by 1/sqrt(H); G <= 8.
      cache_k: [B, K, H, S] keys; cache_v: [B, K, S, H] values; float32 or bfloat16 (both the same).
      positions: int32 [B]: row b attends to slots 0..positions[b] (clipped to 0..S-1).

    Returns:
      float32 [B, K, G, H].

    Raises:
      RuntimeError: the kernel could not be built (the reason in the message).
    """
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"the CPU decode-attention kernel is unavailable: {reason}")
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), cache_k, cache_v, positions.astype(jnp.int32)
    )
