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

Memory mappings are the other host limit: Linux lets a process hold ``vm.max_map_count`` of them (65,530 by
default), and XLA:CPU's JIT links every kernel of a compiled program on pages of its own (code r-x, constants
r--, data rw-: three mappings per kernel, held while the program lives; a 30-layer prefill program had ~400
kernels). At the limit the JIT fails ("LLVM compilation error: Cannot allocate memory") and the process then
crashes. ``watch_memory_mappings`` warns before that, after the compile that passes half the limit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

logger = logging.getLogger(__name__)

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


def available_host_bytes() -> int | None:
    """Bytes this process may still allocate on the host: the kernel's ``MemAvailable``, capped by what the
    address-space limit (``ulimit -v``, RLIMIT_AS) leaves above the process's size; None where ``/proc`` has no
    ``MemAvailable`` (off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        room = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        except (OSError, StopIteration, ValueError):
            size = 0
        room = min(room, max(0, limit - size))
    return room


def memory_mappings() -> tuple[int, int] | None:
    """``(mappings this process holds, the kernel's limit vm.max_map_count)``; None where ``/proc`` has neither
    (off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = f.read().count(b"\n")
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


_WARN_AT = (0.5, 0.75, 0.9)  # fractions of the limit: a warning the first time a compile passes each
# JAX's events after a program was compiled, or loaded from the persistent compilation cache (mapped alike).
_COMPILE_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    "/jax/compilation_cache/cache_retrieval_time_sec",
)


def watch_memory_mappings() -> None:
    """Logs a warning the first time an XLA compile leaves this process holding more than half, three quarters
    and nine tenths of its memory mappings (``memory_mappings``): the compile that passes the limit crashes the
    process. Idempotent; call it once per process (the commands do)."""
    import jax.monitoring

    global _watching
    if _watching or memory_mappings() is None:
        return
    _watching = True
    warned: set[float] = set()

    def check(event: str, duration: float, **kwargs) -> None:
        if event not in _COMPILE_EVENTS:
            return
        held, limit = memory_mappings() or (0, 1)
        passed = [f for f in _WARN_AT if held > f * limit and f not in warned]
        if passed:
            warned.update(passed)
            logger.warning(
                "this process holds %d memory mappings, over %d%% of the kernel's limit (vm.max_map_count=%d): "
                "XLA:CPU keeps 3 per kernel of every compiled program, and a compile at the limit crashes the "
                "process; compile fewer programs (fewer prompt buckets, slot counts, max_num_seqs) or raise the "
                "limit (sysctl -w vm.max_map_count=262144, as root)",
                held,
                round(100 * max(passed)),
                limit,
            )

    jax.monitoring.register_event_duration_secs_listener(check)


_watching = False
