"""LoRA as a transform of the params: low-rank adapters beside a frozen base (Hu et al. 2021, "LoRA").

A targeted weight W [in, out] gains two trained matrices, A [in, r] and B [r, out], and the layer computes
``x @ W + scale * (x @ A) @ B`` with ``scale = alpha / r`` (rsLoRA, Kalajdzievski 2023: ``alpha / sqrt(r)``).
A is drawn as PEFT draws ``lora_A`` (kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and B is
zero, so at initialisation the adapted model computes exactly the base's logits.

The adapters are their own params tree, shaped like the base's layers (stacked [L, ...] or a list of layers):

    layers/
      wq      {"a": [L, D, r],    "b": [L, r, N, H]}     q_proj
      wk, wv  {"a": [L, D, r],    "b": [L, r, K, H]}     k_proj, v_proj
      wo      {"a": [L, N, H, r], "b": [L, r, D]}        o_proj
      w_gate, w_up {"a": [L, D, r], "b": [L, r, F]}      gate_proj, up_proj
      w_down  {"a": [L, F, r],    "b": [L, r, D]}        down_proj

A mixture of experts (``grpax.models.moe``) has no dense MLP: there ``gate_proj``, ``up_proj`` and ``down_proj``
adapt every expert, one adapter pair each (``expert_gate``: {"a": [L, E, D, r], "b": [L, E, r, F]}, ...), as PEFT
adapts each expert's ``gate_proj`` of a per-expert checkpoint; leaving them out of ``lora_target_modules``
adapts the attention only. The grouped matmul of the experts computes ``x @ W_e + scale * (x @ A_e) @ B_e``
(``LoraWeight.ragged_dot``).

Each adapter takes the logical axes of the weight it adapts on its side of the product (A the input axes, B the
output axes) and a replicated rank axis, so the sharding rules need no new entry.

Two ways to run the adapted model, both pure functions of (base, adapters):

* ``apply`` puts a ``LoraWeight`` (W, A, B, scale) in place of each targeted weight. It behaves like the
  array the forward expects (``astype``, a 2-D ``reshape``, ``x @ w``), so ``grpax.models.llama.forward`` runs
  it unchanged and each layer computes ``x @ W + scale * (x @ A) @ B``: no merged copy of any weight exists,
  and gradients reach A and B only. The update and the evaluation use it.
* ``merge`` returns plain params with ``W + scale * A @ B`` (computed in float32, rounded to W's dtype): one
  more copy of the weights, the decode then as fast as the base's. The rollout's sampler reads one or the
  other (``grpax.rl.policy``, ``lora_sampler``; measured in docs/benchmarks.md, "LoRA").

QLoRA (``quantize_base``) replaces the base's projection weights by ``grpax.models.quantize.QuantizedWeight``
(int8 or NF4 with their scales): ``apply`` puts them inside the ``LoraWeight``s, whose ``x @ W`` then dequantises
W in the matmul, and ``merge`` returns ``dequantize(W) + scale * A @ B`` in the base's own dtype.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from grpax.errors import ConfigError
from grpax.models import quantize as quant
from grpax.models.llama import round_as_read
from grpax.models.params import Params, layer_specs
from grpax.models.registry import ModelConfig

# PEFT / Hugging Face module name -> the grpax weight it adapts (checkpoint/hf.py holds the full HF names).
PEFT_MODULES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
# How many leading axes of each weight are its input (the rest its output).
_IN_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
# A mixture of experts' weights the MLP modules adapt instead: [E, in, out], one input axis after the experts'.
EXPERTS_OF = {"w_gate": "expert_gate", "w_up": "expert_up", "w_down": "expert_down"}
ALL_MODULES = tuple(PEFT_MODULES)


def _axes_split(name: str) -> tuple[int, int]:
    """(leading axes shared by W, A and B: the experts', input axes) of an adapted weight ``name``."""
    if name.startswith("expert_"):
        return 1, 1
    return 0, _IN_AXES[name]


def adapted_weights(cfg: ModelConfig, lora: LoraConfig) -> tuple[str, ...]:
    """The grpax weights ``lora`` adapts in ``cfg``'s layers: ``lora.weights``, the MLP's as its experts' in a
    mixture of experts."""
    specs = layer_specs(cfg)
    return tuple(EXPERTS_OF[w] if w not in specs and w in EXPERTS_OF else w for w in lora.weights)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The adapters' shape and scale.

    Attributes:
      rank: r, the adapters' inner dimension (> 0).
      alpha: the scale's numerator (PEFT ``lora_alpha``).
      target_modules: PEFT module names adapted in every layer (``PEFT_MODULES``).
      use_rslora: scale alpha / sqrt(r) instead of alpha / r (rank-stabilised LoRA).
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ALL_MODULES
    use_rslora: bool = False

    def __post_init__(self):
        check_target_modules(self.target_modules)
        if self.rank < 1:
            raise ConfigError(f"lora_rank={self.rank}: expected >= 1 (0 turns LoRA off)")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def weights(self) -> tuple[str, ...]:
        """The grpax weight names adapted, in the order of ``PEFT_MODULES``."""
        return tuple(w for m, w in PEFT_MODULES.items() if m in self.target_modules)


def check_target_modules(modules: tuple[str, ...]) -> None:
    """Raises one ConfigError line for an unknown, repeated or empty ``lora_target_modules``."""
    bad = [m for m in modules if m not in PEFT_MODULES]
    twice = sorted({m for m in modules if modules.count(m) > 1})
    if bad or not modules:
        what = f"{bad[0]!r} is not a module of this model" if bad else "no module given"
        raise ConfigError(
            f"lora_target_modules={list(modules)}: {what}; the model's modules are {', '.join(PEFT_MODULES)} "
            "(PEFT names)"
        )
    if twice:
        raise ConfigError(
            f"lora_target_modules={list(modules)} names {twice[0]!r} twice: name each module once (one pair of "
            "adapters per module)"
        )


def check_rank(lora: LoraConfig, cfg: ModelConfig, source: str) -> None:
    """Refuses a rank above an adapted weight's width: A @ B [in, out] has rank at most min(in, out), so more
    adds parameters and optimizer state that can change nothing (PEFT accepts it; no run needs it).

    Raises:
      ConfigError: one line naming the narrowest adapted module, its widths and the largest useful rank.
    """
    specs = layer_specs(cfg)
    widths = {}
    for module, name in PEFT_MODULES.items():
        if module in lora.target_modules:
            shape, k = specs[name][0], _IN_AXES[name]
            widths[module] = (math.prod(shape[:k]), math.prod(shape[k:]))
    module, (fan_in, fan_out) = min(widths.items(), key=lambda kv: min(kv[1]))
    if lora.rank > min(fan_in, fan_out):
        raise ConfigError(
            f"lora_rank={lora.rank} exceeds the width of {module} ({fan_in} -> {fan_out} in {source}): its update "
            f"A @ B has rank at most {min(fan_in, fan_out)}, so lora_rank <= {min(fan_in, fan_out)} (or drop "
            f"{module} from lora_target_modules)"
        )


@flax.struct.dataclass
class LoraWeight:
    """A frozen weight W with its adapters, used where the forward uses W: ``x @ w`` is
    ``x @ W + scale * (x @ A) @ B``. A pytree (W, A, B are leaves), so ``lax.scan`` over stacked layers and
    ``jax.tree.map`` see through it."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def astype(self, dtype) -> LoraWeight:
        return LoraWeight(self.w.astype(dtype), self.a.astype(dtype), self.b.astype(dtype), self.scale)

    def reshape(self, *shape) -> LoraWeight:
        """The 2-D view [in, out] the forward multiplies by (``w.reshape(D, -1)``, ``w.reshape(-1, D)``)."""
        w = self.w.reshape(*shape)
        assert w.ndim == 2, shape
        return LoraWeight(w, self.a.reshape(w.shape[0], -1), self.b.reshape(-1, w.shape[1]), self.scale)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.scale * ((x @ self.a) @ self.b)

    def ragged_dot(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """An expert weight's grouped product (``grpax.models.moe``): x [M, in] rows grouped by expert, W [E, in,
        out], A [E, in, r], B [E, r, out] -> ``x @ W_e + scale * (x @ A_e) @ B_e`` of each row's expert e."""

        def grouped(x, w):
            return jax.lax.ragged_dot(x, w, group_sizes)

        return grouped(x, self.w) + self.scale * grouped(grouped(x, self.a), self.b)


