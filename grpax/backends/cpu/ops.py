"""The CPU kernels as JAX ops, called through the XLA FFI (built by ``grpax.backends.cpu.build``).

Three kernels, the role Pallas kernels play on TPU and GPU in MaxText and Tunix (timings: docs/benchmarks.md):

- ``paged_attention_update`` (``kernels/decode_attention.cc``): writes each sequence's new key and value into
  its page in place, then attends one query per sequence over its pages, reading only the filled slots, once
  (XLA:CPU ran the dense cache's attention as generic reductions and many tiny batched matmuls, about 4x the time
  it takes to read the cache).
- ``matmul`` (``kernels/matmul.cc``): the decode step's few-row matmuls against weights packed in panels of 16
  columns (``pack``), read once per step as contiguous runs, with SwiGLU and the pre-norm fused.
- ``packed_attention`` (``kernels/packed_attention.cc``): the prefill's causal attention inside each packed
  prompt (and over a prefix all prompts share), over only the keys each block of queries may see.

All share their work out over XLA's own intra-op threads and have no sharding rule: one CPU device only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpax.backends.cpu import build

PANEL = 16  # columns per panel of a packed weight (kernels/matmul.cc)
MAX_GROUP = 8  # query heads per kv head the decode-attention kernel supports


def paged_attention_update(
    q: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes each sequence's new key and value at its position's page, then attends one query per sequence over
    positions 0..position of its pages, on CPU.

    The pools are updated in place (their buffers are outputs aliased to the inputs): the same pools as
    ``k_pages.at[table[b, p // ps], :, :, p % ps].set(new_k[b])`` for p = positions[b], without XLA's scatter,
    which for a bfloat16 cache converted the whole cache to float32 and back around it at every step. The
    attention equals ``grpax.models.attention.paged_attention`` on the same keys and values (float32
    accumulation; exp by a degree-6 polynomial, ~1e-7 relative), summed in the order of a dense cache of those
    slots whatever the page size.

    Args:
      q: float32 [B, K, G, H] queries, rotated and scaled by 1/sqrt(H); G <= 8.
      new_k, new_v: [B, K, H] in the pools' dtype.
      k_pages: [P, K, H, ps] keys (slot minor); v_pages: [P, K, ps, H]; float32 or bfloat16 (both the same).
      page_table: int32 [B, W] each sequence's pages in order (W * ps > its position).
      positions: int32 [B] the new token's position; < 0 for an idle slot (nothing written, zeros out).

    Returns:
      (float32 [B, K, G, H], updated k_pages, updated v_pages).

    Raises:
      RuntimeError: the kernels could not be built (the reason in the message).
    """
    build.require()
    shapes = (
        jax.ShapeDtypeStruct(q.shape, jnp.float32),
        jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
    )
    return tuple(
        jax.ffi.ffi_call("grpax_paged_attention_update", shapes, input_output_aliases={3: 1, 4: 2})(
            q.astype(jnp.float32),
            new_k.astype(k_pages.dtype),
            new_v.astype(v_pages.dtype),
            k_pages,
            v_pages,
            page_table.astype(jnp.int32),
            positions.astype(jnp.int32),
        )
    )


