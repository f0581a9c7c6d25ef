"""The host's bookkeeping of the paged KV cache: which pages are free, and how many sequences hold each.

The pool lives on the device (``grpax.sampler.backend``: one buffer of ``num_pages`` pages per layer); this
class only hands out page indices. A prompt's full pages are held by each of its G completions (one reference
each) and freed with the last of them; a completion's own pages (the prompt's partial last page copied, then its
new tokens) have one holder. Page 0 is the scratch page idle decode slots write to: never handed out. The same
scheme as vLLM's block manager (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention"), without copy-on-write: completions append to pages of their own.
"""

from __future__ import annotations

import numpy as np


class PagePool:
    """Free pages and reference counts of a pool of ``num_pages`` pages (page 0 reserved).

    Raises:
      ValueError: fewer than 2 pages.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs page 0 (scratch) and at least one more")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # popped from the end: low indices first
        self._refs = np.zeros(num_pages, np.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` free pages, each with one reference; None (nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self._refs[pages] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more holder of each of ``pages``."""
        np.add.at(self._refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """One holder less of each of ``pages``; those left without one are free again."""
        for page in pages:
            assert self._refs[page] > 0, page
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
