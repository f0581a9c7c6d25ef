"""CPU kernels for the sampler, built from source at first use and called through the XLA FFI.

Four kernels, the role Pallas kernels play on TPU and GPU in MaxText and Tunix:

- ``decode_attention`` (``kernels/decode_attention.cc``). XLA:CPU runs the decode attention of
  ``cached_attention`` (one query per row over the KV cache) as generic reductions and many tiny batched
  matmuls, about 4x over the time it takes to read the cache once; at batch 64 that was half of every decode
  step. The kernel reads only the filled slots of each row, once.
- ``matmul`` (``kernels/matmul.cc``): the decode step's few-row matmuls against weights packed in panels of
  16 columns (``pack``), read once per step as contiguous runs, with SwiGLU and the pre-norm fused for the
  layer. The 30 layers + LM head of a SmolLM2 decode step (float32): on a 2-core AVX2 machine 35-42 ms at
  batch 16 (XLA's dots 64-70 ms), 103-116 ms at batch 64 (XLA 138-146 ms); on a 2-core AVX-512 Xeon, with
  its 16-lane tiles, 29-32 ms at batch 16 and 76-80 ms at batch 64 (XLA ~198 ms). bfloat16 weights are
  stored in row pairs; on a CPU with AMX (Sapphire Rapids and later) a bfloat16 x is multiplied on its tile
  unit instead: bfloat16 decode steps 15 ms at batch 16 and 33-37 ms at batch 64 (vector tiles 24 and 86 ms),
  and the prefill's many-row products 2-3x XLA's bfloat16 dots (``SamplerConfig.prefill_matmul``).
- ``packed_attention`` (``kernels/packed_attention.cc``): the prefill's causal attention inside each packed
  prompt (and over a prefix all prompts share), from register tiles over only the keys each block of queries
  may see: ~80 ms for SmolLM2's 30 layers over 1.5 k tokens where XLA's windowed version takes 0.7-0.9 s.
- ``sample`` (``kernels/sample.cc``): the decode step's categorical draw and its log-probability in two
  passes over the vocabulary (XLA: ~6); 0.4 instead of 1.7 ms per step at batch 16.

All four share their work out over XLA's own intra-op threads. They are compiled with the machine's C++ compiler
(``$CXX``, else ``g++``) for this CPU (``-march=native``) into one library in a cache folder keyed by
sources, jaxlib version, compiler flags and CPU; when no compiler or FFI headers are found, ``available()``
says why (logged once) and the sampler keeps XLA's ops.

Environment: ``GRPAX_KERNEL_CACHE`` sets the cache folder (default ``~/.cache/grpax/kernels``);
``GRPAX_CPU_KERNELS=0`` turns the kernels off; ``GRPAX_CPU_AMX=0`` keeps the matmul kernel off AMX.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np

logger = logging.getLogger(__name__)

_KERNELS = Path(__file__).parent / "kernels"
_SOURCES = tuple(
    _KERNELS / name for name in ("decode_attention.cc", "matmul.cc", "packed_attention.cc", "sample.cc")
)
_HEADERS = (_KERNELS / "parallel.h", _KERNELS / "simd.h")
_TARGET = "grpax_decode_attention"
_UPDATE_TARGET = "grpax_decode_attention_update"
_MATMUL_TARGET = "grpax_matmul"
_PACK_TARGET = "grpax_pack"
_PACKED_ATTENTION_TARGET = "grpax_packed_attention"
_SAMPLE_TARGET = "grpax_sample"
PANEL = 16  # columns per panel of a packed weight (kernels/matmul.cc)
_FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
MAX_GROUP = 8  # query heads per kv head the kernel supports


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    """Compiles the kernels (or finds them in the cache); returns the shared library's path.

    Raises:
      RuntimeError: no compiler, no FFI headers, or the compiler failed (its output in the message).
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    include = jax.ffi.include_dir()
    if not (Path(include) / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"XLA FFI headers not found under {include}")
    key = hashlib.sha256()
    # The FFI headers and the runtime the library is loaded into both come with jaxlib.
    for part in (
        *(path.read_bytes() for path in (*_SOURCES, *_HEADERS)),
        jaxlib.version.__version__.encode(),
        cxx.encode(),
        " ".join(_FLAGS).encode(),
    ):
        key.update(part)
    key.update(_cpu_signature().encode())
    cache = Path(os.environ.get("GRPAX_KERNEL_CACHE") or Path.home() / ".cache" / "grpax" / "kernels")
    lib = cache / key.hexdigest()[:16] / "libgrpax_cpu_kernels.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{include}", *map(str, _SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU kernels: %s", lib)
    return lib


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernels' shared library, built (or found in the cache) and loaded once per process."""
    return ctypes.cdll.LoadLibrary(str(_build()))


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernels once per process; returns None, or why they are unavailable."""
    if os.environ.get("GRPAX_CPU_KERNELS", "1") == "0":
        return "turned off by GRPAX_CPU_KERNELS=0"
    if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):
        return f"jax {jax.__version__} has no jax.ffi"
    try:
        lib = _library()
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.GrpaxDecodeAttention), platform="cpu")
        jax.ffi.register_ffi_target(
            _UPDATE_TARGET, jax.ffi.pycapsule(lib.GrpaxDecodeAttentionUpdate), platform="cpu"
        )
        jax.ffi.register_ffi_target(_MATMUL_TARGET, jax.ffi.pycapsule(lib.GrpaxMatmul), platform="cpu")
        jax.ffi.register_ffi_target(_PACK_TARGET, jax.ffi.pycapsule(lib.GrpaxPack), platform="cpu")
        jax.ffi.register_ffi_target(
            _PACKED_ATTENTION_TARGET, jax.ffi.pycapsule(lib.GrpaxPackedAttention), platform="cpu"
        )
        jax.ffi.register_ffi_target(_SAMPLE_TARGET, jax.ffi.pycapsule(lib.GrpaxSample), platform="cpu")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None


@functools.cache
def amx_available() -> bool:
    """True when ``matmul`` can use AMX: kernels built for a CPU with AMX-BF16 and Linux lends the tiles."""
    if _load() is not None:
        return False
    return bool(_library().GrpaxAmxAvailable())


def amx_enabled() -> bool:
    """``amx_available()`` and not turned off by ``GRPAX_CPU_AMX=0``: ``matmul``'s default for ``amx``."""
    return os.environ.get("GRPAX_CPU_AMX", "1") != "0" and amx_available()


def available() -> bool:
    """True when the CPU kernels are built and registered (builds them on the first call)."""
    reason = _load()
    if reason is not None:
        _warn_once(reason)
    return reason is None


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("CPU kernels unavailable, the sampler uses XLA's ops: %s", reason)


def _require() -> None:
    """Builds and registers the kernels if needed; raises RuntimeError (with the reason) when they cannot be."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {reason}")


def decode_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array) -> jax.Array:
    """One query per row over a KV cache in the decode layout, on CPU (``available()`` must be True).

    The same result as ``grpax.models.llama.cached_attention`` with T == 1 and mask ``slot <= position``
    (float32 accumulation; exp by a degree-6 polynomial, ~1e-7 relative).

    Args:
      q: float32 [B, K, G, H] queries, already rotated and scaled by 1/sqrt(H); G <= 8.
      cache_k: [B, K, H, S] keys; cache_v: [B, K, S, H] values; float32 or bfloat16 (both the same).
      positions: int32 [B]: row b attends to slots 0..positions[b] (clipped to 0..S-1).

    Returns:
      float32 [B, K, G, H].

    Raises:
      RuntimeError: the kernel could not be built (the reason in the message).
    """
    _require()
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), cache_k, cache_v, positions.astype(jnp.int32)
    )


def decode_attention_update(
    q: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes each row's new key and value at slot ``positions[b]``, then attends as ``decode_attention``.

    The cache is updated in place (its buffers are outputs aliased to the inputs): the same cache as
    ``cache_k.at[b, :, :, positions[b]].set(new_k[b])`` (slots past the cache dropped) without XLA's scatter,
    which for a bfloat16 cache converted the whole cache to float32 and back around it at every step.

    Args:
      q: float32 [B, K, G, H] queries, rotated and scaled by 1/sqrt(H); G <= 8.
      new_k, new_v: [B, K, H] in the cache dtype.
      cache_k: [B, K, H, S]; cache_v: [B, K, S, H]; float32 or bfloat16 (both the same).
      positions: int32 [B].

    Returns:
      (float32 [B, K, G, H], updated cache_k, updated cache_v).

    Raises:
      RuntimeError: the kernels could not be built (the reason in the message).
    """
    _require()
    shapes = (
        jax.ShapeDtypeStruct(q.shape, jnp.float32),
        jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
        jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype),
    )
    return tuple(
        jax.ffi.ffi_call(_UPDATE_TARGET, shapes, input_output_aliases={3: 1, 4: 2})(
            q.astype(jnp.float32),
            new_k.astype(cache_k.dtype),
            new_v.astype(cache_v.dtype),
            cache_k,
            cache_v,
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
      row 2i + s, column j (the operand layout of AMX's and AVX-512 BF16's pair dot products), K rounded up
      to even with a zero row.

    Raises:
      ValueError: shapes that do not match (K, L, or the two SwiGLU matrices).
      RuntimeError: the kernels could not be built.
    """
    _require()
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
        jax.ffi.ffi_call(_PACK_TARGET, [out] * L)(*weights, swiglu=bool(swiglu), transposed=bool(transposed))
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
    amx: bool | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """``x @ W`` on CPU, W packed by ``pack`` (``available()`` must be True): the decode step's few rows, or
    with AMX (bfloat16) also the prefill's many.

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
      amx: static; with bfloat16 ``packed`` and a bfloat16 x (so that x is exact in bfloat16), K a multiple of
        32 and ``amx_available()``, multiply on AMX tiles (the same float32 sums of exact products in another
        order). Default: ``amx_enabled()`` (on unless ``GRPAX_CPU_AMX=0``).

      out_dtype: static; float32 (default) or bfloat16 (the float32 result rounded to nearest even, as
        ``.astype(jnp.bfloat16)`` would: one pass less for a bfloat16 model).

    Returns:
      [..., n] in ``out_dtype``, or [n, M] with ``transpose_out``.

    Raises:
      ValueError: ``x_transposed`` or ``transpose_out`` with x not 2-D; ``norm_weight`` with ``x_transposed``
        or not of shape [K]; ``out_dtype`` not float32 or bfloat16.
      RuntimeError: the kernels could not be built (the reason in the message).
    """
    _require()
    if (x_transposed or transpose_out) and x.ndim != 2:
        raise ValueError(f"matmul(x_transposed / transpose_out) takes a 2-D x, got shape {x.shape}")
    if norm_weight is not None and (x_transposed or norm_weight.shape != x.shape[-1:]):
        raise ValueError(
            f"matmul(norm_weight=...) takes x [..., K] (not transposed) and a weight [K]; got x {x.shape}, "
            f"weight {norm_weight.shape}, x_transposed={x_transposed}"
        )
    normalize = norm_weight is not None
    if amx is None:
        amx = amx_enabled()
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
        _MATMUL_TARGET, jax.ShapeDtypeStruct((n, M) if transpose_out else (M, n), out_dtype)
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
        amx=bool(amx),
    )
    if x_transposed or transpose_out:
        return y
    return y.reshape(*lead, n)


def packed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, num_rows: int, prefix: int = 0
) -> jax.Array:
    """Causal attention inside each row of a packed sequence, on CPU (``available()`` must be True).

    The same result as ``grpax.models.llama.packed_attention`` on the real tokens (to float32 rounding: exp by a
    degree-6 polynomial, ~1e-7 relative, and sums in another order): token t attends to the tokens j <= t of its own
    row, scores scaled by 1/sqrt(H). Rows are runs of equal ids in ``rows``; tokens with an id outside
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
    _require()
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
            f"cpu_kernels.packed_attention takes q [T, N, H], k and v [T, K, H] with K dividing N, rows [T] "
            f"and a prefix of 0..T tokens; got q {q.shape}, k {k.shape}, v {v.shape}, rows {rows.shape}, "
            f"prefix={prefix}"
        )
    Hp = -(-H // 64) * 64
    pad = [(0, 0), (0, 0), (0, Hp - H)]
    out = jax.ffi.ffi_call(_PACKED_ATTENTION_TARGET, jax.ShapeDtypeStruct((T, N, Hp), jnp.float32))(
        *(jnp.pad(x.astype(jnp.float32), pad) for x in (q, k, v)),
        rows.astype(jnp.int32),
        num_rows=np.int64(num_rows),
        prefix=np.int64(prefix),
        scale=np.float32(1.0 / np.sqrt(H)),
        probs_bf16=bool(v.dtype == jnp.bfloat16),
    )
    return out[..., :H].astype(q.dtype)


def sample(
    logits: jax.Array, u: jax.Array, temperature: float = 1.0, block_size: int = 256
) -> tuple[jax.Array, jax.Array]:
    """Categorical draw per row and its log-probability, on CPU (``available()`` must be True).

    The draw of ``grpax.sampler.sampling.sample_from_uniform`` without top-k / top-p (two-level inverse CDF:
    a block of ``block_size`` tokens by its mass at ``u[:, 0]``, a token inside it at ``u[:, 1]``) and the
    log-probability of ``token_logprobs``, ``log_softmax(logits / temperature)[token]``, in two passes over
    the vocabulary instead of XLA's ~6. Exp by a degree-6 polynomial (~1e-7 relative), logits / temperature
    as a product with 1 / temperature (within an ulp) and sums in another order: a u within float32 rounding
    of a CDF step may pick the neighbouring token.

    Args:
      logits: float32 [B, V].
      u: float32 [B, 2] uniforms in [0, 1).
      temperature: static, > 0.
      block_size: static tokens per block, a multiple of 16.

    Returns:
      (int32 [B] tokens, float32 [B] log-probabilities).

    Raises:
      ValueError: shapes other than logits [B, V >= 1] and u [B, 2], or a bad temperature or block size.
      RuntimeError: the kernels could not be built (the reason in the message).
    """
    _require()
    if logits.ndim != 2 or logits.shape[1] < 1 or u.shape != (logits.shape[0], 2):
        raise ValueError(
            f"cpu_kernels.sample takes logits [B, V] (V >= 1) and u [B, 2]; got {logits.shape}, {u.shape}"
        )
    if not temperature > 0 or block_size < 16 or block_size % 16:
        raise ValueError(
            f"cpu_kernels.sample: temperature={temperature} must be > 0 and block_size={block_size} a positive "
            "multiple of 16"
        )
    B = logits.shape[0]
    tokens, logprobs = jax.ffi.ffi_call(
        _SAMPLE_TARGET, (jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.float32))
    )(
        logits.astype(jnp.float32),
        u.astype(jnp.float32),
        temperature=np.float32(temperature),
        block=np.int64(block_size),
    )
    return tokens, logprobs
