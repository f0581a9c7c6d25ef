"""How much of a training run's update survives an export's dtype.

Training keeps float32 weights (the master copy AdamW updates); ``grpax to_huggingface`` writes ``weight_dtype``,
bfloat16 by default, whose 8 significant bits hold a weight of magnitude m only to about m / 256. A short run
(or one at a small learning rate) changes most weights by less than half that spacing, and rounding puts them
back where the base's own export has them: 2 steps at the seed's learning rate of 3e-6 changed all but a few of
SmolLM2-135M's weights, of which 4% still differed from the base in bfloat16 (issue 45).

``measure`` compares the trained weights ``t`` with the weights ``b`` the run started from, both rounded to the
export's dtype as R(t) and R(b) (what a user sees comparing the two exports):

* ``changed``: the weights with t != b; ``kept``: those of them with R(t) != R(b).
* ``relative_error``: || (R(t) - R(b)) - (t - b) || / || t - b ||, the exported update's error relative to the
  trained update (0: exported exactly; 1: as far from the trained update as no update at all, the base's own
  export). Rounding to nearest keeps the update's direction on average (a weight crosses a rounding boundary
  with probability about |t - b| / spacing), but each crossing moves it by a whole spacing, so below the
  spacing the export's update is mostly rounding noise.

The export warns when fewer than half of the changed weights are kept, or the error is at least the update's
own size (``RoundingReport.lost``), and names the fix: ``weight_dtype=float32``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_CHUNK = 1 << 24  # elements compared in one call (float32 temporaries of 64 MB each): an 8B leaf fits


@dataclasses.dataclass(frozen=True)
class RoundingReport:
    """The part of a run's update that an export in ``dtype`` keeps (the module docstring defines the fields).

    Attributes:
      base: what the trained weights were compared with (a path, and how it was found).
      dtype: the export's dtype (``weight_dtype``).
      total: weights compared.
      changed: weights the training changed (t != b).
      kept: changed weights that still differ from the base after both are rounded to ``dtype``.
      relative_error: || (R(t) - R(b)) - (t - b) || / || t - b || (0 with no change at all).
    """

    base: str
    dtype: str
    total: int
    changed: int
    kept: int
    relative_error: float

    @property
    def kept_fraction(self) -> float:
        return self.kept / self.changed if self.changed else 1.0

    @property
    def lost(self) -> bool:
        """Most of the update is lost: under half of the changed weights kept, or an error of a whole update."""
        return self.changed > 0 and (self.kept_fraction < 0.5 or self.relative_error >= 1.0)

    def line(self) -> str:
        """One line: how much of the training the export keeps."""
        if not self.changed:
            return f"no weight differs from {self.base}: nothing trained to keep"
        return (
            f"{self.kept_fraction:.1%} of the {self.changed:,} weights training changed (of {self.total:,}) still "
            f"differ from {self.base} in {self.dtype}; the exported update's error is {self.relative_error:.3g}x "
            "the trained update's norm"
        )

    def warning(self, fix: str = "export with weight_dtype=float32") -> str:
        """The loud line of an export that loses the update, with ``fix``."""
        return (
            f"the {self.dtype} export loses most of the training: {self.line()}. The updates are below "
            f"{self.dtype}'s precision: {fix} to keep them"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kept_fraction": self.kept_fraction, "lost": self.lost}


@functools.partial(jax.jit, static_argnums=2)
def _chunk_stats(t: jax.Array, b: jax.Array, dtype: np.dtype) -> tuple[jax.Array, ...]:
    """Per row of [R, C] chunks: changed and kept counts, and the float32 sums of squares of the update and of
    the exported update's error (per row, so that each float32 sum is short; the caller adds them in float64).
    XLA's casts and reductions here run on every core, tens of times faster than numpy's bfloat16 casts."""
    t32, b32 = t.astype(jnp.float32), b.astype(jnp.float32)
    rt, rb = t.astype(dtype).astype(jnp.float32), b.astype(dtype).astype(jnp.float32)
    moved = t32 != b32
    delta = t32 - b32
    error = (rt - rb) - delta
    return (
        moved.sum(axis=1),
        (moved & (rt != rb)).sum(axis=1),
        (delta * delta).sum(axis=1),
        (error * error).sum(axis=1),
    )


def _exact(x: np.ndarray, dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds every value of ``x`` as it is and ``x``'s differences are finite: then R is the
    identity, every changed weight is kept and the exported update's error is exactly 0, as ``_chunk_stats``
    would count them (a float32 export of float32 or bfloat16 weights), with no program to compile."""
    if not np.can_cast(x.dtype, dtype, "safe"):
        return False
    # Below 2**127 a value is finite and so is any difference of two (float32's largest is just under 2**128).
    # (the largest and the smallest read in place: no |x| temporary of the weight's size)
    return x.size == 0 or bool(np.max(x) < 2.0**127 and np.min(x) > -(2.0**127))


def measure(trained: Any, base: Any, dtype: np.dtype, base_name: str) -> RoundingReport:
    """Compares ``trained`` with ``base`` rounded to ``dtype`` (the module docstring's measures).

    Counts are exact; the norms are float32 sums along each weight's last axis, added in float64. When
    ``dtype`` keeps both trees exactly (``_exact``), only the changed weights are counted, with numpy.

    Args:
      trained: the params to export (numpy leaves, any float dtype).
      base: the params the run started from, the same tree and shapes as ``trained``.
      dtype: the export's numpy dtype (bfloat16 as ``ml_dtypes.bfloat16``).
      base_name: how ``base`` is named in the report's lines.

    Raises:
      ValueError: the trees differ in structure or in a leaf's shape (another model).
    """
    t_leaves, t_tree = jax.tree.flatten(trained)
    b_leaves, b_tree = jax.tree.flatten(base)
    if t_tree != b_tree:
        raise ValueError(f"{base_name} holds another params tree than the checkpoint exported")
    pairs = [(np.asarray(t), np.asarray(b)) for t, b in zip(t_leaves, b_leaves, strict=True)]
    for t, b in pairs:
        if t.shape != b.shape:
            raise ValueError(
                f"{base_name} has a weight of shape {list(b.shape)} where the checkpoint has {list(t.shape)}"
            )
    total = sum(t.size for t, _ in pairs)
    if all(_exact(t, dtype) and _exact(b, dtype) for t, b in pairs):
        changed = sum(int(np.count_nonzero(t != b)) for t, b in pairs)
        return RoundingReport(base_name, str(np.dtype(dtype)), total, changed, changed, 0.0)
    changed = kept = 0
    delta_sq = error_sq = 0.0
    for t, b in pairs:
        cols = t.shape[-1] if t.ndim else 1
        t2, b2 = t.reshape(-1, cols), b.reshape(-1, cols)
        rows = max(1, _CHUNK // cols)
        for start in range(0, t2.shape[0], rows):
            stats = _chunk_stats(t2[start : start + rows], b2[start : start + rows], np.dtype(dtype))
            moved, kept_rows, d2, e2 = (np.asarray(x) for x in stats)
            changed += int(moved.sum(dtype=np.int64))
            kept += int(kept_rows.sum(dtype=np.int64))
            delta_sq += float(d2.sum(dtype=np.float64))
            error_sq += float(e2.sum(dtype=np.float64))
    relative = float(np.sqrt(error_sq / delta_sq)) if delta_sq > 0 else 0.0
    return RoundingReport(base_name, str(np.dtype(dtype)), total, changed, kept, relative)