def pack(
    weights: list[jax.Array], dtype=None, swiglu: bool = False, transposed: bool = False
) -> list[jax.Array]:
    """Weights of L layers in the panel layout of ``matmul``, one packed array per layer (a C++ copy).

    Args:
      weights: matrices [L, K, N_i] (with ``transposed`` [L, N_i, K], e.g. tied embeddings [1, V, D] for the
        LM head), one K. Their columns are concatenated in order (fused q/k/v), or with ``swiglu`` two
        matrices (gate, up) have their panels interleaved for ``matmul(..., swiglu=True)``.
      dtype: stored dtype, float32 or bfloat16 (default: the first weight's); cast before packing.

    Returns:
      L arrays [P, K, 16] with ``packed[l][p, k, j]`` = column 16 p + j of layer l's concatenated matrix,
      zero past its last column (P = sum of ceil(N_i / 16)); with ``swiglu`` gate panel q at 2q and up panel q
      at 2q + 1. bfloat16 panels hold their rows in pairs, ``packed[l][p].reshape(K // 2, 16, 2)[i, j, s]`` =
      row 2i + s, column j (the operand layout of AVX-512 BF16's pair dot products), K rounded up
      to even with a zero row.

    Raises:
      ValueError: shapes that do not match (K, L, or the two SwiGLU matrices).
      RuntimeError: the kernels could not be built.
    """
    build.require()
    if any(w.ndim != 3 for w in weights):
        raise ValueError(f"pack: weights must be [L, K, N], got {[w.shape for w in weights]}")
    dtype = jnp.dtype(dtype or weights[0].dtype)
    weights = [w.astype(dtype) for w in weights]
    L = weights[0].shape[0]
    K = weights[0].shape[1 + transposed]
    cols = [w.shape[1 + (not transposed)] for w in weights]
    if any(w.shape[0] != L or w.shape[1 + transposed] != K for w in weights):
        raise ValueError(
            f"pack: weights must be [L, K, N] with one L and K, got {[w.shape for w in weights]}"
        )
    if swiglu and (len(weights) != 2 or cols[0] != cols[1]):
        raise ValueError(
            f"pack(swiglu=True) takes gate and up of one shape, got {[w.shape for w in weights]}"
        )
    P = sum(-(-n // PANEL) for n in cols)
    Kp = K + K % 2 if dtype.itemsize == 2 else K
    out = jax.ShapeDtypeStruct((P, Kp, PANEL), dtype)
    return list(
        jax.ffi.ffi_call("grpax_pack", [out] * L)(*weights, swiglu=bool(swiglu), transposed=bool(transposed))
    )


def matmul(
    x: jax.Array,
    packed: jax.Array,
    n: int,
    swiglu: bool = False,
    x_transposed: bool = False,
    transpose_out: bool = False,
    norm_weight: jax.Array | None = None,
    eps: float = 0.0,
    out_dtype=jnp.float32,
) -> jax.Array:
    """``x @ W`` on CPU, W packed by ``pack``: the decode step's few rows against weights read once per step.

    With ``norm_weight`` x's rows are RMS-normalised first, ``rms_norm(x, norm_weight, eps) @ W`` (the Llama
    pre-norm, as ``grpax.models.llama.rms_norm``: in float32, with a bfloat16 x rounded to bfloat16 before and
    after the weight), while the kernel lays x out for its tiles: no separate pass over x.

    With ``swiglu`` (W from ``pack(..., swiglu=True)``) returns ``silu(x @ W_gate) * (x @ W_up)``. Accumulates
    in float32 (bfloat16 weights are widened exactly); the sum order differs from XLA's dot, so results agree
    with it to float32 rounding (~1e-6 relative), not bit for bit.

    Args:
      x: [..., K], float32 or bfloat16 as it is (other float dtypes are cast to float32; the kernel computes in
        float32); with ``x_transposed`` [K, M] (x^T, 2-D).
      packed: [P, K, 16] float32 or bfloat16 (bfloat16: K rounded up to even; 2P panels with ``swiglu``).
      n: static number of output columns N (P = ceil(N / 16)).
      x_transposed: static; x comes as [K, M]. The kernel multiplies from x^T, so a caller that has it (the
        output of ``transpose_out``) spares the kernel its transposition.
      transpose_out: static; return y^T [n, M] (x must then be 2-D), e.g. to feed ``x_transposed``.
      norm_weight: [K] RMSNorm weight (not with ``x_transposed``); eps: static, its epsilon.
      out_dtype: static; float32 (default) or bfloat16 (the float32 result rounded to nearest even, as
        ``.astype(jnp.bfloat16)`` would: one pass less for a bfloat16 model).

    Returns:
      [..., n] in ``out_dtype``, or [n, M] with ``transpose_out``.

    Raises:
      ValueError: ``x_transposed`` or ``transpose_out`` with x not 2-D; ``norm_weight`` with ``x_transposed``
        or not of shape [K]; ``out_dtype`` not float32 or bfloat16.
      RuntimeError: the kernels could not be built (the reason in the message).
    """
    build.require()
    if (x_transposed or transpose_out) and x.ndim != 2:
        raise ValueError(f"matmul(x_transposed / transpose_out) takes a 2-D x, got shape {x.shape}")
    if norm_weight is not None and (x_transposed or norm_weight.shape != x.shape[-1:]):
        raise ValueError(
            f"matmul(norm_weight=...) takes x [..., K] (not transposed) and a weight [K]; got x {x.shape}, "
            f"weight {norm_weight.shape}, x_transposed={x_transposed}"
        )
    normalize = norm_weight is not None
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul(out_dtype={out_dtype}): expected float32 or bfloat16")
    if norm_weight is None:
        norm_weight = jnp.zeros((1,), jnp.float32)
    else:  # as rms_norm: the weight in x's dtype
        norm_weight = norm_weight.astype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in (jnp.float32, jnp.bfloat16):
        x2 = x2.astype(jnp.float32)
    M = x2.shape[1] if x_transposed else x2.shape[0]
    y = jax.ffi.ffi_call(
        "grpax_matmul", jax.ShapeDtypeStruct((n, M) if transpose_out else (M, n), out_dtype)
    )(
        x2,
        packed,
        norm_weight.astype(jnp.float32),
        n=np.int64(n),
        swiglu=bool(swiglu),
        x_transposed=bool(x_transposed),
        transpose_out=bool(transpose_out),
        normalize=normalize,
        eps=np.float32(eps),
    )
    if x_transposed or transpose_out:
        return y
    return y.reshape(*lead, n)


def packed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, num_rows: int, prefix: int = 0
) -> jax.Array:
    """Causal attention inside each row of a packed sequence, on CPU.

    The same result as windowed jnp attention (the reference in tests/backends/test_cpu.py) on the real
    tokens (to float32 rounding: exp by a degree-6 polynomial, ~1e-7 relative, and sums in another order):
    token t attends to the tokens j <= t of its own row, scores scaled by 1/sqrt(H). Rows are runs of equal ids in ``rows``; tokens with an id outside
    0..num_rows-1 (the packing's padding) get zeros and cost nothing. With ``prefix`` = A > 0 the first A
    tokens are a prefix every row shares (whatever their ids): they attend causally among themselves and every
    later token also attends to all of them, as if its row began with them. In bfloat16 the probabilities are
    rounded to bfloat16 before the product with the values, as the jnp version does. A head size that is not
    a multiple of 64 is zero-padded to one (the kernel's value tiles).

    Args:
      q: [T, N, H] queries, already rotated (not scaled); k, v: [T, K, H]; float32 or bfloat16 (computed in
        float32); N a multiple of K.
      rows: int32 [T] row of each token (the tokens of a row contiguous and in order).
      num_rows: static number of real rows.
      prefix: static length A of the shared prefix (0: none).

    Returns:
      [T, N, H] in q's dtype.

    Raises:
      ValueError: shapes that do not fit (q [T, N, H], k = v [T, K, H], K dividing N, rows [T]).
      RuntimeError: the kernels could not be built (the reason in the message).
    """
    build.require()
    T, N, H = q.shape if q.ndim == 3 else (None, None, None)
    if (
        q.ndim != 3
        or k.shape != v.shape
        or k.ndim != 3
        or k.shape[1] < 1
        or k.shape[0] != T
        or k.shape[2] != H
        or N % k.shape[1]
        or rows.shape != (T,)
        or not 0 <= prefix <= T
    ):
        raise ValueError(
            f"ops.packed_attention takes q [T, N, H], k and v [T, K, H] with K dividing N, rows [T] "
            f"and a prefix of 0..T tokens; got q {q.shape}, k {k.shape}, v {v.shape}, rows {rows.shape}, "
            f"prefix={prefix}"
        )
    Hp = -(-H // 64) * 64
    pad = [(0, 0), (0, 0), (0, Hp - H)]
    out = jax.ffi.ffi_call("grpax_packed_attention", jax.ShapeDtypeStruct((T, N, Hp), jnp.float32))(
        *(jnp.pad(x.astype(jnp.float32), pad) for x in (q, k, v)),
        rows.astype(jnp.int32),
        num_rows=np.int64(num_rows),
        prefix=np.int64(prefix),
        scale=np.float32(1.0 / np.sqrt(H)),
        probs_bf16=bool(v.dtype == jnp.bfloat16),
    )
    return out[..., :H].astype(q.dtype)