def _adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, dict[str, tuple[tuple, tuple]]]:
    """Per adapted weight: {"a": (shape, axes), "b": (shape, axes)} of one unstacked layer."""
    specs = layer_specs(cfg)
    out = {}
    for name in adapted_weights(cfg, lora):
        shape, axes = specs[name]
        lead, k = _axes_split(name)
        out[name] = {
            "a": ((*shape[: lead + k], lora.rank), (*axes[: lead + k], None)),
            "b": ((*shape[:lead], lora.rank, *shape[lead + k :]), (*axes[:lead], None, *axes[lead + k :])),
        }
    return out


def _tree(cfg: ModelConfig, lora: LoraConfig, leaf) -> Params:
    """The adapters tree, ``leaf(weight, "a" | "b", shape, axes, layer)`` at each leaf (layer None: stacked)."""
    shapes = _adapter_shapes(cfg, lora)
    if cfg.scan_layers:
        return {
            "layers": {
                name: {
                    ab: leaf(name, ab, (cfg.num_layers, *s), ("layers", *ax), None)
                    for ab, (s, ax) in d.items()
                }
                for name, d in shapes.items()
            }
        }
    return {
        "layers": [
            {name: {ab: leaf(name, ab, s, ax, i) for ab, (s, ax) in d.items()} for name, d in shapes.items()}
            for i in range(cfg.num_layers)
        ]
    }


