"""The mixture-of-experts MLP in plain JAX: a linear router, top-k, and the experts as grouped matmuls, dropless.

Each token's pre-normed hidden state h [D] is scored by the router (float32 logits ``h @ router`` [E], plus
a bias for GPT-OSS); its k = ``num_experts_per_tok`` most probable experts compute their gated MLP and the
outputs are summed weighted by the gates: the softmax probabilities of the chosen experts, renormalised to sum
to 1 with ``norm_topk_prob`` (Qwen3-MoE's key; GPT-OSS's softmax over the top-k logits and Mixtral's renormalised
gates are the same numbers). transformers' ``Qwen3MoeSparseMoeBlock``, ``GptOssMLP`` and
``MixtralSparseMoeBlock`` compute the same function expert by expert.

Dropless: the T x k (token, expert) pairs are sorted by expert and each expert's rows multiplied by its weights
with one grouped matmul, ``jax.lax.ragged_dot`` (group sizes: the tokens per expert), so no token is dropped
and no capacity factor pads the work (the sampler and the trainer compute the same function whatever the
batch). On TPU, per chip (expert parallelism) or on one chip, the weights' gradient of each grouped
product is megablox's Pallas kernel (``tgmm``, ``_ragged_matmul``): the TPU compiler lowers ragged_dot's
forward and input gradient as grouped kernels but its weight transpose as a matmul masked once per expert, E
times the FLOPs (one Qwen3-30B-A3B layer's update on v6e-8: 5.04 TFLOP per chip, 0.118 with tgmm per chip,
0.116 for a dense MLP of the same active width). A Pallas kernel cannot be partitioned by the compiler, so a
mesh without an ``expert`` axis keeps ragged_dot's own transpose (docs/scaling.md, "The experts' FLOPs").
GPT-OSS's experts apply a clamped SwiGLU, ``(clip(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with
``g = min(gate, l)``, and biases on each projection.

Expert parallelism (``expert`` mesh axis > 1, ``grpax.models.sharding_rules``): inside ``jax.shard_map``, each
chip gathers the tokens of its expert group (the rows the ``expert`` axis splits), computes its own E / ep
experts for every pair routed to them and reduce-scatters the outputs back to the tokens' chips (an
all-gather and a reduce-scatter of T x D per layer, the dispatch and combine of DeepSpeed-MoE's and
jax-llm-examples' expert-parallel MoE). The router runs outside it, on each chip's own tokens.

Routing replay (``replay``, Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", R3): the expert ids are given (the sampler's), the gates still computed from this
forward's router logits, so the router's gradient flows; ``Routing`` returns the router's own top-k beside
them (what the sampler records, and what the trainer compares with the sampler's).

Shape letters: B rows, T tokens, D hidden, E experts, F expert hidden, k experts per token, N = B x T.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from grpax.models.sharding_rules import EXPERT, logical_to_spec


class Routing(NamedTuple):
    """What one MoE layer's router did (leaves gain a leading L axis when stacked over layers).

    Attributes:
      experts: int [B, T, k] the router's own top-k expert ids, most probable first (int8 / int16:
        ``route_dtype``); with replay, what it would have chosen, not what was used.
      load: float32 [E] tokens sent to each expert, over the k slots, weighted by the token weights.
      importance: float32 [E] the router probabilities summed over the (weighted) tokens.
      tokens: float32 [] the weighted token count.
    """

    experts: jax.Array
    load: jax.Array
    importance: jax.Array
    tokens: jax.Array


def route_dtype(num_experts: int):
    """The narrowest signed integer dtype of expert ids 0..E-1: int8 up to 128 experts, else int16."""
    return jnp.int8 if num_experts <= 128 else jnp.int16


def load_balancing_loss(routing: Routing) -> jax.Array:
    """Switch Transformer's auxiliary loss (Fedus et al. 2022, eq. 4-6) per layer, averaged over layers.

    ``E * sum_e (load_e / tokens) * (importance_e / tokens)``: k for a uniform router, up to k * E when every
    token picks the same experts with certainty (transformers' ``load_balancing_loss_func`` of one layer).

    Args:
      routing: stacked over layers (``load``, ``importance`` [L, E], ``tokens`` [L]), summed over passes.

    Returns:
      float32 scalar.
    """
    E = routing.load.shape[-1]
    tokens = jnp.maximum(routing.tokens, 1.0)[..., None]
    per_layer = E * jnp.sum((routing.load / tokens) * (routing.importance / tokens), axis=-1)
    return jnp.mean(per_layer)


def _route(h: jax.Array, w: dict, cfg, replay: jax.Array | None, weights: jax.Array | None):
    """The router on h [B, T, D]: (expert ids int32 [B, T, k] used, gates float32 [B, T, k], ``Routing``)."""
    k = cfg.num_experts_per_tok
    with jax.named_scope("router"):
        logits = jnp.einsum("BTD,DE->BTE", h, w["router"].astype(h.dtype), preferred_element_type=jnp.float32)
        if cfg.router_bias:
            logits = logits + w["router_bias"].astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        _, own = jax.lax.top_k(logits, k)  # the probabilities' order, without their underflow to equal 0s
        used = own if replay is None else replay.astype(jnp.int32)
        gates = jnp.take_along_axis(probs, used, axis=-1)
        if cfg.norm_topk_prob:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        weights = jnp.ones(h.shape[:2], jnp.float32) if weights is None else weights.astype(jnp.float32)
        load = (
            jnp.zeros((cfg.num_experts,), jnp.float32)
            .at[own.reshape(-1)]
            .add(jnp.repeat(weights.reshape(-1), k))
        )
        importance = jnp.einsum("BTE,BT->E", probs, weights)
    routing = Routing(own.astype(route_dtype(cfg.num_experts)), load, importance, jnp.sum(weights))
    return used, gates, routing


_TILE = 128  # megablox's default tile (rows, in, out): the rows are padded to a multiple of it


def weight_grad_tgmm(
    x: jax.Array, dy: jax.Array, group_sizes: jax.Array, interpret: bool = False
) -> jax.Array:
    """The grouped product's weight gradient by megablox's Pallas kernel (``tgmm``, TPU): x [M, in] and dy
    [M, out] rows grouped by ``group_sizes`` int32 [G] (rows past the groups ignored) -> float32 [G, in, out],
    ``x_g.T @ dy_g`` of each group (zero for an empty one). ``interpret``: Pallas's interpreter (any backend)."""
    # the module (the package's ``gmm`` is the custom-VJP function of the same name)
    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    pad = -x.shape[0] % _TILE
    x, dy = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, dy.astype(x.dtype)))
    tiling = (_TILE, min(_TILE, x.shape[1]), min(_TILE, dy.shape[1]))
    return megablox.tgmm(x.T, dy, group_sizes, jnp.float32, tiling, interpret=interpret)


