"""Hugging Face ``LlamaForCausalLM`` tensor names and layouts <-> grpax params.

The only module that knows Hugging Face weight names. HF stores linear weights as ``[out, in]``; grpax stores
them ``[in, out]`` with heads split (``wq`` [D, N, H]). Q and K keep HF's rotate-half row order, which is the
layout ``grpax.models.llama.rotate`` uses, so no permutation is needed here (GGUF files differ: see
``grpax.checkpoint.gguf``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from grpax.models.params import LAYER_WEIGHTS
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
}
_TOP_HF = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


class MissingTensorError(KeyError):
    """A tensor the model needs is absent from the checkpoint; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


def hf_layer_name(i: int, name: str) -> str:
    return f"model.layers.{i}.{_LAYER_HF[name]}"


def hf_to_native(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Converts one HF tensor of grpax weight ``name`` to grpax layout (see module docstring)."""
    D, N, K, H = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if name == "wq":
        return w.T.reshape(D, N, H)
    if name in ("wk", "wv"):
        return w.T.reshape(D, K, H)
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
    if name == "wo":
        return w.reshape(-1, D).T
    if name in ("w_gate", "w_up", "w_down", "lm_head"):
        return w.T
    return w


def expected_hf_names(cfg: ModelConfig) -> list[str]:
    names = [_TOP_HF["embed"], _TOP_HF["final_norm"]]
    if not cfg.tie_word_embeddings:
        names.append(_TOP_HF["lm_head"])
    names += [hf_layer_name(i, n) for i in range(cfg.num_layers) for n in LAYER_WEIGHTS]
    return names


def load_params_from_tensors(
    get_tensor: Callable[[str], np.ndarray],
    has_tensor: Callable[[str], bool],
    cfg: ModelConfig,
    dtype: str | np.dtype = np.float32,
    on_tensor: Callable[[int], None] | None = None,
) -> dict:
    """Builds a numpy params tree from HF-named tensors, fetching one tensor at a time.

    Stacked layers are filled in place into preallocated [L, ...] arrays, so peak memory is the output plus
    one source tensor (the streaming path used by ``lazy_load_tensors``).

    Args:
      get_tensor: returns the HF tensor ``name`` as a numpy array (any float dtype).
      has_tensor: whether ``name`` exists.
      cfg: model config (``scan_layers`` picks the layout).
      dtype: output dtype of every leaf.
      on_tensor: called with each tensor's byte count (progress bars).

    Returns:
      The params tree with numpy leaves.

    Raises:
      MissingTensorError: a tensor is absent (names it; an untied model without ``lm_head.weight`` included).
      ValueError: a tensor has the wrong shape (names it, with both shapes).
    """
    from grpax.models.params import layer_specs, top_specs

    dtype = np.dtype(dtype)

    def fetch(hf_name: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if not has_tensor(hf_name):
            hint = " (the config says tie_word_embeddings=false)" if name == "lm_head" else ""
            raise MissingTensorError(f"tensor {hf_name!r} is missing from the checkpoint{hint}")
        w = np.asarray(get_tensor(hf_name))
        if on_tensor:
            on_tensor(w.nbytes)
        out = hf_to_native(name, w, cfg) if w.size == int(np.prod(shape)) else None
        if out is None or out.shape != shape:
            raise ValueError(
                f"tensor {hf_name!r} has shape {tuple(w.shape)}, expected HF layout of {shape} "
                f"for this config; is model_name right?"
            )
        return out.astype(dtype, copy=False)

    params: dict = {}
    for name, (shape, _) in top_specs(cfg).items():
        params[name] = fetch(_TOP_HF[name], name, shape)
    specs = layer_specs(cfg)
    if cfg.scan_layers:
        stacked = {name: np.empty((cfg.num_layers, *shape), dtype) for name, (shape, _) in specs.items()}
        for i in range(cfg.num_layers):
            for name, (shape, _) in specs.items():
                stacked[name][i] = fetch(hf_layer_name(i, name), name, shape)
        params["layers"] = stacked
    else:
        params["layers"] = [
            {name: fetch(hf_layer_name(i, name), name, shape) for name, (shape, _) in specs.items()}
            for i in range(cfg.num_layers)
        ]
    return params


def iter_hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(hf_name, array)`` for every weight of a (numpy or jax) params tree, in HF layout."""
    for name in ("embed", "final_norm", "lm_head"):
        if name in params:
            yield _TOP_HF[name], native_to_hf(name, np.asarray(params[name]), cfg)
    layers = params["layers"]
    for i in range(cfg.num_layers):
        layer = {n: w[i] for n, w in layers.items()} if isinstance(layers, dict) else layers[i]
        for name in LAYER_WEIGHTS:
            yield hf_layer_name(i, name), native_to_hf(name, np.asarray(layer[name]), cfg)