def adapter_logical_axes(cfg: ModelConfig, lora: LoraConfig) -> Params:
    """The adapters tree with each leaf its logical axes (the adapted weight's; the rank axis None)."""
    return _tree(cfg, lora, lambda name, ab, shape, axes, i: axes)


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
    """Adapters as PEFT initialises them, in float32: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform,
    a = sqrt(5), over the fan-in), B = 0.

    Args:
      cfg: the base model's config (its layout: stacked or a list of layers).
      lora: rank and targets.
      key: PRNG key; each weight's A folds in its name's index and its layer.
    """
    names = list(PEFT_MODULES.values()) + list(EXPERTS_OF.values())

    def leaf(name, ab, shape, axes, layer):
        if ab == "b":
            return jnp.zeros(shape, jnp.float32)
        k = jax.random.fold_in(key, names.index(name))
        if layer is not None:
            k = jax.random.fold_in(k, layer)
        fan_in = math.prod(shape[-1 - _axes_split(name)[1] : -1])
        bound = 1.0 / math.sqrt(fan_in)
        return jax.random.uniform(k, shape, jnp.float32, -bound, bound)

    return _tree(cfg, lora, leaf)


def _layers_map(fn, base_layers, adapter_layers):
    """``fn(base_layer, adapter_layer)`` over stacked (a dict) or listed layers."""
    if isinstance(base_layers, dict):
        return fn(base_layers, adapter_layers)
    return [fn(b, a) for b, a in zip(base_layers, adapter_layers, strict=True)]


def apply(base: Params, adapters: Params, lora: LoraConfig) -> Params:
    """The adapted params for ``forward``: each adapted weight a ``LoraWeight`` (no weight copied)."""

    def layer(b, a):
        return {name: LoraWeight(w, **a[name], scale=lora.scale) if name in a else w for name, w in b.items()}

    return {**base, "layers": _layers_map(layer, base["layers"], adapters["layers"])}


def part_axes(name: str, part: str, axes: tuple, ndim: int) -> tuple:
    """Logical axes of ``part`` ("w", "a" or "b", of rank ``ndim``) of a ``LoraWeight`` adapting weight ``name``
    whose own axes (one layer's) are ``axes``: W takes them, A the input side's and B the output side's, each
    with the rank axis replicated (as ``adapter_logical_axes``); led by "layers" where stacked."""
    if part == "w":
        own = axes
    else:
        lead, k = _axes_split(name)
        own = (*axes[: lead + k], None) if part == "a" else (*axes[:lead], None, *axes[lead + k :])
    return ("layers", *own) if ndim == len(own) + 1 else own


def merge(base: Params, adapters: Params, lora: LoraConfig) -> Params:
    """Plain params with ``W + scale * A @ B`` in each adapted weight (float32 sum, rounded to W's dtype).

    A quantised base (QLoRA) gives its dequantised weights, adapted or not, in the dtype they were loaded in."""

    def layer(b, a):
        out = {
            name: _dense(w).astype(w.dtype) if isinstance(w, quant.QuantizedWeight) else w
            for name, w in b.items()
        }
        for name, ad in a.items():
            w = b[name]
            out[name] = (_dense(w) + merged_delta(ad["a"], ad["b"], w.shape, lora.scale)).astype(w.dtype)
        return out

    return {**base, "layers": _layers_map(layer, base["layers"], adapters["layers"])}


