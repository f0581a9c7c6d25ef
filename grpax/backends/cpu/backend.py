"""The CPU backend: the sampler's prefill and decode step for one CPU device, on the kernels of ``ops``.

What it runs, chosen for the default job (float32 SmolLM2 on a few CPU cores; timings in docs/benchmarks.md):

- Prefill: the prompts packed back to back in one sequence (no FLOPs on padding), each token attending within
  its own prompt on the packed-attention kernel; the tokens every prompt starts with (a system prompt, a chat
  template's header; ``shared_prefix_length``) are prefilled once and their keys/values written to every row.
  The projections and MLP are XLA's dots (as fast as the matmul kernel at many rows in float32).
- Decode step: weights repacked once per params version into the matmul kernel's column panels
  (``pack_params``), the pre-norms fused into the matmuls, attention on the paged-attention kernel, which writes
  each new key/value into its page in place and reads only each sequence's filled slots; RoPE cos/sin looked up
  in tables computed once per version.
- Page pools: per layer keys ``[P, K, H, page_size]`` (slot minor, as the kernel's score loop reads them) and
  values ``[P, K, page_size, H]``.

The results equal the model's own ``forward`` (``grpax.models.llama``) to float32 rounding: the sums run in
another order (tests/backends/test_cpu.py holds each kernel and the whole backend to XLA's).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from grpax.backends.cpu import build, ops
from grpax.models.llama import (
    attention_inputs,
    attention_output_and_mlp,
    rms_norm,
    rope_inv_freq,
    rope_tables,
    rotate,
)
from grpax.models.params import Params
from grpax.models.registry import ModelConfig

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def unavailable_reason(params: Params, cfg: ModelConfig, cache_dtype: str | None) -> str | None:
    """Why the CPU backend cannot run these params (None: it can). The caller checks the device (one CPU).

    The kernels take float32 or bfloat16 params, activations and cache, at most ``ops.MAX_GROUP`` query heads
    per KV head, q and k/v widths (heads x head_dim) in whole ``ops.PANEL`` columns, and must build
    (``build.available()``).
    """
    dtypes = [leaf.dtype for leaf in jax.tree.leaves(params)] + [cfg.dtype, cache_dtype or cfg.dtype]
    if any(jnp.dtype(d) not in _KERNEL_DTYPES for d in dtypes):
        return "it takes float32 or bfloat16 params, activations and cache"
    if cfg.num_heads // cfg.num_kv_heads > ops.MAX_GROUP:
        return f"its decode attention takes at most {ops.MAX_GROUP} query heads per KV head"
    if (cfg.num_heads * cfg.head_dim) % ops.PANEL or (cfg.num_kv_heads * cfg.head_dim) % ops.PANEL:
        # the fused q/k/v matmul splits its output at the q and k widths, which pack pads to whole panels
        return f"its fused q/k/v matmul takes q and k/v widths (heads x head_dim) that are multiples of {ops.PANEL}"
    if not build.available():
        return "the CPU kernels could not be built (see the warning above)"
    return None


def shared_prefix_length(prompts: list[list[int]], multiple: int = 8) -> int:
    """Tokens every prompt starts with, rounded down to a ``multiple`` and leaving each prompt one token.

    The rounding keeps the number of compiled prefills small when batches share different numbers of tokens
    by chance. Returns 0 for fewer than two prompts.
    """
    if len(prompts) < 2:
        return 0
    first = prompts[0]
    common = min(len(p) for p in prompts) - 1  # each prompt keeps one token of its own
    for p in prompts[1:]:
        common = min(
            common, next((i for i, (a, b) in enumerate(zip(first, p, strict=False)) if a != b), common)
        )
    return max(common, 0) // multiple * multiple


def packed_length_for(total: int, batch_size: int, prompt_bucket: int) -> int:
    """Packed prefill length for ``total`` prompt tokens: a multiple of 1/8 of the padded ``B * P``.

    At most 8 lengths (compiled shapes) per batch size and prompt bucket, at most B * P / 8 tokens of padding.
    """
    step = -(-batch_size * prompt_bucket // 8)
    return min(-(-total // step) * step, batch_size * prompt_bucket)


def pack_params(params: Params, cfg: ModelConfig) -> Params:
    """Params repacked for the matmul kernel (``ops.matmul``), per-layer weights unrolled.

    Each layer's q/k/v projections become one packed [D, (N + 2K) H] matrix (``qkv``), the output projection
    ``wo``, gate and up one SwiGLU matrix (``gate_up``), the down projection ``down``; the LM head (tied
    embeddings transposed, or ``lm_head``) ``lm_head``. Weights are stored in ``cfg.dtype`` (the dtype XLA's
    path casts them to) and copied once, straight from stacked layers (``ops.pack``); ``embed`` and
    ``final_norm`` stay as they are.

    Args:
      params: the params tree, layers stacked [L, ...] or a list.

    Returns:
      a new tree: ``embed``, ``final_norm``, ``lm_head`` and ``layers``, a list of L dicts.
    """
    dtype = jnp.dtype(cfg.dtype)
    layers = params["layers"]
    # groups of layers stacked [L, ...]: all of them, or each of a list on its own (a free reshape)
    groups = [layers] if isinstance(layers, dict) else [jax.tree.map(lambda x: x[None], la) for la in layers]
    out_layers = []
    for group in groups:
        L, D = group["wq"].shape[:2]
        qkv = ops.pack([group[name].reshape(L, D, -1) for name in ("wq", "wk", "wv")], dtype)
        wo = ops.pack([group["wo"].reshape(L, -1, D)], dtype)
        gate_up = ops.pack([group["w_gate"], group["w_up"]], dtype, swiglu=True)
        down = ops.pack([group["w_down"]], dtype)
        for i in range(L):
            out_layers.append(
                {
                    "attn_norm": group["attn_norm"][i],
                    "mlp_norm": group["mlp_norm"][i],
                    "qkv": qkv[i],
                    "wo": wo[i],
                    "gate_up": gate_up[i],
                    "down": down[i],
                }
            )
    out = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": out_layers}
    if "lm_head" in params:
        (out["lm_head"],) = ops.pack([params["lm_head"][None]], dtype)
    else:
        (out["lm_head"],) = ops.pack([params["embed"][None]], dtype, transposed=True)
    return out


def packed_prefill_forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    rows: jax.Array,
    cache: dict,
    cfg: ModelConfig,
    prefix: int = 0,
) -> tuple[jax.Array, dict]:
    """The decoder over one packed sequence of several rows' prompts, writing each row's KV cache.

    Stacked layers (``scan_layers``) are scanned, as the XLA backend's prefill is: one compiled layer instead of
    L unrolled ones. XLA:CPU links every kernel of a program on pages of its own (code, constants, data: three
    memory mappings each, held while the program lives), and the unrolled layers' weight slices, cache scatters
    and fusions made ~400 kernels of every prefill program, ~1,200 mappings each (a server's warm-up passed
    the kernel's 65,530); a list of layers is unrolled.

    Args:
      params: the params tree, its layers stacked (a dict of [L, ...] weights) or a list of layers.
      tokens: int32 [T] the prompts back to back (no padding between them), after an optional shared prefix.
      positions: int32 [T] each token's position in its row.
      rows: int32 [T] each token's cache row; tokens of a row contiguous and in order; rows out of the cache's
        range (padding, the shared prefix) are not written by the scatter.
      cache: per-layer buffers (``init_cache(..., stacked=False)``): keys L x [B, K, H, S], values
        L x [B, K, S, H]; token t goes to slot ``positions[t]`` of row ``rows[t]``.
      cfg: model config.
      prefix: static A; the first A tokens are a prefix every row shares, written to slots 0..A-1 of every row
        and attended by every later token, whose positions continue from A.

    Returns:
      (final-normed hidden states [1, T, D] in ``cfg.dtype``, the updated cache).
    """
    dtype = jnp.dtype(cfg.dtype)
    positions = positions.astype(jnp.int32)[None]  # [1, T]
    rows = rows.astype(jnp.int32)
    x = params["embed"].astype(dtype)[tokens[None]]
    rope = rope_tables(positions, rope_inv_freq(cfg))
    layer = functools.partial(
        _prefill_layer, rope=rope, positions=positions, rows=rows, prefix=prefix, cfg=cfg
    )
    if isinstance(params["layers"], dict):
        stacked = {name: jnp.stack(buffers) for name, buffers in cache.items()}

        def body(x, scanned):
            w, cache_k, cache_v = scanned
            x, cache_k, cache_v = layer(x, w, cache_k, cache_v)
            return x, (cache_k, cache_v)

        x, (ck, cv) = jax.lax.scan(body, x, (params["layers"], stacked["k"], stacked["v"]))
        cache = {"k": list(ck), "v": list(cv)}
    else:
        ck, cv = list(cache["k"]), list(cache["v"])
        for i, w in enumerate(params["layers"]):
            x, ck[i], cv[i] = layer(x, w, ck[i], cv[i])
        cache = {"k": ck, "v": cv}
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def _prefill_layer(x, layer, cache_k, cache_v, *, rope, positions, rows, prefix: int, cfg: ModelConfig):
    """One decoder block of ``packed_prefill_forward``: its keys and values written to its cache buffers."""
    dtype = jnp.dtype(cfg.dtype)
    w = {name: val.astype(dtype) for name, val in layer.items()}
    q, k, v = attention_inputs(x, w, rope, cfg)
    # Advanced indices split by slices: the indexed view is [1, T, K, H], the layout of k and v.
    cache_k = cache_k.at[rows[None, :], :, :, positions].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[rows[None, :], :, positions, :].set(v.astype(cache_v.dtype), mode="drop")
    num_rows = cache_k.shape[0]
    if prefix:  # the shared prefix's keys/values go to slots 0..A-1 of every row
        pk = jnp.broadcast_to(k[0, :prefix].transpose(1, 2, 0), (num_rows, *k.shape[2:], prefix))
        pv = jnp.broadcast_to(v[0, :prefix].transpose(1, 0, 2), (num_rows, k.shape[2], prefix, k.shape[3]))
        cache_k = cache_k.at[:, :, :, :prefix].set(pk.astype(cache_k.dtype))
        cache_v = cache_v.at[:, :, :prefix, :].set(pv.astype(cache_v.dtype))
    attn = ops.packed_attention(q[0], k[0], v[0], rows, num_rows, prefix)[None]
    return attention_output_and_mlp(x, attn, w, cfg), cache_k, cache_v


def _decode_layer(x, layer, positions, rope, k_pages, v_pages, page_table, cfg: ModelConfig):
    """One decoder block on packed weights for one token per sequence; writes its pages in place."""
    dtype = jnp.dtype(cfg.dtype)
    B, T, D = x.shape
    H, eps = cfg.head_dim, cfg.rms_norm_eps
    NH, KH = cfg.num_heads * H, cfg.num_kv_heads * H
    attn_norm, mlp_norm = layer["attn_norm"].astype(dtype), layer["mlp_norm"].astype(dtype)
    # the kernel writes bfloat16 itself (rounded as .astype does): one pass and one XLA op less per matmul
    out = dtype if dtype == jnp.bfloat16 else jnp.float32
    qkv = ops.matmul(x, layer["qkv"], NH + 2 * KH, norm_weight=attn_norm, eps=eps, out_dtype=out).astype(
        dtype
    )
    q, k, v = (part.reshape(B, T, -1, H) for part in jnp.split(qkv, [NH, NH + KH], axis=-1))
    q, k = rotate(q, *rope), rotate(k, *rope)
    K = k_pages.shape[1]
    q1 = q.reshape(B, K, -1, H).astype(jnp.float32) / math.sqrt(H)  # [B, K, G, H], scaled
    attn, k_pages, v_pages = ops.paged_attention_update(
        q1, k[:, 0], v[:, 0], k_pages, v_pages, page_table, positions
    )
    attn = attn.reshape(B, 1, -1, H).astype(q.dtype)
    x = x + ops.matmul(attn.reshape(B, T, -1), layer["wo"], D, out_dtype=out).astype(dtype)
    # The activation goes from one kernel to the next transposed ([F, B * T]), as the vector tiles read it.
    act = ops.matmul(
        x.reshape(B * T, D),
        layer["gate_up"],
        cfg.mlp_dim,
        swiglu=True,
        transpose_out=True,
        norm_weight=mlp_norm,
        eps=eps,
        out_dtype=out,
    ).astype(dtype)
    down = ops.matmul(act, layer["down"], D, x_transposed=True, out_dtype=out).reshape(B, T, D)
    return x + down.astype(dtype), k_pages, v_pages


@dataclasses.dataclass(frozen=True)
class CpuBackend:
    """The sampler's seam (``grpax.sampler.backend.XlaBackend`` documents each method) on the CPU kernels.

    Hashable: a static argument of the sampler's compiled prefill and decode.
    """

    name: str = "cpu"
    compiler_options: tuple[tuple[str, str], ...] = ()
    prepares_once: bool = True  # packing the weights costs as much as many decode steps
    reads_filled_pages: bool = True  # the kernel reads each sequence's filled pages only

    def init_pages(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> dict:
        L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        return {
            "k": [jnp.zeros((num_pages, K, H, page_size), dtype) for _ in range(L)],
            "v": [jnp.zeros((num_pages, K, page_size, H), dtype) for _ in range(L)],
        }

    def page_spec(self, cfg: ModelConfig, mesh_shape: dict) -> jax.sharding.PartitionSpec:
        return jax.sharding.PartitionSpec()  # one device

    def write_prompts(self, pages: dict, cache: dict, dest: jax.Array) -> dict:
        N, G, P = dest.shape
        page_size = pages["k"][0].shape[-1]
        index = dest.reshape(-1)
        offsets = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32) % page_size, (N, G, P)).reshape(-1)
        out = {"k": [], "v": []}
        for kp, vp, ck, cv in zip(pages["k"], pages["v"], cache["k"], cache["v"], strict=True):
            K, H = ck.shape[1], ck.shape[2]
            k = jnp.broadcast_to(ck.transpose(0, 3, 1, 2)[:, None], (N, G, P, K, H)).reshape(-1, K, H)
            v = jnp.broadcast_to(cv.transpose(0, 2, 1, 3)[:, None], (N, G, P, K, H)).reshape(-1, K, H)
            # Advanced indices split by slices: the indexed view is [T, K, H], the layout of k and v.
            out["k"].append(kp.at[index, :, :, offsets].set(k.astype(kp.dtype), mode="drop"))
            out["v"].append(vp.at[index, :, offsets, :].set(v.astype(vp.dtype), mode="drop"))
        return out

    def plan(self, prompt_tokens: jax.Array, prompt_lengths: jax.Array) -> tuple[int, int]:
        """(packed length, shared prefix length A) for right-padded prompts [B, P] of these lengths."""
        prompt_tokens, prompt_lengths = np.asarray(prompt_tokens), np.asarray(prompt_lengths)
        B, P = prompt_tokens.shape
        prompts = [row[:n].tolist() for row, n in zip(prompt_tokens, prompt_lengths, strict=True)]
        prefix = shared_prefix_length(prompts)
        return packed_length_for(int(np.sum(prompt_lengths)) - (B - 1) * prefix, B, P), prefix

    def prefill(
        self,
        params: Params,
        prompt_tokens: jax.Array,
        prompt_lengths: jax.Array,
        cache: dict,
        cfg: ModelConfig,
        plan: tuple[int, int],
    ) -> tuple[jax.Array, dict]:
        packed_length, A = plan
        B, P = prompt_tokens.shape
        # The shared prefix (A tokens, taken from row 0) first, then token t >= A of prompt b at packed index
        # offsets[b] + t - A. The prefix and the padding get row B, which the scatter drops; the prefix is
        # written to every row by packed_prefill_forward itself.
        suffix = prompt_lengths - A
        offsets = A + jnp.cumsum(suffix) - suffix
        t = jnp.arange(P, dtype=jnp.int32)[None, :]
        index = jnp.where((t >= A) & (t < prompt_lengths[:, None]), offsets[:, None] + t - A, packed_length)
        index = index.at[0, :A].set(jnp.arange(A, dtype=jnp.int32))
        packed = jnp.zeros((packed_length,), jnp.int32).at[index].set(prompt_tokens, mode="drop")
        rows = (
            jnp.full((packed_length,), B, jnp.int32)
            .at[index]
            .set(jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, P)), mode="drop")
            .at[:A]
            .set(B)
        )
        positions = (
            jnp.zeros((packed_length,), jnp.int32).at[index].set(jnp.broadcast_to(t, (B, P)), mode="drop")
        )
        hidden, cache = packed_prefill_forward(params, packed, positions, rows, cache, cfg, prefix=A)
        return hidden[0, offsets + suffix - 1], cache  # [B, D]

    def prepare_decode(self, params: Params, cfg: ModelConfig, num_slots: int):
        # RoPE cos/sin of every position the loop reaches, computed once: computed inside the step, XLA:CPU
        # re-derived them in every layer's fusions (~8 ms of a 64-row step).
        cos, sin = rope_tables(jnp.arange(num_slots, dtype=jnp.int32)[None], rope_inv_freq(cfg))
        return pack_params(params, cfg), (cos[0, :, 0], sin[0, :, 0])

    def decode_step(
        self,
        prepared,
        tokens: jax.Array,
        positions: jax.Array,
        pages: dict,
        page_table: jax.Array,
        cfg: ModelConfig,
    ) -> tuple[jax.Array, dict]:
        params, (cos, sin) = prepared
        x = params["embed"].astype(jnp.dtype(cfg.dtype))[tokens[:, None]]  # [B, 1, D]
        at = jnp.maximum(positions, 0)[:, None]
        rope = (cos[at][:, :, None, :], sin[at][:, :, None, :])
        ck, cv = list(pages["k"]), list(pages["v"])
        for i, layer in enumerate(params["layers"]):
            x, ck[i], cv[i] = _decode_layer(x, layer, positions, rope, ck[i], cv[i], page_table, cfg)
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        return ops.matmul(x[:, 0], params["lm_head"], cfg.vocab_size), {"k": ck, "v": cv}
