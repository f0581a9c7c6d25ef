"""Hugging Face tensor names and layouts <-> grpax params, for every supported family.

The only module that knows Hugging Face weight names (``LlamaForCausalLM`` and the Mistral, Qwen2, Qwen3,
Gemma2 and Gemma3 ones: the same names, plus q/k/v biases, ``q_norm``/``k_norm``, and Gemma's four norms per
layer, where ``post_attention_layernorm`` is the attention output's norm rather than the MLP's pre-norm). HF stores linear weights as ``[out, in]``; grpax stores
them ``[in, out]`` with heads split (``wq`` [D, N, H]). Q and K keep HF's rotate-half row order, which is the
layout ``grpax.models.llama.rotate`` uses, so no permutation is needed here (GGUF files differ: see
``grpax.checkpoint.gguf``).

A mixture of experts' weights are stacked per layer ([E, D, F] of a layer's E experts) from the checkpoints'
own layouts (``_moe_sources``): Qwen3-MoE's and Mixtral's one ``[F, D]`` tensor per expert and projection
(the Hub's names, which transformers 5's ``save_pretrained`` writes back), GPT-OSS's fused ``gate_up_proj``
[E, D, 2F] with gate and up interleaved along 2F, and the Hub GPT-OSS checkpoint's MXFP4 experts (``*_blocks``
and ``*_scales``), dequantised here (``dequantize_mxfp4``). The export writes the unquantised forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from grpax.models.families import FAMILY_TABLE
from grpax.models.params import layer_specs
from grpax.models.registry import ModelConfig

_LAYER_HF = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o_bias": "self_attn.o_proj.bias",
    "sinks": "self_attn.sinks",
}
# Gemma 2/3: a norm before and after both attention and MLP.
_GEMMA_NORMS_HF = {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "attn_post_norm": "post_attention_layernorm.weight",
    "mlp_post_norm": "post_feedforward_layernorm.weight",
}
_TOP_HF = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


# MXFP4 (OCP Microscaling, FP4 E2M1): a byte holds two 4-bit codes (low nibble first), each block of 32 values
# shares one power-of-two scale stored as a biased exponent (2 ** (scale - 127)); transformers' FP4_VALUES.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 values of MXFP4 weights: ``blocks`` uint8 [..., G, 16] (32 codes per block), ``scales`` uint8
    [..., G] -> [..., G * 32], as transformers' ``convert_moe_packed_tensors`` (before its transpose).

    Raises:
      ValueError: blocks and scales of different leading shapes.
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    out = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


_GPT_OSS_HALF = {"expert_gate": 0, "expert_up": 1, "expert_gate_bias": 0, "expert_up_bias": 1}


def _moe_sources(
    i: int, name: str, cfg: ModelConfig, has_tensor: Callable[[str], bool]
) -> tuple[list[str], Callable[[list[np.ndarray]], np.ndarray]] | None:
    """The HF tensors of layer ``i``'s mixture-of-experts weight ``name`` and how its native array [E, ...]
    (the router: [D, E]) is built from them; None for any other weight."""
    if not cfg.num_experts or not (name == "router" or name.startswith(("expert_", "router_"))):
        return None
    p = f"model.layers.{i}.mlp."
    per_expert = FAMILY_TABLE[cfg.family].per_expert  # (Qwen3-MoE, Mixtral) or None (GPT-OSS's fused experts)
    if per_expert:
        router, expert, projs = per_expert
        if name == "router":
            return [f"model.layers.{i}.{router}"], lambda ws: ws[0].T
        names = [f"model.layers.{i}.{expert.format(e=e, proj=projs[name])}" for e in range(cfg.num_experts)]
        return names, lambda ws: np.stack([w.T for w in ws])
    if name in ("router", "router_bias"):  # GPT-OSS
        return [p + ("router.weight" if name == "router" else "router.bias")], lambda ws: ws[0].T
    base = p + ("experts.down_proj" if name.startswith("expert_down") else "experts.gate_up_proj")
    if name.endswith("_bias"):
        base += "_bias"
    elif has_tensor(base + "_blocks"):  # the Hub's MXFP4 [E, out, in / 32, 16]: dequantised, [E, in, out]
        half = _GPT_OSS_HALF.get(name)
        pick = (lambda w: w) if half is None else (lambda w: w[..., half::2])
        return [base + "_blocks", base + "_scales"], lambda ws: pick(dequantize_mxfp4(*ws).swapaxes(-1, -2))
    half = _GPT_OSS_HALF.get(name)
    return [base], (lambda ws: ws[0]) if half is None else (lambda ws: ws[0][..., half::2])


def _moe_hf_tensors(i: int, layer: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Layer ``i``'s mixture-of-experts weights as the HF tensors ``_moe_sources`` reads (GPT-OSS: unquantised)."""
    p = f"model.layers.{i}.mlp."
    per_expert = FAMILY_TABLE[cfg.family].per_expert
    if per_expert:
        router, expert, projs = per_expert
        yield f"model.layers.{i}.{router}", np.asarray(layer["router"]).T
        for e in range(cfg.num_experts):
            for name, proj in projs.items():
                yield f"model.layers.{i}.{expert.format(e=e, proj=proj)}", np.asarray(layer[name][e]).T
        return
    yield p + "router.weight", np.asarray(layer["router"]).T
    yield p + "router.bias", np.asarray(layer["router_bias"])
    for suffix in ("", "_bias"):
        gate, up = np.asarray(layer["expert_gate" + suffix]), np.asarray(layer["expert_up" + suffix])
        fused = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
        fused[..., 0::2], fused[..., 1::2] = gate, up
        yield p + "experts.gate_up_proj" + suffix, fused
        yield p + "experts.down_proj" + suffix, np.asarray(layer["expert_down" + suffix])


