"""The decoder of every supported family as one pure function: ``forward(params, tokens, cfg) -> (logits, cache)``.

Matches Hugging Face ``LlamaForCausalLM`` (transformers ``modeling_llama.py``): RMSNorm computed in float32,
rotary embeddings in the rotate-half layout with optional Llama 3 frequency scaling, grouped-query attention,
SwiGLU MLP, optional tied embeddings, and a ``head_dim`` that need not equal hidden_dim / num_heads. The
family fields of ``ModelConfig`` add what the others change (transformers ``modeling_mistral``,
``modeling_qwen2``, ``modeling_qwen3``, ``modeling_gemma2``, ``modeling_gemma3``): q/k/v biases, per-head
q/k RMSNorm before RoPE, Gemma's (1 + w) RMSNorm in float32, norms after attention and MLP, GeGLU, embeddings
scaled by sqrt(D), ``query_pre_attn_scalar``, attention and final logit soft-capping (Gemma 2 report), and
sliding-window attention on the local layers, with Gemma 3's local RoPE base (Gemma 3 report).

Attention is ``grpax.models.attention`` (one implementation, ``cfg.attention``, resolved once per trace);
each block step runs under ``jax.named_scope`` (qkv, rope, kv_cache, attention, attention_out, mlp; the vocabulary
projection under logits), so profiles read like this code.

Positions are per row, so left-padded, right-padded and packed-by-mask batches give the same logits for their
real tokens as unpadded rows. The KV cache layout keeps the token of position p at cache slot p of its row:
each row advances at its own pace and a query at position p attends exactly to slots 0..p.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from grpax.models import moe
from grpax.models.attention import (
    DOT_PRODUCT,
    Implementation,
    cached_attention,
    chunked_attention,
    paged_attention,
    select_attention,
    softcap,
    window_mask,
    write_pages,
)
from grpax.models.params import Params
from grpax.models.quantize import QuantizedWeight
from grpax.models.registry import ModelConfig
from grpax.models.sharding_rules import constrain

# Logical axes of the residual stream [B, T, D]; pinned at block edges when run inside jax.set_mesh(mesh).
_RESIDUAL = ("batch", "length", "act_embed")


def _yarn(inv_freq: jax.Array, theta: float, H: int, scaling: dict[str, float]) -> jax.Array:
    """YaRN's frequencies (Peng et al. 2023; transformers ``_compute_yarn_parameters``): the low frequencies
    interpolated by ``factor``, the high ones kept, a linear ramp between the dimensions that turn
    ``beta_slow`` and ``beta_fast`` times over ``original_max_position_embeddings`` (GPT-OSS)."""
    factor, length = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim(rotations: float) -> float:
        return (H * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim(scaling["beta_fast"]), dim(scaling["beta_slow"])
    if scaling.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(H // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return (inv_freq / factor) * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor of YaRN's cos and sin tables (its ``attention_factor``: 0.1 ln(factor) + 1), else 1."""
    scaling = cfg.rope_scaling_dict or {}
    if "beta_fast" not in scaling:
        return 1.0
    if "attention_factor" in scaling:
        return scaling["attention_factor"]
    return 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """Inverse RoPE frequencies float32 [H/2] of the global layers (``local``: of the local layers).

    Global layers scale them by ``cfg.rope_scaling``: Llama 3's (transformers ``_compute_llama3_parameters``,
    Llama 3 herd paper, section 3.2 long context), linear (``inv_freq / factor``, Gemma 3) or YaRN (``_yarn``,
    GPT-OSS). Local layers use ``cfg.rope_local_theta`` unscaled when it is set (Gemma 3), else the global
    frequencies.
    """
    H = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    scaling = cfg.rope_scaling_dict
    if not scaling or (local and cfg.rope_local_theta):
        return inv_freq
    if "beta_fast" in scaling:
        return _yarn(inv_freq, theta, H, scaling)
    if "low_freq_factor" not in scaling:  # linear
        return inv_freq / scaling["factor"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(
    positions: jax.Array, inv_freq: jax.Array, factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) float32 [B, T, 1, H/2] of the RoPE angles ``positions`` int [B, T] x ``inv_freq`` [H/2], times
    ``factor`` (YaRN's ``rope_attention_factor``)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` [B, T, heads, H] by the angles of ``rope_tables`` (rotate-half layout, as HF Llama)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis in float32.

    Llama (``offset`` 0): cast back to ``x.dtype`` before the weight, as HF ``LlamaRMSNorm``. Gemma (``offset``
    1): scaled by ``1 + weight`` in float32, then cast, as HF ``Gemma2RMSNorm``.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def _scale(cfg: ModelConfig) -> float | None:
    """The scores' factor when it is not 1 / sqrt(H) (``query_pre_attn_scalar``), else None."""
    return None if cfg.query_pre_attn_scalar is None else cfg.attention_scale


def _pick(local, global_value, local_value):
    """The local layer's value where ``local`` (a Python or traced bool; None: no local layers) holds."""
    if local is None or local is False or global_value is local_value:
        return global_value
    if local is True:
        return local_value
    return jax.tree.map(lambda g, lv: jnp.where(local, lv, g), global_value, local_value)


def _layer(
    x,
    layer,
    positions,
    mask,
    rope,
    cfg: ModelConfig,
    cache_k=None,
    cache_v=None,
    index=None,
    local=None,
    impl: Implementation = DOT_PRODUCT,
    route=None,
    weights=None,
):
    """One decoder block; returns (x, cache_k, cache_v, its ``moe.Routing`` or None for a dense MLP).

    ``mask`` and ``rope`` are (global, local) pairs; ``local`` says which this layer takes (None: global);
    ``impl`` is the attention (``select_attention``); ``route`` int [B, T, k] the expert ids to route by
    (routing replay) or None, ``weights`` [B, T] the tokens' weights in the routing statistics.
    With a cache (the decode layout of ``init_cache``: keys [.., B, K, H, S], values [.., B, K, S, H]),
    ``cache_k``/``cache_v`` are either this layer's own buffers (``index=None``) or the whole stacked caches
    with ``index`` this layer's position in them. The new keys/values are scattered in place at slot
    ``positions[b, t]`` of row b (the caches are loop carries, so XLA updates them without copying) and the
    queries attend over the cache.
    """
    dtype = jnp.dtype(cfg.dtype)
    w = {name: val.astype(dtype) for name, val in layer.items()}
    mask, rope = _pick(local, *mask), _pick(local, *rope)
    x = checkpoint_name(x, "decoder_layer_input")  # remat_policy=custom's names (MaxText's), here and below
    q, k, v = attention_inputs(x, w, rope, cfg)
    scale, cap, sinks = _scale(cfg), cfg.attn_logit_softcap, w.get("sinks")
    if cache_k is not None:
        rows = jnp.arange(x.shape[0])[:, None]
        # Advanced indices split by slices: the indexed view is [B, T, K, H], the layout of k and v.
        with jax.named_scope("kv_cache"):
            if index is None:
                cache_k = cache_k.at[rows, :, :, positions].set(k.astype(cache_k.dtype), mode="drop")
                cache_v = cache_v.at[rows, :, positions, :].set(v.astype(cache_v.dtype), mode="drop")
                layer_k, layer_v = cache_k, cache_v
            else:
                cache_k = cache_k.at[index, rows, :, :, positions].set(k.astype(cache_k.dtype), mode="drop")
                cache_v = cache_v.at[index, rows, :, positions, :].set(v.astype(cache_v.dtype), mode="drop")
                layer_k, layer_v = cache_k[index], cache_v[index]
        with jax.named_scope("attention"):
            attn = cached_attention(q, layer_k, layer_v, mask, scale, cap, impl, sinks)
    else:
        with jax.named_scope("attention"):
            attn = impl.attend(q, k, v, mask, scale, cap, sinks)
    x, routing = output_and_mlp(x, attn, w, cfg, route, weights)
    return x, cache_k, cache_v, routing


def _project(h: jax.Array, w: dict, name: str, cfg: ModelConfig) -> jax.Array:
    """h [B * T, D] @ w[name] [D, heads, H] (+ its bias, + its per-head RMSNorm) -> [B * T, heads, H]."""
    out = h @ w[name].reshape(h.shape[-1], -1)
    if cfg.attention_bias:
        out = out + w[f"{name[1]}_bias"].reshape(-1)
    out = out.reshape(h.shape[0], -1, cfg.head_dim)
    if cfg.qk_norm and name in ("wq", "wk"):
        out = rms_norm(out, w[f"{name[1]}_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return out


def attention_inputs(x: jax.Array, w: dict, rope, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """Pre-norm and q/k/v projections of x [B, T, D]: rotated q [B, T, N, H], rotated k and v [B, T, K, H]."""
    B, T, D = x.shape
    # Tokens flattened to one matrix dimension and heads merged into one ([D, N, H] -> [D, N * H] is free in
    # row-major order): with two contracting or batch-like dims, XLA:CPU transposed weights in the decode and
    # activations for the weight gradients of the backward pass at every layer.
    with jax.named_scope("qkv"):
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset).reshape(B * T, D)
        q, k, v = (
            checkpoint_name(_project(h, w, name, cfg), tag).reshape(B, T, -1, cfg.head_dim)
            for name, tag in (("wq", "query_proj"), ("wk", "key_proj"), ("wv", "value_proj"))
        )
    with jax.named_scope("rope"):
        return rotate(q, *rope), rotate(k, *rope), v


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


def attention_output_and_mlp(x: jax.Array, attn: jax.Array, w: dict, cfg: ModelConfig) -> jax.Array:
    """The rest of the block: x + attn [B, T, N, H] @ wo, then the pre-normed gated MLP's residual (each
    output RMS-normed before its residual add when ``cfg.post_norms``)."""
    return output_and_mlp(x, attn, w, cfg)[0]


def output_and_mlp(x: jax.Array, attn: jax.Array, w: dict, cfg: ModelConfig, route=None, weights=None):
    """``attention_output_and_mlp`` with a mixture of experts' routing: returns (x [B, T, D], ``moe.Routing``
    of the layer or None when its MLP is dense); ``route`` and ``weights`` as in ``_layer``."""
    B, T, D = x.shape
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    with jax.named_scope("attention_out"):
        out = checkpoint_name(
            checkpoint_name(attn, "context").reshape(B * T, -1) @ w["wo"].reshape(-1, D), "out_proj"
        )
        if cfg.attention_out_bias:
            out = out + w["o_bias"]
        if cfg.post_norms:
            out = rms_norm(out, w["attn_post_norm"], eps, offset)
        x = x.reshape(B * T, D) + out
    routing = None
    with jax.named_scope("mlp"):
        h = rms_norm(x, w["mlp_norm"], eps, offset)
        if cfg.num_experts:
            out, routing = moe.moe_mlp(h.reshape(B, T, D), w, cfg, route, weights)
            out = out.reshape(B * T, D)
        else:
            gate, up = checkpoint_name(h @ w["w_gate"], "mlpwi_0"), checkpoint_name(h @ w["w_up"], "mlpwi_1")
            out = checkpoint_name((_ACTIVATIONS[cfg.mlp_activation](gate) * up) @ w["w_down"], "mlpwo")
        if cfg.post_norms:
            out = rms_norm(out, w["mlp_post_norm"], eps, offset)
        return (x + out).reshape(B, T, D), routing


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings [B, T, D] in ``cfg.dtype``, times sqrt(D) rounded to that dtype when
    ``cfg.scale_embeddings`` (Gemma's normaliser)."""
    dtype = jnp.dtype(cfg.dtype)
    x = params["embed"].astype(dtype)[tokens]
    if cfg.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(cfg.hidden_dim), dtype)
    return constrain(x, _RESIDUAL)


def rope_pair(positions: jax.Array, cfg: ModelConfig) -> tuple:
    """(global, local) RoPE tables of ``positions`` int [B, T] (``rope_tables``); one pair object when equal."""
    glob = rope_tables(positions, rope_inv_freq(cfg), rope_attention_factor(cfg))
    if cfg.rope_local_theta is None or not any(cfg.local_layers):
        return glob, glob
    return glob, rope_tables(positions, rope_inv_freq(cfg, local=True))


def _local_flags(cfg: ModelConfig):
    """Per layer, a Python bool for the local layers (None for all when no layer is local)."""
    return cfg.local_layers if any(cfg.local_layers) else (None,) * cfg.num_layers


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.dots_saveable,
}


def _custom_policy(remat_names: tuple[tuple[str, str], ...]):
    """MaxText's ``remat_policy=custom``: the activations named by ``checkpoint_name`` saved on the device or
    offloaded to pinned host memory, as ``remat_names`` says; everything else recomputed."""
    kept = lambda choice: [name for name, c in remat_names if c == choice]  # noqa: E731
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=kept("device"), names_which_can_be_offloaded=kept("offload"),
        offload_src="device", offload_dst="pinned_host",
    )  # fmt: skip


def _maybe_remat(fn, cfg: ModelConfig):
    if cfg.remat_policy == "none":
        return fn
    if cfg.remat_policy == "custom":
        return jax.checkpoint(fn, policy=_custom_policy(cfg.remat_names))
    if cfg.remat_policy not in _REMAT_POLICIES:
        raise ValueError(f"remat_policy={cfg.remat_policy!r}: expected none, {', '.join(_REMAT_POLICIES)}")
    return jax.checkpoint(fn, policy=_REMAT_POLICIES[cfg.remat_policy])


def default_positions(tokens: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
    """Positions int32 [B, T]: 0.. over real tokens (``cumsum(mask) - 1``, clipped at 0), or ``arange``."""
    if attention_mask is None:
        return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)


def init_cache(
    cfg: ModelConfig, batch_size: int, max_length: int, dtype: str | None = None, stacked: bool = True
) -> dict:
    """An empty KV cache in the decode layout, in ``dtype`` (default ``cfg.dtype``).

    Keys are [L, B, K, H, S] and values [L, B, K, S, H] (S = ``max_length`` slots): decode attention reads
    both in place (``cached_attention``). With ``stacked=False`` each is a list of L per-layer
    buffers without the L axis (for unstacked params: each buffer is then updated in place on its own).
    """
    L, B, K, H, S = cfg.num_layers, batch_size, cfg.num_kv_heads, cfg.head_dim, max_length
    dtype = jnp.dtype(dtype or cfg.dtype)
    if stacked:
        return {"k": jnp.zeros((L, B, K, H, S), dtype), "v": jnp.zeros((L, B, K, S, H), dtype)}
    return {
        "k": [jnp.zeros((B, K, H, S), dtype) for _ in range(L)],
        "v": [jnp.zeros((B, K, S, H), dtype) for _ in range(L)],
    }


def forward(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    cache: dict | None = None,
    return_hidden: bool = False,
    routes: jax.Array | None = None,
    return_routes: bool = False,
) -> tuple:
    """Runs the decoder.

    Args:
      params: the params tree (``grpax.models.params``), stacked or unstacked layers.
      tokens: int32 [B, T] token ids.
      cfg: model config (``dtype`` sets the activation dtype).
      positions: int32 [B, T] position of each token; default ``cumsum(attention_mask) - 1``.
      attention_mask: [B, T], 1 for real tokens, 0 for padding (keys that must not be attended). Only used
        without a cache; with a cache, visibility is ``slot <= position``.
      cache: optional KV cache from ``init_cache`` (keys [L, B, K, H, S], values [L, B, K, S, H]); each
        token is written at slot ``positions[b, t]`` of its row and attends to slots ``0..positions[b, t]``
        (on a local layer, only the last ``cfg.sliding_window`` of them: ``window_mask``).
        With per-layer params (a list) the cache may also be lists of L per-layer buffers
        (``init_cache(..., stacked=False)``, fastest decode on CPU); it comes back in the form it was given.
      return_hidden: return the final-normed hidden states [B, T, D] instead of logits.
      routes: a mixture of experts' expert ids to route each token by, int [B, T, L, k] (routing replay,
        ``grpax.models.moe``); None: each router's own top-k.
      return_routes: also return the routing (a mixture of experts; None for a dense model).

    Returns:
      (logits float32 [B, T, V] — or hidden [B, T, D] in ``cfg.dtype`` — and the updated cache or None), and
      with ``return_routes`` a third element: ``moe.Routing`` with ``experts`` int [B, T, L, k] (each router's
      own top-k) and the per-layer statistics [L, ...] over the tokens of ``attention_mask``, or None.
    """
    if positions is None:
        positions = default_positions(tokens, attention_mask)
    positions = positions.astype(jnp.int32)
    x = embed(params, tokens, cfg)
    rope = rope_pair(positions, cfg)  # (cos, sin) of the global and the local layers, shared by every layer
    mask = _forward_mask(positions, attention_mask, cache, cfg)
    layer_fn = _maybe_remat(functools.partial(_layer, cfg=cfg, impl=select_attention(cfg)), cfg)
    ck = cache["k"] if cache is not None else None
    cv = cache["v"] if cache is not None else None
    layer_routes = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [L, B, T, k]
    weights = None if attention_mask is None or cache is not None else attention_mask
    x, ck, cv, routing = _run_layers(
        layer_fn,
        params["layers"],
        (x, ck, cv),
        (positions, mask, rope),
        _local_flags(cfg),
        layer_routes,
        weights,
    )
    new_cache = {"k": ck, "v": cv} if cache is not None else None
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    out = x if return_hidden else logits_from_hidden(params, x, cfg)
    if not return_routes:
        return out, new_cache
    if routing is not None:
        routing = routing._replace(experts=jnp.moveaxis(routing.experts, 0, 2))
    return out, new_cache, routing


def _forward_mask(
    positions: jax.Array, attention_mask: jax.Array | None, cache: dict | None, cfg: ModelConfig
):
    """``forward``'s (global, local) masks bool [B, T, S]: causal over positions and the attention mask without
    a cache; ``slot <= position`` over the cache's S slots with one (slot s holds position s of its row)."""
    if cache is None:
        idx = jnp.arange(positions.shape[1])
        mask = (positions[:, None, :] <= positions[:, :, None]) & (idx[None, :] <= idx[:, None])[None]
        if attention_mask is not None:
            mask = mask & attention_mask.astype(bool)[:, None, :]
        return window_mask(mask, positions, positions, cfg)
    S = cache["k"][0].shape[-1] if isinstance(cache["k"], (list, tuple)) else cache["k"].shape[-1]
    slots = jnp.arange(S, dtype=jnp.int32)[None]
    return window_mask(slots[:, None, :] <= positions[:, :, None], positions, slots, cfg)


def _run_layers(layer_fn, layers, carry: tuple, inputs: tuple, flags, routes, weights):
    """The decoder's layers over ``carry`` = (x, cache_k, cache_v): stacked weights scanned (one compiled block,
    the cache in the carry), listed ones unrolled (per-layer cache buffers each updated in place on their own).
    ``inputs`` = (positions, mask, rope) of every layer; ``routes`` int [L, B, T, k] or None.

    Returns:
      (x, cache_k, cache_v, ``moe.Routing`` stacked over layers [L, ...], or None for dense MLPs).
    """
    if isinstance(layers, dict):  # stacked [L, ...]

        def body(carry, xs):
            layer, i, local, route = xs
            x, ck, cv, routing = layer_fn(
                *carry[:1], layer, *inputs, cache_k=carry[1], cache_v=carry[2], index=i, local=local,
                route=route, weights=weights,
            )  # fmt: skip
            return (constrain(x, _RESIDUAL), ck, cv), routing

        num_layers = jax.tree.leaves(layers)[0].shape[0]
        local = None if flags[0] is None else jnp.asarray(flags)
        carry, routing = jax.lax.scan(body, carry, (layers, jnp.arange(num_layers), local, routes))
        return (*carry, routing)
    x, ck, cv = carry
    listed = isinstance(ck, (list, tuple))  # per-layer cache buffers
    if listed:
        ck, cv = list(ck), list(cv)
    per_layer = []
    for i, layer in enumerate(layers):
        kw = dict(local=flags[i], route=None if routes is None else routes[i], weights=weights)
        if listed:
            x, ck[i], cv[i], routing = layer_fn(x, layer, *inputs, cache_k=ck[i], cache_v=cv[i], **kw)
        else:
            x, ck, cv, routing = layer_fn(x, layer, *inputs, cache_k=ck, cache_v=cv, index=i, **kw)
            x = constrain(x, _RESIDUAL)
        per_layer.append(routing)
    stacked = None if per_layer[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    return x, ck, cv, stacked


def decode_paged(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    pages: list,
    page_table: jax.Array,
    cfg: ModelConfig,
    implementation: str = "xla",
    return_routes: bool = False,
) -> tuple:
    """One token per sequence over a paged KV cache (the sampler's decode step; the layout is
    ``grpax.models.attention``'s): each token's key and value are written at its position's page and offset,
    then it attends to positions 0..position of its own sequence (on a local layer, the last
    ``cfg.sliding_window`` of them).

    Args:
      params: the params tree with a list of layers (``convert_layout(..., scan_layers=False)``), or stacked
        layers [L, ...] (the layers scanned over one pool of every layer's pages: ``_decode_scanned``); a
        layer's ``wo`` [N, H, D] or its [N * H, D] view, its ``wq``/``wk``/``wv`` [D, heads, H] or [D, heads * H]
        (the views ``output_and_mlp`` and ``_project`` multiply by; ``grpax.sampler.backend.merge_heads``).
      tokens: int32 [S] one token per sequence.
      positions: int32 [S] its position; -1 marks an idle slot (its key goes to page 0, the pool's scratch page;
        with stacked layers each layer's page 0, row i * P; its output is meaningless).
      pages: L per-layer pools [P, page_size, 2K, H] (updated in place inside a loop or a donated call); with
        stacked layers one pool [L * P, page_size, 2K, H], layer i's pages at rows i * P ...
      page_table: int32 [S, n] each sequence's pages in order, n * page_size > its position.
      cfg: model config.
      implementation: ``grpax.models.attention.PAGED_IMPLEMENTATIONS``.
      return_routes: also return the experts each token was routed to (a mixture of experts).

    Returns:
      (final-normed hidden states [S, D] in ``cfg.dtype``, the updated pools), and with ``return_routes`` the
      expert ids int [S, L, k] (``moe.Routing.experts``; each router's own top-k).
    """
    idle = positions < 0
    pos = jnp.maximum(positions, 0).astype(jnp.int32)
    page_size = pages[0].shape[1]
    table = jnp.where(idle[:, None], 0, page_table)
    write_page = jnp.take_along_axis(table, (pos // page_size)[:, None], axis=1)[:, 0]
    offset = jnp.where(idle, 0, pos % page_size)
    lengths = pos + 1
    x = embed(params, tokens[:, None], cfg)  # [S, 1, D]
    rope = rope_pair(pos[:, None], cfg)
    if isinstance(params["layers"], dict):
        step = (x, rope, table, write_page, offset, lengths)
        return _decode_scanned(params, step, pages, cfg, implementation, return_routes)
    dtype = jnp.dtype(cfg.dtype)
    scale, cap = _scale(cfg), cfg.attn_logit_softcap
    pages, experts = list(pages), []
    for i, (layer, local) in enumerate(zip(params["layers"], _local_flags(cfg), strict=True)):
        w = {name: val.astype(dtype) for name, val in layer.items()}
        q, k, v = attention_inputs(x, w, _pick(local, *rope), cfg)
        with jax.named_scope("kv_cache"):
            pages[i] = write_pages(pages[i], k[:, 0], v[:, 0], write_page, offset)
        with jax.named_scope("attention"):
            window = cfg.sliding_window if local else None
            attn = paged_attention(
                q[:, 0], pages[i], table, lengths, scale, cap, window, implementation, w.get("sinks")
            )
        x, routing = output_and_mlp(x, attn[:, None], w, cfg)
        if routing is not None:
            experts.append(routing.experts[:, 0])  # [S, k]
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if not return_routes:
        return x[:, 0], pages
    return x[:, 0], pages, jnp.stack(experts, axis=1)  # [S, L, k]


def _decode_scanned(
    params: Params, step: tuple, pages: list, cfg: ModelConfig, implementation: str, routes: bool
):
    """``decode_paged``'s layers scanned: stacked weights [L, ...], one pool of every layer's pages
    ``[L * P, page_size, 2K, H]`` (layer i's page p at row i * P + p; ``pages`` = [that pool]) in the loop's
    carry, written in place. One compiled layer instead of L: the TPU compiler generates code per fusion, and
    the unrolled decode's L copies of each layer's fusions were most of its compile (docs/benchmarks.md). No
    local (sliding-window) layers: their window is a static argument of the attention."""
    assert not any(cfg.local_layers), "a scanned decode has no local layers"
    x, rope, table, write_page, offset, lengths = step
    pool = pages[0]
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    P = pool.shape[0] // num_layers
    dtype, scale, cap = jnp.dtype(cfg.dtype), _scale(cfg), cfg.attn_logit_softcap

    def body(carry, xs):
        x, pool = carry
        layer, i = xs
        w = {name: val.astype(dtype) for name, val in layer.items()}
        q, k, v = attention_inputs(x, w, _pick(None, *rope), cfg)
        with jax.named_scope("kv_cache"):
            pool = write_pages(pool, k[:, 0], v[:, 0], write_page + i * P, offset)
        with jax.named_scope("attention"):
            attn = paged_attention(
                q[:, 0], pool, table + i * P, lengths, scale, cap, None, implementation, w.get("sinks")
            )
        x, routing = output_and_mlp(x, attn[:, None], w, cfg)
        return (x, pool), (None if routing is None else routing.experts[:, 0])

    (x, pool), experts = jax.lax.scan(body, (x, pool), (params["layers"], jnp.arange(num_layers)))
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if not routes:
        return x[:, 0], [pool]
    return x[:, 0], [pool], jnp.moveaxis(experts, 0, 1)  # [S, L, k]


def forward_grouped(
    params: Params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    completion_ids: jax.Array,
    cfg: ModelConfig,
    routes: tuple[jax.Array, jax.Array] | None = None,
    return_routes: bool = False,
):
    """The hidden states that predict each completion token, each prompt run once for its whole group.

    Row r of ``completion_ids`` continues prompt r // G (G = completion rows / prompt rows, a GRPO group). The
    prompt tokens of a group are the same in its G rows and attend only to each other, so their keys, values
    and hidden states are computed once per prompt and the G completions attend to them: the same hidden
    states as ``forward`` on each row's concat(prompt, completion), for m * P + B * C tokens instead of
    B * (P + C) (Prefix Grouper, Liu et al. 2025, "Efficient GRPO Training through Shared-Prefix Forward").
    Gradients reach the shared prompt from all G completions.

    Args:
      params: the params tree, stacked or unstacked layers.
      prompt_ids: int32 [m, P] left-padded prompts; prompt_mask: [m, P], 1 for real tokens (each row has one).
      completion_ids: int32 [B, C], B a multiple of m; tokens after a row's end are never attended by its
        real tokens (they come later), so no completion mask is needed.
      cfg: model config.

      routes: a mixture of experts' expert ids to route by (routing replay, ``grpax.models.moe``): (prompt
        routes int [m, P, L, k], completion routes int [B, C, L, k]); None: each router's own top-k.
      return_routes: also return the routing of the prompts and of the completions.

    Returns:
      Final-normed hidden states [B, C, D] in ``cfg.dtype``: position t holds the state after prompt + the
      completion's first t tokens (t = 0: the prompt's last token), the one that predicts completion token t.
      With ``return_routes``: (hidden, (prompt ``moe.Routing``, completion ``moe.Routing``)), their ``experts``
      [m, P, L, k] and [B, C, L, k] (each router's own top-k), the statistics over the real prompt tokens and
      every completion token; (hidden, None) for a dense model.
    """
    m, P = prompt_ids.shape
    B, C = completion_ids.shape
    G = B // m
    dtype = jnp.dtype(cfg.dtype)
    positions_p = default_positions(prompt_ids, prompt_mask)
    prompt_lengths = jnp.repeat(prompt_mask.astype(jnp.int32).sum(axis=1), G)  # [B]
    positions_c = prompt_lengths[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    rope_p, rope_c = rope_pair(positions_p, cfg), rope_pair(positions_c, cfg)
    mask_p, mask_c = _grouped_masks(prompt_mask, positions_p, positions_c, G, cfg)
    scale, cap, impl = _scale(cfg), cfg.attn_logit_softcap, select_attention(cfg)
    weights_p = prompt_mask.astype(jnp.float32)

    def layer_fn(xp, xc, layer, local, route_p, route_c):
        w = {name: val.astype(dtype) for name, val in layer.items()}
        xp, xc = checkpoint_name(xp, "decoder_layer_input"), checkpoint_name(xc, "decoder_layer_input")
        qp, kp, vp = attention_inputs(xp, w, _pick(local, *rope_p), cfg)
        qc, kc, vc = attention_inputs(xc, w, _pick(local, *rope_c), cfg)
        sinks = w.get("sinks")
        with jax.named_scope("attention"):
            attn_p = chunked_attention(qp, kp, vp, _pick(local, *mask_p), scale, cap, impl, sinks)
            k = jnp.concatenate([jnp.repeat(kp, G, axis=0), kc], axis=1)  # [B, P + C, K, H]
            v = jnp.concatenate([jnp.repeat(vp, G, axis=0), vc], axis=1)
            attn_c = chunked_attention(qc, k, v, _pick(local, *mask_c), scale, cap, impl, sinks)
        xp, routing_p = output_and_mlp(xp, attn_p, w, cfg, route_p, weights_p)
        xc, routing_c = output_and_mlp(xc, attn_c, w, cfg, route_c)
        return (constrain(xp, _RESIDUAL), constrain(xc, _RESIDUAL)), (routing_p, routing_c)

    layer_fn = _maybe_remat(layer_fn, cfg)
    xp, xc = embed(params, prompt_ids, cfg), embed(params, completion_ids, cfg)
    layers, flags = params["layers"], _local_flags(cfg)
    route_p, route_c = (None, None) if routes is None else (jnp.moveaxis(r, 2, 0) for r in routes)  # [L, ...]
    if isinstance(layers, dict):  # stacked [L, ...]: one compiled block, scanned
        local = None if flags[0] is None else jnp.asarray(flags)
        (xp, xc), routing = jax.lax.scan(
            lambda carry, xs: layer_fn(*carry, *xs), (xp, xc), (layers, local, route_p, route_c)
        )
    else:
        per_layer = []
        for i, (layer, local) in enumerate(zip(layers, flags, strict=True)):
            pick = (None, None) if routes is None else (route_p[i], route_c[i])
            (xp, xc), r = layer_fn(xp, xc, layer, local, *pick)
            per_layer.append(r)
        routing = jax.tree.map(lambda *a: jnp.stack(a), *per_layer) if cfg.num_experts else None
    last_prompt = jnp.repeat(xp[:, -1:], G, axis=0)  # [B, 1, D]: predicts completion token 0
    hidden = jnp.concatenate([last_prompt, xc[:, :-1]], axis=1)
    hidden = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if not return_routes:
        return hidden
    if not cfg.num_experts:
        return hidden, None
    return hidden, tuple(r._replace(experts=jnp.moveaxis(r.experts, 0, 2)) for r in routing)


def _grouped_masks(prompt_mask, positions_p, positions_c, G: int, cfg: ModelConfig):
    """``forward_grouped``'s (global, local) masks: the prompts' [m, P, P] (causal over their real tokens) and the
    completions' [B, C, P + C] (the row's prompt, then its own earlier completion tokens), windows counted in
    positions across the prompt/completion seam."""
    m, P = prompt_mask.shape
    B, C = positions_c.shape
    key_valid = prompt_mask.astype(bool)  # [m, P]
    causal_p = jnp.tril(jnp.ones((P, P), bool))
    mask_p = window_mask(causal_p[None] & key_valid[:, None, :], positions_p, positions_p, cfg)
    mask_c = jnp.concatenate(
        [
            jnp.broadcast_to(jnp.repeat(key_valid, G, axis=0)[:, None, :], (B, C, P)),
            jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool))[None], (B, C, C)),
        ],
        axis=-1,
    )
    key_positions_c = jnp.concatenate([jnp.repeat(positions_p, G, axis=0), positions_c], axis=1)
    return mask_p, window_mask(mask_c, positions_c, key_positions_c, cfg)


def logits_from_hidden(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Projects final hidden states [..., D] to float32 logits [..., V] (tied embeddings when no lm_head),
    soft-capped by ``cfg.final_logit_softcap`` (Gemma 2): the logits the sampler samples and the trainer scores."""
    dtype = jnp.dtype(cfg.dtype)
    with jax.named_scope("logits"):
        if "lm_head" in params:
            logits = jnp.einsum(
                "...D,DV->...V", hidden, params["lm_head"].astype(dtype), preferred_element_type=jnp.float32
            )
        else:
            logits = jnp.einsum(
                "...D,VD->...V", hidden, params["embed"].astype(dtype), preferred_element_type=jnp.float32
            )
        return softcap(logits, cfg.final_logit_softcap)


def round_as_read(params: Params, cfg: ModelConfig) -> Params:
    """``params`` rounded as the forward reads them: the same forward, bit for bit, in fewer bytes.

    The forward rounds every weight to the compute dtype ``cfg.dtype`` before it uses it (``_layer`` and
    ``forward_grouped``'s layers, ``embed``, ``logits_from_hidden``; Llama's norms multiply in ``x.dtype``), except
    the final norm of a model that scales by ``1 + w`` in float32 (Gemma's, ``rms_norm`` with ``norm_offset``):
    that leaf is kept as it is. So the logits of ``round_as_read(params, cfg)`` equal those of ``params``
    exactly (tests/test_reference.py), and float32 weights under bfloat16 compute take half the memory: what the
    frozen reference policy (``reference_dtype=compute``) is stored as.

    Args:
      params: the params tree (``jax.Array``s, or ``jax.ShapeDtypeStruct``s for a plan: their dtype is changed).
      cfg: the model (``dtype`` is the compute dtype).

    Returns:
      The tree with each floating leaf wider than ``cfg.dtype`` rounded to it (new arrays, placed as before);
      the other leaves are the very same objects, a QLoRA base's quantised weights (``QuantizedWeight``: the
      matmul dequantises them into the compute dtype) included.
    """
    dtype = jnp.dtype(cfg.dtype)

    def narrow(path, x):
        if isinstance(x, QuantizedWeight):
            return x
        read_wider = cfg.norm_offset and jax.tree_util.keystr(path[:1]) == "['final_norm']"
        if read_wider or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize <= dtype.itemsize:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(narrow, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
