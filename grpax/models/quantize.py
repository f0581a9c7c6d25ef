"""QLoRA's frozen base: projection weights held in int8 or NF4 and dequantised in the matmul.

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs") trains LoRA adapters on a base
whose weights are stored in 4 bits and dequantised to the compute dtype where they are multiplied; gradients
flow through the dequantised weight to the activations and the adapters, never to the base. The quantisation
is qwix's (the library Tunix's QLoRA uses), with its conventions for a weight multiplied on the right
(``x @ W``, W [*in, *out]): int8 through ``qwix.quantize`` / ``qwix.dequantize``; nf4 computed here, equal to
qwix's bit for bit (tests/test_qlora.py), because qwix's nf4 flattens the weight to encode and decode it, which
drops a sharded weight's placement (each chip would build the whole weight: 184 GiB of temporaries in 70B's
decode on a v6e-8); here every step is elementwise or splits an axis in place.

* ``int8``: symmetric absmax, one float32 scale per output channel (qwix's default for a weight: channelwise
  on every non-contracting axis). ``scale = absmax / 127.5``, ``q = round(w / scale)`` saturated to
  [-128, 127], so ``|w - q * scale| <= scale / 2``.
* ``nf4``: NormalFloat4, the 16 quantiles of N(0, 1) scaled to [-1, 1] (QLoRA's appendix E), one float32
  absmax scale per block of 64 consecutive elements of the innermost input axis (QLoRA's block size; where that
  axis is not a multiple of 64, its gcd with 64); each value becomes its nearest code. Two 4-bit codes are
  packed into one byte along that axis (qwix keeps one code per byte: ``uint4`` takes a whole byte in a jax
  array on CPU), so the weight takes half a byte per value plus 4 bytes per 64 values.

The scales are float32 whatever the base's dtype (as bitsandbytes keeps its absmax); QLoRA's second
quantisation of the scales is not done (it saves 0.37 bits per value).

``QuantizedWeight`` stands where the forward expects a weight array, as ``grpax.models.lora.LoraWeight`` does:
``astype`` records the compute dtype, ``reshape`` gives the 2-D view [in, out] the forward multiplies by, and
``x @ w`` dequantises that view and multiplies under ``jax.checkpoint``, so the backward pass recomputes the
dequantised weight from the stored bytes instead of keeping it (under ``lax.scan`` it would otherwise be saved
for every layer: the whole base in the compute dtype). On a TPU an nf4 product that is not differentiated (the
sampler's, a logprob pass) runs in two halves, one per nibble, each dequantised inside its dot
(``_nf4_halves_matmul``: the unpacked weight was written out as a float32 copy at every decode step).
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpax.errors import ConfigError

QUANT_DTYPES = ("int8", "nf4")
NF4_BLOCK = 64  # values per absmax scale (QLoRA's block size)
# The 16 NF4 levels, code 0..15 (QLoRA's appendix E; qwix's ``get_nf4_buckets``, equal bit for bit).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)  # fmt: skip


def _qwix():
    try:
        import qwix
    except ImportError:
        raise ConfigError(
            "lora_base_dtype=int8 quantises the base with qwix, which is not installed: "
            "pip install 'grpax[qlora]' (or pip install qwix), or use lora_base_dtype=nf4 (needs no qwix)"
        ) from None
    return qwix


def require_qwix() -> None:
    """Raises the one-line ConfigError naming ``pip install qwix`` when qwix is missing (int8 needs it)."""
    _qwix()


@flax.struct.dataclass
class QuantizedWeight:
    """A weight [*lead, *in, *out] stored quantised; ``x @ w`` multiplies by its dequantised 2-D view.

    Attributes:
      qvalue: int8 [*shape] (int8), or uint8 [*shape] with the innermost input axis halved: two NF4 codes a
        byte, the even index in the low nibble (nf4).
      scale: float32, qvalue's rank: per output channel, 1 on the input axes (int8); one per block of the
        innermost input axis (nf4).
      qtype: "int8" or "nf4".
      num_out_axes: the trailing output axes (the rest after the leading stacked-layer axes are inputs).
      dtype: the weight's dtype before quantisation (what ``merge`` and ``dequantize`` round back to).
      compute_dtype: set by ``astype``: the dtype of the dequantised weight in the matmul (None: x's).
    """

    qvalue: jax.Array
    scale: jax.Array
    qtype: str = flax.struct.field(pytree_node=False)
    num_out_axes: int = flax.struct.field(pytree_node=False)
    dtype: jnp.dtype = flax.struct.field(pytree_node=False)
    compute_dtype: jnp.dtype | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def _inner(self) -> int:
        """The innermost input axis (the packed and the blocked one)."""
        return self.qvalue.ndim - self.num_out_axes - 1

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.qvalue.shape)
        if self.qtype == "nf4":
            shape[self._inner] *= 2
        return tuple(shape)

    @property
    def ndim(self) -> int:
        return self.qvalue.ndim

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes and the scales."""
        return self.qvalue.nbytes + self.scale.nbytes

    def astype(self, dtype) -> QuantizedWeight:
        return self.replace(compute_dtype=jnp.dtype(dtype))

    def reshape(self, *shape) -> QuantizedWeight:
        """The 2-D view [in, out] the forward multiplies by (``w.reshape(D, -1)``, ``w.reshape(-1, D)``)."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        out = math.prod(self.shape[self.qvalue.ndim - self.num_out_axes :])
        rows = math.prod(self.shape) // out
        assert len(shape) == 2 and shape[0] in (rows, -1) and shape[1] in (out, -1), (shape, self.shape)
        pack = 2 if self.qtype == "nf4" else 1
        scale_rows = math.prod(self.scale.shape) // math.prod(
            self.scale.shape[self.scale.ndim - self.num_out_axes :]
        )
        return self.replace(
            qvalue=self.qvalue.reshape(rows // pack, -1),
            scale=self.scale.reshape(scale_rows, -1),
            num_out_axes=1,
        )

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        w = (
            self
            if self.ndim == 2
            else self.reshape(-1, math.prod(self.shape[self.ndim - self.num_out_axes :]))
        )
        return _dequantized_matmul(x, w)


@jax.checkpoint
def _dequantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [.., in] @ dequantize(w) [in, out], the dequantised weight recomputed in the backward pass; nf4 on a
    TPU as ``_nf4_tpu_matmul`` (in halves where not differentiated), elsewhere (CPU, GPU) as the one product."""
    if w.qtype == "nf4":
        return jax.lax.platform_dependent(x, w, tpu=_nf4_tpu_matmul, default=_one_matmul)
    return _one_matmul(x, w)


def _one_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    return x @ dequantize(w).astype(w.compute_dtype or x.dtype)


@jax.custom_jvp
def _nf4_tpu_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """Without a derivative (the decode, the prefill, a logprob pass) the product in halves
    (``_nf4_halves_matmul``); differentiated (the update), the one product and its derivative: the halves'
    float32 partial products add 8 bytes x rows x out to a backward pass, and the TPU compiler takes far longer
    over their backward (docs/benchmarks.md, "nf4 in halves")."""
    return _nf4_halves_matmul(x, w)


@_nf4_tpu_matmul.defjvp
def _nf4_tpu_jvp(primals, tangents):
    return jax.jvp(_one_matmul, primals, tangents)


def _nf4_halves_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [.., in] @ an nf4 weight's 2-D view [in, out] as x's even inputs times the low nibbles plus its odd
    inputs times the high ones, each half dequantised inside its dot, the two products summed in float32 (one
    rounding to the result's dtype, as one product's).

    Unpacking the bytes into one weight interleaves the two nibbles' rows, which the TPU compiler writes out as
    a float32 copy of the weight and relays out at every call; each half is a plain elementwise function of the
    codes that the dot reads as it goes (docs/benchmarks.md, "nf4 in halves").
    The same sum as ``x @ dequantize(w)`` in another order: equal within float32 rounding.
    """
    rows, out = w.qvalue.shape  # packed rows: input 2j in the low nibble, 2j + 1 in the high
    blocks = w.scale.shape[0]  # each scale covers rows // blocks packed rows (half a block, the block even)
    dtype = w.compute_dtype or x.dtype

    def half(codes: jax.Array) -> jax.Array:
        values = _nf4_lookup(codes).reshape(blocks, rows // blocks, out) * w.scale[:, None]
        return values.reshape(rows, out).astype(dtype)

    even = jnp.matmul(x[..., 0::2], half(w.qvalue & 0xF), preferred_element_type=jnp.float32)
    odd = jnp.matmul(x[..., 1::2], half(w.qvalue >> 4), preferred_element_type=jnp.float32)
    return (even + odd).astype(jnp.result_type(x.dtype, dtype))


def scheme(qtype: str) -> str:
    """The quantisation ``quantize`` applies for ``qtype``, as checkpoint fingerprints record it."""
    return {"int8": "int8/absmax/per-output-channel", "nf4": f"nf4/absmax/block{NF4_BLOCK}/packed"}[qtype]


def quantize(w: jax.Array, qtype: str, num_out_axes: int, num_lead_axes: int = 0) -> QuantizedWeight:
    """Quantises one weight [*lead, *in, *out] (the module docstring's scheme).

    Args:
      w: the weight, any float dtype (quantised from its float32 values).
      qtype: "int8" or "nf4".
      num_out_axes: its trailing output axes.
      num_lead_axes: its leading stacked-layer axes (each layer gets its own scales).

    Raises:
      ConfigError: qwix is missing (int8); nf4 on an innermost input axis of odd size (no byte packing).
    """
    ndim = w.ndim
    lead, out = tuple(range(num_lead_axes)), tuple(range(ndim - num_out_axes, ndim))
    inner = ndim - num_out_axes - 1
    w32 = w.astype(jnp.float32)
    if qtype == "int8":
        q = _qwix().quantize(w32, jnp.int8, channelwise_axes=lead + out)
        return QuantizedWeight(q.qvalue, q.scale, qtype, num_out_axes, jnp.dtype(w.dtype))
    size = w.shape[inner]
    if size % 2:
        raise ConfigError(
            f"lora_base_dtype=nf4: a weight of shape {tuple(w.shape)} has an odd input axis ({size}), whose "
            "4-bit codes cannot be packed in pairs: use lora_base_dtype=int8"
        )
    codes, scale = _nf4_encode(w32, inner, math.gcd(size, NF4_BLOCK))
    return QuantizedWeight(_pack(codes, inner), scale, qtype, num_out_axes, jnp.dtype(w.dtype))


def _nf4_encode(w32: jax.Array, axis: int, block: int) -> tuple[jax.Array, jax.Array]:
    """qwix's nf4 quantisation (``qwix.quantize(w, "nf4", tiled_axes={axis: block}, every other axis
    channelwise)``), bit for bit, computed in the weight's own shape.

    scale = the block's absmax (1 where below sqrt(float32 tiny), as qwix), the code = the first of the
    nearest NF4 levels to ``w / scale`` (qwix's ``argmin``). qwix's ``fp_to_nf4`` flattens the weight and
    compares each value with the 16 levels at once, which drops the weight's sharding and holds 16 float32
    distances a value.

    Returns:
      uint8 codes [*w.shape] and float32 scales [*w.shape with ``axis`` divided by ``block``].
    """
    shape = w32.shape
    split = w32.reshape(*shape[:axis], shape[axis] // block, block, *shape[axis + 1 :])
    absmax = jnp.max(jnp.abs(split), axis=axis + 1, keepdims=True)
    scale = jnp.where(absmax < np.sqrt(np.finfo(np.float32).tiny), jnp.float32(1), absmax)
    x = (split / scale).reshape(shape)
    codes, nearest = jnp.zeros(shape, jnp.uint8), jnp.abs(NF4_LEVELS[0] - x)
    for k in range(1, 16):
        distance = jnp.abs(NF4_LEVELS[k] - x)
        closer = distance < nearest  # strict: ties keep the lower code, as argmin does
        codes, nearest = jnp.where(closer, np.uint8(k), codes), jnp.where(closer, distance, nearest)
    return codes, jnp.squeeze(scale, axis + 1)


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The weight's float32 values [*shape]: ``code value * scale`` (qwix's ``dequantize``, bit for bit; nf4
    in the weight's own shape, as the module docstring says why)."""
    if w.qtype == "int8":
        qwix = _qwix()
        return qwix.dequantize(qwix.QArray(w.qvalue, w.scale, None, jnp.int8))
    return _times_block_scale(_nf4_lookup(_unpack(w.qvalue, w._inner)), w.scale, w._inner)


def _nf4_lookup(codes: jax.Array) -> jax.Array:
    """NF4_LEVELS[codes] for uint8 codes in [0, 16), float32, elementwise: a tree of selects on the 4 bits.

    The 16 levels enter as ``zero + level`` with ``zero`` computed from the codes (exactly 0.0), not as
    constants broadcast to the weight's shape: those do not depend on the layer, and in the compiled backward
    of the scanned layers they were hoisted out of the loop as weight-sized buffers (4 layers on CPU: 44.9 MB
    of temporaries against 5.3 MB, tests/test_qlora.py's backward test). (A table ``take`` is a gather: on a
    TPU it writes compare masks the size of the weight at every decode step.)
    """
    zero = (codes & 0).astype(jnp.float32)
    levels = [zero + v for v in NF4_LEVELS]
    for bit in range(4):
        set_ = (codes >> bit) & 1 == 1
        levels = [jnp.where(set_, levels[j + 1], levels[j]) for j in range(0, len(levels), 2)]
    return levels[0]


def _times_block_scale(values: jax.Array, scale: jax.Array, axis: int) -> jax.Array:
    """values [.., n, ..] times scale [.., n / b, ..]: each block of b consecutive values along ``axis``."""
    blocks = scale.shape[axis]
    split = values.reshape(*values.shape[:axis], blocks, -1, *values.shape[axis + 1 :])
    return (split * jnp.expand_dims(scale, axis + 1)).reshape(values.shape)


def _pack(codes: jax.Array, axis: int) -> jax.Array:
    """uint8 codes < 16 -> uint8, two a byte along ``axis`` (index 2j in the low nibble, 2j + 1 in the high)."""
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:axis], -1, 2, *codes.shape[axis + 1 :])
    low, high = (jax.lax.index_in_dim(pairs, i, axis + 1, keepdims=False) for i in (0, 1))
    return low | (high << 4)


def _unpack(packed: jax.Array, axis: int) -> jax.Array:
    """The inverse of ``_pack``: uint8 codes < 16 with ``axis`` twice as long, split in place."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)  # code 2j (low nibble), then 2j + 1
    return codes.reshape(*packed.shape[:axis], -1, *packed.shape[axis + 1 :])