@jax.custom_vjp
def _ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` whose weight gradient on TPU is megablox's ``tgmm``: the TPU
    compiler lowers ragged_dot's own transpose for the weights (its ragged-contracting mode) as a dense
    matmul of x masked once per group, G times the product's FLOPs (docs/scaling.md, "Qwen3-30B-A3B on
    v6e-8"); its forward and input gradient are the compiler's grouped kernel. Elsewhere the same as
    ragged_dot, whose transpose there is the grouped product itself."""
    return jax.lax.ragged_dot(x, w, group_sizes)


def _ragged_matmul_fwd(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes), (x, w, group_sizes)


def _ragged_matmul_bwd(residuals, dy):
    x, w, group_sizes = residuals
    dx = jax.lax.ragged_dot(dy.astype(w.dtype), w.swapaxes(1, 2), group_sizes).astype(x.dtype)
    transposed = lambda: jax.vjp(lambda v: jax.lax.ragged_dot(x, v, group_sizes), w)[1](dy)[0]  # noqa: E731
    dw = jax.lax.platform_dependent(
        tpu=lambda: weight_grad_tgmm(x, dy, group_sizes).astype(w.dtype), default=transposed
    )
    return dx, dw, None


_ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


def _grouped(x: jax.Array, w, group_sizes: jax.Array, kernel: bool) -> jax.Array:
    """x [M, in] rows grouped by expert times each group's w [G, in, out]: ``_ragged_matmul`` where ``kernel``
    (its Pallas kernel cannot be partitioned by the compiler: per chip or on one device), else
    ``jax.lax.ragged_dot``; a weight that carries its own grouped product (LoRA's ``LoraWeight.ragged_dot``)
    computes it."""
    own = getattr(w, "ragged_dot", None)
    if own is not None:
        return own(x, group_sizes)
    return (_ragged_matmul if kernel else jax.lax.ragged_dot)(x, w, group_sizes)


def _expert_mlp(
    x: jax.Array, w: dict, expert: jax.Array, group_sizes: jax.Array, cfg, kernel: bool
) -> jax.Array:
    """The gated MLP of each row's expert: x [M, D] sorted by ``expert`` int32 [M] (ids local to ``w``'s
    experts; rows past the groups are zero) -> [M, D]; ``kernel`` as in ``_grouped``."""
    g = _grouped(x, w["expert_gate"], group_sizes, kernel)
    u = _grouped(x, w["expert_up"], group_sizes, kernel)
    if cfg.expert_bias:
        g = g + w["expert_gate_bias"][expert]
        u = u + w["expert_up_bias"][expert]
    g, u = checkpoint_name(g, "mlpwi_0"), checkpoint_name(u, "mlpwi_1")  # remat_policy=custom's names
    if cfg.swiglu_limit is None:
        a = jax.nn.silu(g) * u
    else:  # GPT-OSS
        g = jnp.minimum(g, cfg.swiglu_limit)
        u = jnp.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
        a = (u + 1) * (g * jax.nn.sigmoid(g * cfg.swiglu_alpha))
    y = _grouped(a, w["expert_down"], group_sizes, kernel)
    if cfg.expert_bias:
        y = y + w["expert_down_bias"][expert]
    return checkpoint_name(y, "mlpwo")


def _experts(
    x: jax.Array, ids: jax.Array, gates: jax.Array, w: dict, cfg, first: jax.Array | int, kernel: bool
):
    """Dropless dispatch and combine over the experts ``first`` .. ``first + G - 1`` that ``w`` holds (G = its
    leading axis): x [N, D], ids int32 [N, k], gates float32 [N, k] -> float32 [N, D], the gated sum of each
    token's outputs from those experts (pairs routed elsewhere add nothing); ``kernel`` as in ``_grouped``."""
    N, k = ids.shape
    G = w["expert_gate"].shape[0]
    local = ids.reshape(-1) - first
    mine = (local >= 0) & (local < G)
    key = jnp.where(mine, local, G)  # pairs for other experts sort last, past every group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=G + 1)[:G].astype(jnp.int32)
    rows = x[order // k]  # [N * k, D]
    y = _expert_mlp(rows, w, jnp.minimum(key[order], G - 1), sizes, cfg, kernel)
    # rows past the groups hold their biases only: zeroed, not just scaled by a zero gate
    y = jnp.where(mine[order, None], y.astype(jnp.float32) * gates.reshape(-1)[order, None], 0.0)
    back = jnp.zeros_like(y).at[order].set(y)  # unsorted: pair j of token n at row n * k + j
    return back.reshape(N, k, -1).sum(axis=1)


def _per_chip(cfg) -> bool:
    """Whether the experts run per chip inside ``jax.shard_map`` (``_expert_parallel``): with an ``expert`` axis
    that divides the experts. Elsewhere the compiler partitions them: at fsdp=8 on v6e-8 it gathers the tokens
    and keeps the experts split on D, which at the GRPO update's batch moves less and holds less than gathering
    the experts per chip (docs/scaling.md, "The experts' FLOPs")."""
    mesh = jax.sharding.get_abstract_mesh()
    ep = 1 if mesh.empty else dict(mesh.shape).get(EXPERT, 1)
    return ep > 1 and cfg.num_experts % ep == 0


def _expert_parallel(h, ids, gates, w: dict, cfg) -> jax.Array:
    """``_experts`` per chip inside ``jax.shard_map``, the experts split over the mesh's ``expert`` axis and
    gathered over the others (module docstring): h [B, T, D]."""
    mesh = jax.sharding.get_abstract_mesh()
    mesh_shape = dict(mesh.shape)
    ep = mesh_shape.get(EXPERT, 1)
    rows = logical_to_spec(("batch", None, None), shape=h.shape, mesh_shape=mesh_shape)
    split = rows[0] if rows else None
    gathered = EXPERT in ((split,) if isinstance(split, str) else split or ())
    experts_spec = jax.sharding.PartitionSpec(EXPERT)

    def local(h, ids, gates, w):
        b, t, D = h.shape
        x, i, g = h.reshape(b * t, D), ids.reshape(b * t, -1), gates.reshape(b * t, -1)
        if gathered:  # the expert group's tokens, in the order of the axis
            x, i, g = (jax.lax.all_gather(a, EXPERT, tiled=True) for a in (x, i, g))
        first = jax.lax.axis_index(EXPERT) * (cfg.num_experts // ep)
        out = _experts(x, i, g, w, cfg, first, kernel=True)
        if gathered:
            out = jax.lax.psum_scatter(out, EXPERT, scatter_dimension=0, tiled=True)
        else:
            out = jax.lax.psum(out, EXPERT)
        return out.reshape(b, t, D)

    w_specs = jax.tree.map(lambda _: experts_spec, w)
    return jax.shard_map(
        local,
        in_specs=(rows, rows, rows, w_specs),
        out_specs=rows,
        check_vma=False,
    )(h, ids, gates, w)


def moe_mlp(
    h: jax.Array, w: dict, cfg, replay: jax.Array | None = None, weights: jax.Array | None = None
) -> tuple[jax.Array, Routing]:
    """The mixture-of-experts MLP of pre-normed hidden states.

    Args:
      h: [B, T, D] in the compute dtype (the MLP norm's output).
      w: the layer's weights (``grpax.models.params.expert_specs``), in the compute dtype.
      cfg: the model config (``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, GPT-OSS's fields).
      replay: int [B, T, k] expert ids to route by (routing replay), or None: the router's own top-k.
      weights: float [B, T] each token's weight in ``Routing``'s load and importance (0 for padding); None: 1.

    Returns:
      (the gated sum of the chosen experts' outputs [B, T, D] in h's dtype, ``Routing``).
    """
    ids, gates, routing = _route(h, w, cfg, replay, weights)
    experts = {name: x for name, x in w.items() if name.startswith("expert_")}
    with jax.named_scope("experts"):
        if _per_chip(cfg):
            out = _expert_parallel(h, ids, gates, experts, cfg)
        else:
            B, T, D = h.shape
            one_device = jax.sharding.get_abstract_mesh().size <= 1
            x, i, g = h.reshape(B * T, D), ids.reshape(B * T, -1), gates.reshape(B * T, -1)
            out = _experts(x, i, g, experts, cfg, 0, kernel=one_device)
            out = out.reshape(B, T, D)
    return out.astype(h.dtype), routing
