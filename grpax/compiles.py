"""Which programs a command compiles, in which phase, and for how long: the compile ledger.

A leaf module (it imports nothing of grpax). JAX reports each program it obtains, compiled by the backend or read
back from the persistent compilation cache, as one ``/jax/core/compile/backend_compile_duration`` event naming
the function; a cache hit is reported just before as ``/jax/compilation_cache/cache_hits``. ``CompileLog``
listens to both and files each program under the current phase (``phase``: "fit check", "eval before",
"step 1", ...), so that a run can say what each phase compiled (``summary``) and a test can assert that the
steady state compiles nothing (``compiled_in``). The same events back ``JAX_LOG_COMPILES=1``'s log lines; this
keeps them as data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
from jax._src import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def effort_options(effort: float) -> tuple[tuple[str, float], ...]:
    """``jax.jit``'s ``compiler_options`` (as pairs) for XLA's run-time effort ``effort`` in [-1, 1] (JAX's
    ``jax_exec_time_optimization_effort``: lower compiles faster and runs slower); () on a JAX without that
    setting (jax 0.11 has no float efforts): the compiler's default."""
    if not hasattr(jax.config, "jax_exec_time_optimization_effort"):
        return ()
    return (("exec_time_optimization_effort", float(effort)),)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program obtained: its phase, function name, seconds (the compile, or the cache read) and whether it
    was read from the persistent cache."""

    phase: str
    name: str
    seconds: float
    cached: bool


class CompileLog:
    """Records the programs JAX obtains while it is open (a context manager; ``phase`` names the current phase).

    Example:
      >>> with CompileLog() as programs:
      ...     with programs.phase("step 1"):
      ...         jax.jit(lambda x: x + 1)(1.0)
      >>> programs.summary()["step 1"]["programs"]
      1
    """

    def __init__(self):
        self.programs: list[Program] = []
        self._phase = "start"
        self._hits = threading.local()

    def __enter__(self) -> CompileLog:
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_listener(self._event)
        monitoring.unregister_event_duration_listener(self._duration)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Files the programs obtained inside under ``name`` (then the phase before it again)."""
        before, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = before

    def _event(self, name: str, **_) -> None:
        if name == CACHE_HIT_EVENT:
            self._hits.pending = True

    def _duration(self, name: str, seconds: float, fun_name: str = "?", **_) -> None:
        if name == COMPILE_EVENT:
            cached = getattr(self._hits, "pending", False)
            self._hits.pending = False
            name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name  # jit(admit) -> admit
            self.programs.append(Program(self._phase, name, float(seconds), cached))

    def compiled_in(self, phase: str) -> list[Program]:
        """The programs of ``phase`` the backend compiled (not read from the cache)."""
        return [p for p in self.programs if p.phase == phase and not p.cached]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase, in order: ``programs`` obtained, of them ``compiled`` by the backend and ``cached`` (read
        back), and ``seconds`` spent on both."""
        out: dict[str, dict[str, float]] = {}
        for p in self.programs:
            row = out.setdefault(p.phase, {"programs": 0, "compiled": 0, "cached": 0, "seconds": 0.0})
            row["programs"] += 1
            row["cached" if p.cached else "compiled"] += 1
            row["seconds"] += p.seconds
        return out

    def table(self) -> str:
        """``summary`` as aligned text lines, one per phase, with the largest programs named."""
        lines = []
        for phase, row in self.summary().items():
            largest = sorted((p for p in self.programs if p.phase == phase), key=lambda p: -p.seconds)[:3]
            names = ", ".join(
                f"{p.name} {p.seconds:.1f} s" + (" (cache)" if p.cached else "") for p in largest
            )
            lines.append(
                f"{phase:<14} {row['programs']:>3} programs ({row['compiled']} compiled, {row['cached']} from the "
                f"cache) {row['seconds']:7.1f} s; largest: {names}"
            )
        return "\n".join(lines)
