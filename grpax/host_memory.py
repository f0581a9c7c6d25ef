"""Host memory handed back to the OS between phases (glibc ``malloc_trim``).

A leaf module: the sampler, the evaluation and the trainer call it between the phases of a job, and none of them
may import another's layer for it. XLA:CPU allocates and frees buffers of every size at each phase (a decode
phase's KV cache, a prefill's unstacked weights, an update's gradients); glibc keeps freed blocks below its mmap
threshold in its arenas, so without a trim the process's resident memory grows to the sum of the phases' peaks
instead of their maximum, and a phase that needs larger blocks than the last one's cannot reuse their holes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def release_host_memory() -> None:
    """Hands freed heap memory back to the OS (glibc ``malloc_trim``), where the C library has it; a no-op
    elsewhere (musl, macOS)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
