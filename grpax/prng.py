"""PRNG keys made on the host: ``key(seed)`` and ``fold_in(key, n)`` without compiling a program.

A leaf module (it imports nothing of grpax). ``jax.random.key`` and ``jax.random.fold_in`` called outside a jit
each compile and run a small program on the default device (``stage``, ``_threefry_seed``,
``convert_element_type``, ``_threefry_fold_in``: four programs of a GRPO run, one more each time a shape
changes), and a run derives a key per step and per evaluation batch. Here the same key data is computed with
numpy: JAX's threefry-2x32 hash (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", the 20-round
Threefry-2x32 as ``jax._src.random.threefry2x32._threefry2x32_lowering`` applies it) on ``[0, n]``, then wrapped
as a typed key (``jax.random.wrap_key_data``: no program). The results equal JAX's bit for bit
(tests/test_prng.py). Another default PRNG implementation (``jax_default_prng_impl``) falls back to
``jax.random``.
"""

from __future__ import annotations

import jax
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _threefry(impl_name: str) -> bool:
    return impl_name == "threefry2x32"


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry_2x32(key_data: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Threefry-2x32 of ``count`` uint32 [2] under ``key_data`` uint32 [2]: uint32 [2] (JAX's
    ``threefry_2x32`` of a two-word count)."""
    k = [np.uint32(key_data[0]), np.uint32(key_data[1])]
    ks = [k[0], k[1], k[0] ^ k[1] ^ np.uint32(_PARITY)]
    with np.errstate(over="ignore"):
        x = [np.uint32(count[0]) + ks[0], np.uint32(count[1]) + ks[1]]
        for i in range(5):
            for r in _ROTATIONS[i % 2]:
                x[0] = x[0] + x[1]
                x[1] = _rotl(x[1], r) ^ x[0]
            x[0] = x[0] + ks[(i + 1) % 3]
            x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return np.array(x, np.uint32)


def key(seed: int) -> jax.Array:
    """``jax.random.key(seed)`` (a typed key; ``seed`` a Python int in int32's or uint32's range)."""
    impl = jax.config.jax_default_prng_impl
    if not _threefry(impl):
        return jax.random.key(seed)
    if not -(2**31) <= seed < 2**32:
        raise ValueError(f"seed={seed} is outside 32 bits: pass a seed in [-2**31, 2**32)")
    return jax.random.wrap_key_data(np.array([0, seed & 0xFFFFFFFF], np.uint32), impl=impl)


def fold_in(base: jax.Array, data: int) -> jax.Array:
    """``jax.random.fold_in(base, data)`` for a typed threefry key ``base`` (scalar) and a Python int ``data``.

    Raises:
      ValueError: ``data`` outside [0, 2**32) (JAX's uint32 conversion refuses it too).
    """
    impl = str(jax.random.key_impl(base))
    if not _threefry(impl) or base.shape:
        return jax.random.fold_in(base, data)
    if not 0 <= data < 2**32:
        raise ValueError(f"fold_in data={data} is outside [0, 2**32)")
    key_data = np.asarray(jax.random.key_data(base))
    out = threefry_2x32(key_data, np.array([0, data], np.uint32))
    return jax.random.wrap_key_data(out, impl=impl)
