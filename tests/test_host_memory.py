"""grpax.host_memory: the commands keep large blocks out of glibc's heap (``limit_heap_blocks``) and warn before
XLA's compiled programs hold the process's last memory mappings (``watch_memory_mappings``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import subprocess
import sys

import pytest

from grpax import host_memory

_LIBC = ctypes.util.find_library("c")

# Mallocs a 16 MiB block and frees it (glibc then raises its mmap threshold to 16 MiB unless it was fixed), then
# prints how many bytes a 4 MiB block adds to the mapped blocks (mallinfo2's hblkhd): 0 if it came from the heap.
_PROBE = """
import ctypes, ctypes.util, sys
from grpax.host_memory import limit_heap_blocks
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "limited":
    assert limit_heap_blocks()
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


def _mapped_bytes_of_a_4_mib_block(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(
    _LIBC is None or not hasattr(ctypes.CDLL(_LIBC), "mallinfo2"), reason="glibc >= 2.33 (mallinfo2) only"
)
def test_limit_heap_blocks_maps_a_block_the_heap_would_otherwise_keep():
    assert _mapped_bytes_of_a_4_mib_block("default") == 0  # glibc's raised threshold: carved from the heap
    assert _mapped_bytes_of_a_4_mib_block("limited") >= 4 << 20  # mapped on its own, unmapped when freed


def test_the_grpax_command_limits_heap_blocks_before_it_imports_the_command(monkeypatch):
    import grpax.cli.main as cli

    calls = []
    monkeypatch.setattr(cli, "limit_heap_blocks", lambda: calls.append("limit"))
    real_import = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: calls.append(name) or real_import(name))
    cli.main(["to_native", "--help"])
    assert calls[:2] == ["limit", "grpax.cli.to_native"]


@pytest.mark.skipif(host_memory.memory_mappings() is None, reason="Linux's /proc only")
def test_a_compiled_program_holds_memory_mappings_while_it_lives():
    # XLA:CPU links each kernel on pages of its own: what a long warm-up runs out of (vm.max_map_count).
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((8, 16))
    lowered = jax.jit(lambda a, i: [a.at[i].set(k) for k in range(10)]).lower(x, jnp.arange(2))
    before, limit = host_memory.memory_mappings()
    compiled = lowered.compile()
    held, _ = host_memory.memory_mappings()
    assert limit > 0 and held - before >= 10 * 2  # ten scatter kernels: code and data pages each
    del compiled


def test_a_compile_past_half_the_mappings_limit_warns_once(monkeypatch, caplog):
    import jax.monitoring

    monkeypatch.setattr(host_memory, "_watching", False)
    held = [1000]
    monkeypatch.setattr(host_memory, "memory_mappings", lambda: (held[0], 65530))
    listeners = []
    monkeypatch.setattr(jax.monitoring, "register_event_duration_secs_listener", listeners.append)
    host_memory.watch_memory_mappings()
    host_memory.watch_memory_mappings()  # idempotent
    assert len(listeners) == 1
    compiled = "/jax/core/compile/backend_compile_duration"
    with caplog.at_level(logging.WARNING, logger="grpax.host_memory"):
        listeners[0](compiled, 0.1)
        held[0] = 40000
        listeners[0]("/jax/core/compile/jaxpr_trace_duration", 0.1)  # not a compile
        assert not caplog.records
        listeners[0](compiled, 0.1)
        listeners[0]("/jax/compilation_cache/cache_retrieval_time_sec", 0.1)
    assert len(caplog.records) == 1
    assert "40000 memory mappings, over 50% of the kernel's limit (vm.max_map_count=65530)" in caplog.text


@pytest.mark.skipif(host_memory.available_host_bytes() is None, reason="Linux's /proc only")
def test_available_host_bytes_heeds_an_address_space_limit():
    # ulimit -v: an engine sized from MemAvailable alone met a MemoryError instead of its one-line refusal
    probe = (
        "import resource; from grpax.host_memory import available_host_bytes as a;"
        "size = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'));"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.RLIM_INFINITY)); print(a())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert 0 <= int(out.stdout) <= 64 << 20
