"""Host memory handed back to the OS between phases (glibc ``malloc_trim``), and large blocks kept out of the
heap (glibc ``mallopt``).

A leaf module: the sampler, the evaluation and the trainer call it between the phases of a job, and none of them
may import another's layer for it. XLA:CPU allocates and frees buffers of every size at each phase (a decode
phase's KV cache, a prefill's unstacked weights, an update's gradients); glibc keeps freed blocks below its mmap
threshold in its arenas, so without a trim the process's resident memory grows to the sum of the phases' peaks
instead of their maximum, and a phase that needs larger blocks than the last one's cannot reuse their holes.
``limit_heap_blocks`` goes further for the commands: blocks of 1 MiB and more (every array XLA:CPU allocates that
matters) are mapped and unmapped on their own instead of carved out of the arenas (glibc otherwise raises that
threshold to 32 MiB as blocks are freed, so an update's gradients and activations land in the arenas' holes
and stay resident), and at most two arenas are created for XLA's threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


# mallopt's parameters (glibc's malloc.h).
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8
MMAP_THRESHOLD_BYTES = 1 << 20


def limit_heap_blocks() -> bool:
    """Maps blocks of ``MMAP_THRESHOLD_BYTES`` or more outside the heap and caps the arenas at 2 (glibc
    ``mallopt``), so host memory follows the live arrays instead of the sum of the phases' holes; call it once,
    before JAX starts its threads. Returns whether the C library took both settings (False off glibc: a no-op).
    """
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) & bool(mallopt(_M_ARENA_MAX, 2))


def release_host_memory() -> None:
    """Hands freed heap memory back to the OS (glibc ``malloc_trim``), where the C library has it; a no-op
    elsewhere (musl, macOS)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
