"""Parameter declarations: each weight's shape, logical axes and initialiser, declared once.

Parameters are a plain nested dict (a pytree), so optax, orbax and ``jax.tree`` work on them directly:

    embed        [V, D]          ("vocab", "embed")
    layers/
      attn_norm  [L, D]          ("layers", "norm")
      wq         [L, D, N, H]    ("layers", "embed", "q_heads", "head_dim")
      wk, wv     [L, D, K, H]    ("layers", "embed", "kv_heads", "head_dim")
      wo         [L, N, H, D]    ("layers", "q_heads", "head_dim", "embed")
      mlp_norm   [L, D]          ("layers", "norm")
      w_gate     [L, D, F]       ("layers", "embed", "mlp")
      w_up       [L, D, F]       ("layers", "embed", "mlp")
      w_down     [L, F, D]       ("layers", "mlp", "embed")
      q_bias     [L, N, H]       ("layers", "q_heads", "head_dim")     attention_bias (Qwen2)
      k_bias, v_bias [L, K, H]   ("layers", "kv_heads", "head_dim")    attention_bias (Qwen2)
      q_norm, k_norm [L, H]      ("layers", "head_dim")                qk_norm (Qwen3, Gemma 3)
      attn_post_norm [L, D]      ("layers", "norm")                    post_norms (Gemma 2/3)
      mlp_post_norm  [L, D]      ("layers", "norm")                    post_norms (Gemma 2/3)
      o_bias     [L, D]          ("layers", "norm")                    attention_out_bias (GPT-OSS)
      sinks      [L, N]          ("layers", "q_heads")                 attention_sinks (GPT-OSS)
      router     [L, D, E]       ("layers", "embed", None)             num_experts > 0, in place of w_gate,
      router_bias [L, E]         ("layers", None)                        w_up and w_down (grpax.models.moe)
      expert_gate, expert_up [L, E, D, F]  ("layers", "experts", "embed", "mlp")       F = moe_mlp_dim
      expert_down [L, E, F, D]   ("layers", "experts", "mlp", "embed")
      expert_gate_bias, expert_up_bias [L, E, F] ("layers", "experts", "mlp")   expert_bias (GPT-OSS)
      expert_down_bias [L, E, D] ("layers", "experts", None)
    final_norm   [D]             ("norm",)
    lm_head      [D, V]          ("embed", "vocab")      absent when tie_word_embeddings

The family weights reuse the logical axes of the Llama ones, so the sharding rules need no new entry: biases
shard with their projection's heads, the per-head norms are replicated like ``head_dim``. The experts' weights
add one axis, ``experts`` (expert parallelism's mesh axis); the router is replicated over it.

With ``scan_layers=True`` the layer weights are stacked on a leading L axis (one compiled layer, scanned);
with ``scan_layers=False`` ``layers`` is a list of L dicts without that axis. ``grpax.sharding`` maps the
logical axes onto a device mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpax.models.registry import ModelConfig

Params = dict[str, Any]

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")  # dense ones


def layer_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Shape and logical axes of one (unstacked) layer's weights (``LAYER_WEIGHTS`` and the family's own)."""
    D, N, K, H, F = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    specs = {
        "attn_norm": ((D,), ("norm",)),
        "wq": ((D, N, H), ("embed", "q_heads", "head_dim")),
        "wk": ((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wv": ((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wo": ((N, H, D), ("q_heads", "head_dim", "embed")),
        "mlp_norm": ((D,), ("norm",)),
    }
    if cfg.num_experts:
        specs.update(expert_specs(cfg))
    else:
        specs["w_gate"] = ((D, F), ("embed", "mlp"))
        specs["w_up"] = ((D, F), ("embed", "mlp"))
        specs["w_down"] = ((F, D), ("mlp", "embed"))
    if cfg.attention_bias:
        specs["q_bias"] = ((N, H), ("q_heads", "head_dim"))
        specs["k_bias"] = ((K, H), ("kv_heads", "head_dim"))
        specs["v_bias"] = ((K, H), ("kv_heads", "head_dim"))
    if cfg.qk_norm:
        specs["q_norm"] = ((H,), ("head_dim",))
        specs["k_norm"] = ((H,), ("head_dim",))
    if cfg.post_norms:
        specs["attn_post_norm"] = ((D,), ("norm",))
        specs["mlp_post_norm"] = ((D,), ("norm",))
    if cfg.attention_out_bias:
        specs["o_bias"] = ((D,), ("norm",))
    if cfg.attention_sinks:
        specs["sinks"] = ((N,), ("q_heads",))
    return specs


def expert_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Shape and logical axes of one layer's router and experts (``num_experts`` > 0)."""
    D, E, F = cfg.hidden_dim, cfg.num_experts, cfg.moe_mlp_dim
    specs = {
        "router": ((D, E), ("embed", None)),
        "expert_gate": ((E, D, F), ("experts", "embed", "mlp")),
        "expert_up": ((E, D, F), ("experts", "embed", "mlp")),
        "expert_down": ((E, F, D), ("experts", "mlp", "embed")),
    }
    if cfg.router_bias:
        specs["router_bias"] = ((E,), (None,))
    if cfg.expert_bias:
        specs["expert_gate_bias"] = ((E, F), ("experts", "mlp"))
        specs["expert_up_bias"] = ((E, F), ("experts", "mlp"))
        specs["expert_down_bias"] = ((E, D), ("experts", None))
    return specs


def top_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Shape and logical axes of the non-layer weights."""
    specs = {
        "embed": ((cfg.vocab_size, cfg.hidden_dim), ("vocab", "embed")),
        "final_norm": ((cfg.hidden_dim,), ("norm",)),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((cfg.hidden_dim, cfg.vocab_size), ("embed", "vocab"))
    return specs


def _tree(cfg: ModelConfig, leaf) -> Params:
    """Builds the params-shaped tree, calling ``leaf(name, shape, axes)`` for each weight."""
    tree = {name: leaf(name, shape, axes) for name, (shape, axes) in top_specs(cfg).items()}
    specs = layer_specs(cfg)
    if cfg.scan_layers:
        tree["layers"] = {
            name: leaf(name, (cfg.num_layers, *shape), ("layers", *axes))
            for name, (shape, axes) in specs.items()
        }
    else:
        tree["layers"] = [
            {name: leaf(name, shape, axes) for name, (shape, axes) in specs.items()}
            for _ in range(cfg.num_layers)
        ]
    return tree


def logical_axes(cfg: ModelConfig) -> Params:
    """The params tree with each leaf replaced by its tuple of logical axis names."""
    return _tree(cfg, lambda name, shape, axes: axes)


def abstract_params(cfg: ModelConfig) -> Params:
    """``jax.ShapeDtypeStruct`` leaves in ``cfg.weight_dtype``: shapes without memory."""
    dtype = jnp.dtype(cfg.weight_dtype)
    return _tree(cfg, lambda name, shape, axes: jax.ShapeDtypeStruct(shape, dtype))


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random parameters: normal(0, 0.02) matrices (as HF ``initializer_range``), zero biases, norms that
    scale by 1 (ones, or zeros when ``cfg.norm_offset`` is 1).

    Args:
      cfg: the model config; leaves are created in ``cfg.weight_dtype``.
      key: a PRNG key.

    Returns:
      The params tree (see module docstring).
    """
    dtype = jnp.dtype(cfg.weight_dtype)
    counter = iter(range(10**9))

    def leaf(name, shape, axes):
        if name.endswith("norm"):
            return jnp.full(shape, 1.0 - cfg.norm_offset, dtype)
        if name.endswith("bias"):
            return jnp.zeros(shape, dtype)
        k = jax.random.fold_in(key, next(counter))
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    return _tree(cfg, leaf)


def stack_layers(layers: list[Params]) -> Params:
    """List of per-layer dicts -> dict of [L, ...] arrays (scan_layers=False -> True)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_layers(layers: Params, num_layers: int) -> list[Params]:
    """Dict of [L, ...] arrays -> list of per-layer dicts (scan_layers=True -> False)."""
    return [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(num_layers)]


def convert_layout(params: Params, cfg: ModelConfig, scan_layers: bool) -> Params:
    """Returns ``params`` with layers stacked (``scan_layers=True``) or as a list, whatever they were."""
    is_stacked = isinstance(params["layers"], dict)
    if is_stacked == scan_layers:
        return params
    out = dict(params)
    out["layers"] = (
        stack_layers(params["layers"]) if scan_layers else unstack_layers(params["layers"], cfg.num_layers)
    )
    return out


def cast_params(params: Params, dtype: str | jnp.dtype) -> Params:
    """Casts every floating leaf to ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
