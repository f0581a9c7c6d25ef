"""Token ids of rendered prompts, kept on disk between runs: a second run of the same data skips the tokenizer.

``prepare_rows`` tokenizes every prompt of a split up front (the length filter needs every length, and the
shuffled batches depend on which prompts it keeps): for GSM8K's 8,792 prompts, 1.6 M tokens, seconds of a run's
start each time. The ids depend only on the tokenizer and the texts, so they are stored under the SHA-256 of
both (the tokenizer's whole serialised pipeline: vocabulary, merges, added tokens, pre-tokenizer) in
``<folder>/<key>.npz``: a changed template, system prompt, question or tokenizer is another key, and a file
that cannot be read is tokenized again. The ids read back are the tokenizer's, bit for bit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def cache_folder(jax_cache_dir: str) -> str | None:
    """The token cache of the key ``jax_cache_dir`` (grpax's persistent caches): ``tokens`` inside the folder
    ``grpax.cli.common.compilation_cache_dir`` gives JAX's cache (JAX reads only its ``*-cache`` files there);
    None when the caches are off ('')."""
    if not jax_cache_dir.strip():
        return None
    if jax_cache_dir != "auto":
        return os.path.join(os.path.expanduser(jax_cache_dir), "tokens")
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "tokens")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "grpax", "jax", "tokens")


def cache_key(tokenizer: Any, texts: Sequence[str]) -> str:
    """SHA-256 of the tokenizer's serialised pipeline and of every text (length-prefixed: no two lists of texts
    share a key)."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def cached_token_ids(
    tokenizer: Any,
    texts: Sequence[str],
    tokenize: Callable[[Sequence[str]], list[list[int]]],
    folder: str | None,
) -> list[list[int]]:
    """``tokenize(texts)``, read from ``folder`` when an earlier call stored it there, else computed and stored.

    A cache that cannot be read or written never fails the caller: the ids are computed (and a write failure is
    logged once per call).

    Args:
      tokenizer: the tokenizer ``tokenize`` uses; a fast one's pipeline is part of the key (a slow one is not
        cached).
      texts: the rendered prompts.
      tokenize: texts -> token ids per text (``grpax.data.prompts.tokenize_prompts`` with ``tokenizer``).
      folder: the cache folder (``cache_folder``); None: no cache.

    Returns:
      Token ids per text, as ``tokenize`` returns them.
    """
    if folder is None or not texts or getattr(tokenizer, "backend_tokenizer", None) is None:
        return tokenize(texts)  # a slow (Python) tokenizer has no serialised pipeline to key on
    path = os.path.join(folder, cache_key(tokenizer, texts) + ".npz")
    ids = _read(path, len(texts))
    if ids is not None:
        return ids
    ids = tokenize(texts)
    _write(path, ids)
    return ids


def _read(path: str, count: int) -> list[list[int]] | None:
    """The ids stored at ``path`` (None when absent, unreadable, or not ``count`` prompts)."""
    try:
        with np.load(path) as stored:
            flat, lengths = stored["ids"], stored["lengths"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if lengths.shape != (count,) or int(lengths.sum()) != flat.size:
        return None
    return [part.tolist() for part in np.split(flat, np.cumsum(lengths)[:-1])]


def _write(path: str, ids: list[list[int]]) -> None:
    """Stores ``ids`` at ``path`` through a temporary file and a rename (readers never see half a file)."""
    lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
    flat = np.fromiter((i for x in ids for i in x), np.int64, int(lengths.sum()))
    if flat.size and 0 <= flat.min() and flat.max() < 2**31:
        flat = flat.astype(np.int32)  # half the file; read back as the same Python ints
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, ids=flat, lengths=lengths)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("token cache: cannot write %s (%s); prompts are tokenized again next run", path, e)
        if os.path.exists(tmp):
            os.remove(tmp)
