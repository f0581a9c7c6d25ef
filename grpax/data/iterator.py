"""The resumable prompt iterator: endless, seeded, shuffled batches of any task's rows.

Each epoch is a fresh permutation drawn from ``numpy.random.default_rng((seed, epoch))``, so a run that stops and
resumes (``state_dict`` / ``load_state_dict``, saved with each checkpoint) serves the same batches in the same
order as one that never stopped, and every process of a multi-host run reads the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class PromptIterator:
    """Endless, seeded, resumable iterator over batches of rows.

    Each epoch visits the rows in a fresh permutation drawn from ``numpy.random.default_rng((seed, epoch))``.
    Batches always hold ``batch_size`` rows, so leftover rows at the end of an epoch (fewer than a batch) are
    skipped for that epoch. ``state_dict`` / ``load_state_dict`` resume exactly where a run stopped.

    Args:
        rows: the rows to serve (already length-filtered).
        batch_size: rows per batch.
        seed: shuffle seed.

    Raises:
        ValueError: if batch_size < 1 or there are fewer rows than batch_size.

    Example:
        >>> it = PromptIterator([{"q": i} for i in range(5)], batch_size=2, seed=0)
        >>> len(next(it)), it.state_dict()["index"]
        (2, 2)
    """

    def __init__(self, rows: Sequence[dict], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(rows) < batch_size:
            raise ValueError(f"need at least batch_size={batch_size} rows, got {len(rows)}")
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    @property
    def num_batches_per_epoch(self) -> int:
        """Full batches per epoch (leftover rows are skipped)."""
        return len(self.rows) // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.rows))

    def __iter__(self) -> Iterator[list[dict]]:
        return self

    def __next__(self) -> list[dict]:
        if self.index + self.batch_size > len(self.rows):
            self.epoch += 1
            self.index = 0
            self._order = self._permutation(self.epoch)
        batch = [self.rows[j] for j in self._order[self.index : self.index + self.batch_size]]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"epoch", "index", "seed"}``: enough to resume at the next batch."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores a position saved by ``state_dict``.

        Args:
            state: ``{"epoch": int, "index": int, "seed": int}``.

        Raises:
            ValueError: if the index is out of range for these rows.
        """
        if not 0 <= int(state["index"]) <= len(self.rows):
            raise ValueError(f"iterator index {state['index']} out of range for {len(self.rows)} rows")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)
