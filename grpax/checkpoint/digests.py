"""Per-array digests of a checkpoint: written with every training step, checked on restore and on export.

Orbax's data files carry no checksum of their own (the trainer writes them uncompressed), so bytes overwritten
in ``actor/<step>/model_params`` or ``opt_state`` would restore, resume and export silently. Each step's
``train_meta`` therefore holds, for every array of both trees, its dtype, shape and a 64-bit digest: two
position-weighted sums of the array's bits modulo 2**32, computed by XLA on the array where it lives (sharded
arrays included: the sums are exact integer arithmetic, so the sharding does not change them, and no copy
crosses to the host). A restore recomputes them on what it read; any damaged byte changes a sum except with
probability about 2**-64.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpax.compiles import effort_options
from grpax.models import quantize as quant

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the array's bits widened to uint32 [size], their positions uint32 [size])."""
    size = x.dtype.itemsize
    bits = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, _UINT[size])
    flat = bits.reshape(-1).astype(jnp.uint32)
    return flat, jax.lax.iota(jnp.uint32, flat.size)


def _weighted(flat: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two sums' terms: the bits weighted by position, and by a second odd multiplier."""
    weighted = flat * (i * jnp.uint32(2654435761) + jnp.uint32(1))
    mixed = (flat ^ (i * jnp.uint32(40503))) * jnp.uint32(2246822519) + i
    return weighted, mixed


def _one_reduction(x: jax.Array) -> jax.Array:
    """The two sums as one reduction of two operands (``lax.reduce``), so that XLA:CPU fuses the bits' widening
    and the positions into it and materialises neither: as two ``jnp.sum``s, it wrote a uint32 copy of the bits
    and of the positions for every leaf, 3.2 GB of temporaries for SmolLM2's params and AdamW state in one
    program (the main job's peak, 3.5 -> 5.3 GB)."""
    zero = jnp.uint32(0)
    terms = _weighted(*_bits(x))
    a, b = jax.lax.reduce(terms, (zero, zero), lambda p, q: (p[0] + q[0], p[1] + q[1]), (0,))
    return jnp.stack([a, b])


def _two_sums(x: jax.Array) -> jax.Array:
    """The two sums as two ``jnp.sum``s: the TPU compiler fuses each into one reduction (3 MB of temporaries
    for SmolLM2's params and AdamW state, against 145 MB as one two-operand reduction) and compiles them in a
    third of the time (libtpu for a v5e: 3.7 s against 11.7 s for those 34 arrays; docs/benchmarks.md)."""
    weighted, mixed = _weighted(*_bits(x))
    return jnp.stack([jnp.sum(weighted, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])


def _array_sums(x: jax.Array) -> jax.Array:
    """Two uint32 sums over the array's bits: weighted by position, and by a second odd multiplier; modulo
    2**32, so neither the order nor the formulation changes them (the CPU's ``_one_reduction``, the other
    platforms' ``_two_sums``)."""
    return jax.lax.platform_dependent(x, cpu=_one_reduction, default=_two_sums)


# XLA's least run-time effort: the digests run once per checkpoint and read each byte once, and their compile is
# what a run waits for (the README's job on a TPU v5e: 15.8 s at the default effort as one reduction per array,
# 1.2 s as two sums at the least; docs/benchmarks.md).
@functools.partial(jax.jit, compiler_options=dict(effort_options(-1.0)) or None)
def _sums(arrays: list) -> list:
    """``_array_sums`` of each array, in one program per list of shapes: a whole tree's leaves at once, so a
    checkpoint's digests compile once, not once per distinct leaf shape (each a compile on an accelerator)."""
    return [_array_sums(x) for x in arrays]


def _signature(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"


def _digestible(x: Any) -> bool:
    """Whether ``x`` is an array with fixed bits to digest (not an 8-byte dtype, not a non-array leaf)."""
    return hasattr(x, "dtype") and (np.dtype(x.dtype).itemsize in _UINT or x.dtype == np.bool_)


def _digests(arrays: list) -> list[str]:
    """``array_digest`` of each of ``arrays`` (all digestible), computed in one program."""
    sums = np.asarray(jax.device_get(_sums(arrays))) if arrays else []
    return [f"{_signature(x)}:{int(a):08x}{int(b):08x}" for x, (a, b) in zip(arrays, sums, strict=True)]


def array_digest(x: Any) -> str | None:
    """``"<dtype>[shape]:<16 hex digits>"`` of one array (jax or numpy), or None for what has no fixed bits
    (an 8-byte dtype, a non-array leaf)."""
    return _digests([x])[0] if _digestible(x) else None


def tree_digests(tree: Any) -> dict[str, str]:
    """``{path: digest}`` of every array leaf of ``tree`` (dotted paths: ``layers.wq``), in one program."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if _digestible(x)]
    digests = _digests([x for _, x in leaves])
    return {
        jax.tree_util.keystr(p, simple=True, separator="."): d
        for (p, _), d in zip(leaves, digests, strict=True)
    }


def trees_digests(trees: dict[str, Any]) -> dict[str, dict[str, str]]:
    """``tree_digests`` of each named tree (names without dots), all computed in one program."""
    flat = tree_digests(trees)
    return {
        name: {key.removeprefix(name + "."): d for key, d in flat.items() if key.startswith(name + ".")}
        for name in trees
    }


def mismatches(tree: Any, expected: dict[str, str]) -> list[str]:
    """The paths of ``tree``'s arrays whose digest differs from ``expected``.

    An array stored under another dtype or shape than the one read (a resume that casts to a new
    ``weight_dtype``) or absent from ``expected`` (a checkpoint written before digests) is not compared.
    """
    compared = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        want = expected.get(key)
        if want is not None and _digestible(leaf) and want.startswith(_signature(leaf) + ":"):
            compared.append((key, leaf, want))
    digests = _digests([leaf for _, leaf, _ in compared])
    return [key for (key, _, want), got in zip(compared, digests, strict=True) if got != want]


def fingerprint(params: Any, quantization: str = "") -> str:
    """16 hex digits digesting every weight's bits, dtype and shape (``array_digest``), layer by
    layer, so stacked and listed layers of the same weights give the same fingerprint; with ``quantization``
    (QLoRA's ``lora_base_dtype``), the quantisation scheme too (unset: the same digest as without it)."""
    out = {"quantization": quant.scheme(quantization)} if quantization else {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        if key.startswith("layers.") and isinstance(params["layers"], dict):  # stacked [L, ...]
            name = key.removeprefix("layers.")
            out.update({f"layers.{i}.{name}": array_digest(x[i]) for i in range(x.shape[0])})
        else:
            out[key] = array_digest(x)
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]