def _dense(w) -> jax.Array:
    """A weight's float32 values (dequantised where quantised)."""
    return quant.dequantize(w) if isinstance(w, quant.QuantizedWeight) else w.astype(jnp.float32)


def frozen_base(base: Params, qtype: str, cfg: ModelConfig) -> Params:
    """LoRA's frozen base as a run holds it: QLoRA's projections quantised to ``qtype`` (``quantize_base``; ""
    = none), and every other weight rounded as the forward reads it (``llama.round_as_read``: the embedding, the
    head and the norms in the compute dtype ``cfg.dtype``). The base is never updated and the forward rounds
    each weight to the compute dtype where it reads it, so its logits are the same bit for bit; float32 weights
    under bfloat16 compute then take half the bytes, and the decode reads them as they are instead of rounding a
    copy of the embedding and the head at every call (2 GiB of Llama 3.1 8B's decode temporaries on a v5e,
    docs/benchmarks.md). Works on ``jax.ShapeDtypeStruct`` trees too (the compile check's)."""
    return round_as_read(quantize_base(base, qtype) if qtype else base, cfg)


def quantize_base(base: Params, qtype: str) -> Params:
    """QLoRA's base: every layer's projection weights (``PEFT_MODULES``, adapted or not) quantised to
    ``qtype`` ("int8" or "nf4", ``grpax.models.quantize``); embeddings, head and norms stay as they are.

    Each weight is quantised by one jitted call on its own devices; a weight on a mesh (``NamedSharding``)
    gives codes split as the weight is (where the packed axis still divides) and scales split along its
    output axes. The caller drops the unquantised base afterwards. A base of ``jax.ShapeDtypeStruct``s (the
    compile check's) gives the quantised base's as abstract arrays, placed as the run places them.
    """
    stacked = isinstance(base["layers"], dict)

    def one(name, w):
        out_axes = w.ndim - stacked - _IN_AXES[name]
        shape = jax.eval_shape(lambda x: quant.quantize(x, qtype, out_axes, int(stacked)), w)
        shardings = _like(w, shape.qvalue.shape), _like(w, shape.scale.shape)
        if isinstance(w, jax.ShapeDtypeStruct):
            return shape.replace(
                qvalue=jax.ShapeDtypeStruct(shape.qvalue.shape, shape.qvalue.dtype, sharding=shardings[0]),
                scale=jax.ShapeDtypeStruct(shape.scale.shape, shape.scale.dtype, sharding=shardings[1]),
            )
        fn = jax.jit(
            lambda x: quant.quantize(x, qtype, out_axes, int(stacked)),
            out_shardings=None
            if None in shardings
            else shape.replace(qvalue=shardings[0], scale=shardings[1]),
        )
        return fn(w)

    def layer(b, _):
        return {name: one(name, w) if name in _IN_AXES else w for name, w in b.items()}

    return {**base, "layers": _layers_map(layer, base["layers"], base["layers"])}


def _like(w: jax.Array, shape: tuple[int, ...]) -> jax.sharding.NamedSharding | None:
    """``w``'s mesh sharding for an array of ``shape`` (w's rank): each axis split as w's where it divides,
    else whole; None when w is not on a mesh."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
    mesh = sharding.mesh

    def size(axes):
        names = axes if isinstance(axes, tuple) else (axes,)
        return math.prod(mesh.shape[n] for n in names)

    kept = [ax if ax is not None and n % size(ax) == 0 else None for ax, n in zip(spec, shape, strict=True)]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*kept))


def merged_delta(a: jax.Array, b: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
    """``scale * A @ B`` float32 in the adapted weight's ``shape``.

    A is [*lead, *in, r] and B [*lead, r, *out] with ``lead`` the stacked layer axis (or none).
    """
    n_lead = a.ndim + b.ndim - 2 - len(shape)  # the leading axes A and B share: 1 when stacked, else 0
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    in_shape, out_shape = a.shape[n_lead:-1], b.shape[n_lead + 1 :]
    L = a.shape[:n_lead]
    a2 = a32.reshape(*L, math.prod(in_shape), a.shape[-1])
    b2 = b32.reshape(*L, b.shape[n_lead], math.prod(out_shape))
    return (scale * (a2 @ b2)).reshape(shape)