class MissingTensorError(KeyError):
    """A tensor the model needs is absent from the checkpoint; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


def hf_layer_name(i: int, name: str, cfg: ModelConfig | None = None) -> str:
    """The HF name of layer ``i``'s weight ``name`` (``cfg`` picks the family's names; None: Llama's)."""
    table = _LAYER_HF
    if cfg is not None and cfg.post_norms:
        table = {**_LAYER_HF, **_GEMMA_NORMS_HF}
    return f"model.layers.{i}.{table[name]}"


def hf_to_native(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Converts one HF tensor of grpax weight ``name`` to grpax layout (see module docstring)."""
    D, N, K, H = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if name == "wq":
        return w.T.reshape(D, N, H)
    if name in ("wk", "wv"):
        return w.T.reshape(D, K, H)
    if name == "q_bias":
        return w.reshape(N, H)
    if name in ("k_bias", "v_bias"):
        return w.reshape(K, H)
    if name == "wo":
        return w.T.reshape(N, H, D)
    if name in ("w_gate", "w_up", "w_down", "lm_head"):
        return w.T
    return w


def native_to_hf(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Inverse of ``hf_to_native``: grpax layout -> HF ``[out, in]``."""
    D = cfg.hidden_dim
    if name in ("wq", "wk", "wv"):
        return w.reshape(D, -1).T
    if name in ("q_bias", "k_bias", "v_bias"):
        return w.reshape(-1)
    if name == "wo":
        return w.reshape(-1, D).T
    if name in ("w_gate", "w_up", "w_down", "lm_head"):
        return w.T
    return w


def expected_hf_names(cfg: ModelConfig) -> list[str]:
    """The HF names of every tensor of ``cfg``'s model (a mixture of experts': its unquantised forms)."""
    names = [_TOP_HF["embed"], _TOP_HF["final_norm"]]
    if not cfg.tie_word_embeddings:
        names.append(_TOP_HF["lm_head"])
    for i in range(cfg.num_layers):
        for name in layer_specs(cfg):
            source = _moe_sources(i, name, cfg, lambda _: False)
            names += [hf_layer_name(i, name, cfg)] if source is None else source[0]
    return list(dict.fromkeys(names))


_ROWS_PER_COPY = (
    16  # HF rows per block copy: keeps the transposed writes cache-resident (~10x numpy's w.T copy)
)


def fill_native(dst: np.ndarray, w: np.ndarray, hf_name: str, name: str, cfg: ModelConfig) -> None:
    """Copies HF tensor ``w`` ([out, in]) of weight ``name`` into ``dst`` (grpax layout), casting to its dtype.

    The copy goes through ``native_to_hf(dst)``, a view of ``dst`` in HF layout, a few HF rows at a time: a
    plain ``dst[...] = w.T`` on 2-byte elements is strided and runs at ~250 MB/s; blocks run at ~2.5 GB/s.

    Raises:
      ValueError: ``w`` does not have the HF shape of ``dst`` (names both).
    """
    view = native_to_hf(name, dst, cfg)
    if view.shape != w.shape:
        raise ValueError(
            f"tensor {hf_name!r} has shape {tuple(w.shape)}, expected HF layout of {dst.shape} "
            "for this config: config.json (or model_name) does not describe these weights; use the config.json "
            "saved with them"
        )
    if view.ndim < 2 or view.flags.c_contiguous or not np.may_share_memory(view, dst):  # no transpose
        dst[...] = hf_to_native(name, w, cfg)
        return
    for r in range(0, w.shape[0], _ROWS_PER_COPY):
        view[r : r + _ROWS_PER_COPY] = w[r : r + _ROWS_PER_COPY]


# Where Gemma3ForConditionalGeneration keeps its text model: the published checkpoints' names (transformers 5
# writes them too) and transformers 5's in-memory ones. The vision tower's tensors are never read.
_TEXT_MODEL_PREFIXES = (
    {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
    {"model.": "model.language_model.", "lm_head.": "lm_head."},
)


def text_model_names(has_tensor: Callable[[str], bool]) -> Callable[[str], str]:
    """Maps a causal LM's tensor name to the checkpoint's: itself, or the text model's name inside a
    ``Gemma3ForConditionalGeneration`` checkpoint (``model.layers.0...`` -> ``language_model.model.layers.0...``)."""
    if has_tensor(_TOP_HF["embed"]):
        return lambda name: name
    for prefixes in _TEXT_MODEL_PREFIXES:
        if has_tensor(prefixes["model."] + _TOP_HF["embed"][len("model.") :]):
            return lambda name, p=prefixes: next(
                (p[k] + name[len(k) :] for k in p if name.startswith(k)), name
            )
    return lambda name: name


def load_params_from_tensors(
    get_tensor: Callable[[str], np.ndarray],
    has_tensor: Callable[[str], bool],
    cfg: ModelConfig,
    dtype: str | np.dtype = np.float32,
    on_tensor: Callable[[int], None] | None = None,
    *,
    tensor_shape: Callable[[str], tuple[int, ...]] | None = None,
    lazy: Callable[[tuple[int, ...], np.dtype, Callable[[], np.ndarray]], Any] | None = None,
) -> dict:
    """Builds the params tree from HF-named tensors, one source tensor at a time (the one builder of it).

    Every tensor name (and, with ``tensor_shape``, its size) is checked before any tensor is read. A stacked
    leaf [L, ...] is filled layer by layer into one preallocated array, so building it holds that array plus
    one source tensor.

    Args:
      get_tensor: returns the HF tensor ``name`` as a numpy array (any float dtype).
      has_tensor: whether ``name`` exists.
      cfg: model config (``scan_layers`` picks stacked leaves or a per-layer list).
      dtype: output dtype of every leaf.
      on_tensor: called with each source tensor's byte count as it is read (progress bars).
      tensor_shape: a tensor's stored shape without reading it, when the source knows it.
      lazy: ``(shape, dtype, build) -> leaf``: leaves built later (``grpax.checkpoint.orbax.LazyArray``, so
        that Orbax builds each while it writes); None builds every leaf now (numpy leaves).

    Returns:
      The params tree (``grpax.models.params`` layout).

    Raises:
      MissingTensorError: a tensor is absent (names it; an untied model without ``lm_head.weight`` included).
      ValueError: a tensor has the wrong shape for this config (names it, with both shapes); with ``lazy``, a
        wrong layout of the right size is raised when the leaf is built.
    """
    from grpax.models.params import top_specs

    dtype = np.dtype(dtype)
    rename = text_model_names(has_tensor)
    if rename("model.x") != "model.x":  # a Gemma3ForConditionalGeneration checkpoint: read its text model
        get, has, shape = get_tensor, has_tensor, tensor_shape
        get_tensor, has_tensor = (lambda n: get(rename(n))), (lambda n: has(rename(n)))
        tensor_shape = (lambda n: shape(rename(n))) if shape else None
    b = _LeafBuilder(get_tensor, has_tensor, tensor_shape, on_tensor, cfg, dtype)
    params: dict = {
        name: b.leaf([_TOP_HF[name]], name, shape, stack=False) for name, (shape, _) in top_specs(cfg).items()
    }
    specs = layer_specs(cfg)
    if cfg.scan_layers:
        every = list(range(cfg.num_layers))
        params["layers"] = {name: b.layer_leaf(every, name, shape) for name, (shape, _) in specs.items()}
    else:
        params["layers"] = [
            {name: b.layer_leaf([i], name, shape) for name, (shape, _) in specs.items()}
            for i in range(cfg.num_layers)
        ]
    return _map_leaves(lambda s: lazy(s[0], dtype, s[1]) if lazy else s[1](), params)


@dataclasses.dataclass
class _LeafBuilder:
    """``load_params_from_tensors``'s leaves: each a ``(shape, build)`` pair whose names were checked first and
    whose ``build()`` reads its source tensors one at a time into the native layout."""

    get_tensor: Callable[[str], np.ndarray]
    has_tensor: Callable[[str], bool]
    tensor_shape: Callable[[str], tuple[int, ...]] | None
    on_tensor: Callable[[int], None] | None
    cfg: ModelConfig
    dtype: np.dtype

    def check(self, hf_name: str, name: str, shape: tuple[int, ...]) -> None:
        if not self.has_tensor(hf_name):
            hint = " (the config says tie_word_embeddings=false)" if name == "lm_head" else ""
            raise MissingTensorError(f"tensor {hf_name!r} is missing from the checkpoint{hint}")
        stored = self.tensor_shape(hf_name) if self.tensor_shape else None
        if stored is not None and int(np.prod(stored)) != int(np.prod(shape)):
            raise ValueError(
                f"tensor {hf_name!r} has shape {stored}, expected HF layout of {shape} "
                "for this config: config.json (or model_name) does not describe these weights; use the config.json "
                "saved with them"
            )

    def read(self, hf_name: str) -> np.ndarray:
        w = np.asarray(self.get_tensor(hf_name))
        if self.on_tensor:
            self.on_tensor(w.nbytes)
        return w

    def build(self, hf_names: list[str], name: str, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty((len(hf_names), *shape), self.dtype)
        for i, hf_name in enumerate(hf_names):
            fill_native(out[i], self.read(hf_name), hf_name, name, self.cfg)
        return out

    def single(self, hf_name: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
        w = self.read(hf_name)
        native = hf_to_native(name, w, self.cfg) if w.size == int(np.prod(shape)) else None
        if (
            native is not None
            and native.shape == shape
            and native.dtype == self.dtype
            and native.flags.c_contiguous
        ):
            return native  # already in place (the embedding): no second copy of the largest tensor
        out = np.empty(shape, self.dtype)
        fill_native(out, w, hf_name, name, self.cfg)
        return out

    def leaf(self, hf_names: list[str], name: str, shape: tuple[int, ...], stack: bool) -> Any:
        for hf_name in hf_names:
            self.check(hf_name, name, shape)
        if stack:  # [L, ...]: filled layer by layer into one preallocated array
            return ((len(hf_names), *shape), lambda: self.build(hf_names, name, shape))
        return (shape, lambda: self.single(hf_names[0], name, shape))

    def layer_leaf(self, layers: list[int], name: str, shape: tuple[int, ...]) -> Any:
        sources = [_moe_sources(i, name, self.cfg, self.has_tensor) for i in layers]
        if sources[0] is None:
            return self.leaf(
                [hf_layer_name(i, name, self.cfg) for i in layers], name, shape, stack=self.cfg.scan_layers
            )
        return _moe_leaf(sources, shape, self.cfg.scan_layers, self.has_tensor, self.read, self.dtype)


def _moe_leaf(sources: list, shape: tuple[int, ...], stack: bool, has_tensor, read, dtype: np.dtype) -> tuple:
    """A mixture-of-experts leaf of ``load_params_from_tensors``: (its shape, its builder) from one
    ``_moe_sources`` entry per layer (stacked [L, ...] when ``stack``), every source name checked now.

    Raises:
      MissingTensorError: a source tensor is absent. ValueError (when built): a layer's array is not ``shape``.
    """
    for names, _ in sources:
        for hf_name in names:
            if not has_tensor(hf_name):
                raise MissingTensorError(f"tensor {hf_name!r} is missing from the checkpoint")

    def one(names: list[str], combine) -> np.ndarray:
        native = combine([read(hf_name) for hf_name in names])
        if native.shape != shape:
            raise ValueError(
                f"tensor {names[0]!r} gives a weight of shape {native.shape}, expected {shape} for this config: "
                "config.json (or model_name) does not describe these weights; use the config.json saved with them"
            )
        return native

    def build() -> np.ndarray:
        out = np.empty((len(sources), *shape), dtype)
        for i, source in enumerate(sources):
            out[i] = one(*source)
        return out

    if stack:
        return ((len(sources), *shape), build)
    return (shape, lambda: np.ascontiguousarray(one(*sources[0]), dtype))


def _map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` on each leaf of a tree of dicts and lists, keeping its structure (and dict order)."""
    if isinstance(tree, dict):
        return {k: _map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_leaves(fn, v) for v in tree]
    return fn(tree)


def iter_hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(hf_name, array)`` for every weight of a (numpy or jax) params tree, in HF layout."""
    for name in ("embed", "final_norm", "lm_head"):
        if name in params:
            yield _TOP_HF[name], native_to_hf(name, np.asarray(params[name]), cfg)
    layers = params["layers"]
    for i in range(cfg.num_layers):
        layer = {n: w[i] for n, w in layers.items()} if isinstance(layers, dict) else layers[i]
        for name in layer_specs(cfg):
            if _moe_sources(i, name, cfg, lambda _: False) is None:
                yield hf_layer_name(i, name, cfg), native_to_hf(name, np.asarray(layer[name]), cfg)
        if cfg.num_experts:
            yield from _moe_hf_tensors(i, layer, cfg)
