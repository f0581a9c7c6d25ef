"""Ctrl-C (SIGINT) and SIGTERM end a grpax command cleanly: one line, exit 130 / 143, no half-written checkpoint.

Python's own handling is not enough for a JAX program. Its SIGINT raises KeyboardInterrupt wherever the main
thread is, and the exit that follows tears the interpreter down while native threads still run: an XLA
compilation on jaxlib's thread pool (``PjRtCompiler::CompileAndLoad``) then reads the destroyed client and the
process dies of a segmentation fault (exit 139), and Orbax's writer threads, finding their executor shut down,
print dozens of lines of tracebacks. SIGTERM kills at once, in the middle of a checkpoint write.

So the CLI runs each command inside ``handled()``: both signals raise ``Interrupted`` (a KeyboardInterrupt that
knows its signal), except inside ``deferred()`` (a checkpoint save), where the signal waits until the block ends;
a second signal during the save raises at once. The CLI then prints one line and ends the process with
``os._exit(128 + signal)``, skipping the interpreter teardown that races the native threads.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"deferring": 0, "pending": None}


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread for SIGINT or SIGTERM; ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:
    first = _state["pending"] is None
    if first:
        _state["pending"] = signum
    if _state["deferring"] and first:
        return
    # Python runs this handler at the main thread's next bytecode, which may be inside a garbage-collector
    # callback (jax's _xla_gc_callback), where the exception is dropped (``handled`` keeps it from printing):
    # the signal stays pending and ``raise_pending`` raises it again at the caller's next safe point.
    raise Interrupted(signum)


def raise_pending() -> None:
    """Raises ``Interrupted`` for a signal that arrived and whose exception was lost (see ``_on_signal``).

    Call it at safe points of a long loop (the trainer: after each step, before its metrics and checkpoint).
    """
    if _state["pending"] is not None and not _state["deferring"]:
        signum, _state["pending"] = _state["pending"], None
        raise Interrupted(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}
    previous_hook = sys.unraisablehook

    def quiet_lost_interrupt(unraisable) -> None:  # raise_pending raises it again: no traceback for it here
        if not isinstance(unraisable.exc_value, Interrupted):
            previous_hook(unraisable)

    sys.unraisablehook = quiet_lost_interrupt
    try:
        yield
    finally:
        _state["pending"] = None
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds back a signal that arrives inside the block (under ``handled``) and raises it when the block ends."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
        signum = None
        if not _state["deferring"]:
            signum, _state["pending"] = _state["pending"], None
    if signum is not None:
        raise Interrupted(signum)
