"""grpax.host_memory: the commands keep large blocks out of glibc's heap (``limit_heap_blocks``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

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
