"""The model families: one ``Family`` record each, the Hugging Face side of a family in one place.

A record names the family's ``config.json`` (``model_type``, ``architectures``), says how its fields read into
``ModelConfig`` (sliding-window layers, rope, the family's fixed fields and its own keys) and how they are
written back (``to_hf_config``'s family keys), and its per-expert checkpoint layout where it has one. The
forward reads only ``ModelConfig``'s fields; ``grpax.models.registry`` holds the registered models and builds
and writes config.json from these records. Adding a family of the Llama pattern is one record here.

Sources: transformers' ``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Gemma2Config``,
``Gemma3TextConfig``, ``Qwen3MoeConfig``, ``GptOssConfig``, ``MixtralConfig`` (their keys and defaults).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from grpax.errors import ConfigError

HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
HF_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}


def every_nth_global(num_layers: int, n: int) -> tuple[str, ...]:
    """Layer i is global when (i + 1) % n == 0, local otherwise (Gemma 2: n = 2; Gemma 3: n = 6)."""
    return tuple("global" if (i + 1) % n == 0 else "local" for i in range(num_layers))


def int_if_whole(x: float | None) -> float | int | None:
    """transformers' strict Gemma configs take an int ``query_pre_attn_scalar``."""
    return int(x) if x is not None and float(x).is_integer() else x


def read_rope(rope: dict[str, Any], theta: float) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    """(theta, scaling) of one rope dict (``rope_scaling`` or ``rope_parameters``: default, llama3, linear, yarn).

    Raises:
      ConfigError: another rope type.
    """
    theta = float(rope.get("rope_theta") or theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, tuple(sorted((k, float(rope[k])) for k in keys))
    if rope_type == "linear":
        return theta, (("factor", float(rope["factor"])),)
    if rope_type == "yarn":  # GPT-OSS (transformers' _compute_yarn_parameters; its defaults where unset)
        keys = dict(beta_fast=32.0, beta_slow=1.0, truncate=True)
        keys.update({k: rope[k] for k in ("beta_fast", "beta_slow", "truncate") if rope.get(k) is not None})
        keys.update(
            factor=rope["factor"], original_max_position_embeddings=rope["original_max_position_embeddings"]
        )
        if rope.get("attention_factor") is not None:
            keys["attention_factor"] = rope["attention_factor"]
        return theta, tuple(sorted((k, float(v)) for k, v in keys.items()))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope type {rope_type!r} is not supported (default, llama3, linear, yarn are)")
    return theta, None


def _one_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling of a config.json with one rope for every layer (transformers 4 or 5 form)."""
    params = hf.get("rope_parameters") or {}
    theta, scaling = read_rope(params or hf.get("rope_scaling") or {}, hf.get("rope_theta") or 10000.0)
    return dict(rope_theta=theta, rope_scaling=scaling)


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: global layers at rope_theta (1e6) with optional linear scaling; local ones at
    rope_local_base_freq (``rope_parameters``' full_attention / sliding_attention in transformers 5)."""
    params = hf.get("rope_parameters") or {}
    glob = params.get("full_attention") or hf.get("rope_scaling") or {}
    theta, scaling = read_rope(glob, hf.get("rope_theta") or 1000000.0)
    local = params.get("sliding_attention") or {}
    local_theta = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)


# How a family places its sliding-window layers when config.json has no ``layer_types``: (hf, num_layers) ->
# "global" / "local" per layer.
def _no_windows(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    return ()


def _all_local(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    return ("local",) * n  # Mistral, Mixtral: one window for every layer


def _local_from_max_window_layers(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    first = int(hf.get("max_window_layers", n))  # Qwen: layers from max_window_layers on use the window
    return tuple("local" if i >= first else "global" for i in range(n))


def _every_2nd_global(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    return every_nth_global(n, 2)  # Gemma 2, GPT-OSS


def _gemma3_pattern(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    return every_nth_global(n, int(hf.get("sliding_window_pattern", 6)))


def _layer_types_key(cfg) -> list[str]:
    return [{"global": "full_attention", "local": "sliding_attention"}[t] for t in cfg.layer_types]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's Hugging Face side.

    Attributes:
      name: ``ModelConfig.family``.
      architecture: the transformers class config.json names in ``architectures``.
      model_type: config.json's ``model_type``.
      default_layer_types: the layers' kinds when config.json has no ``layer_types`` (``_all_local``, ...).
      window_flag: the window is used only with ``use_sliding_window: true`` (Qwen).
      fixed: ``ModelConfig`` fields every model of the family has (Qwen3's q/k norms, Qwen2's biases).
      read: the family's own config.json keys -> ``ModelConfig`` fields (Gemma's soft caps, the experts).
      rope: config.json -> rope_theta, rope_scaling (and Gemma 3's rope_local_theta).
      write: ``to_hf_config``'s family keys: (cfg, hidden_act) -> config.json keys.
      attention_bias: its attention projections may carry biases (config.json's attention_bias accepted).
      tie_default: ``tie_word_embeddings`` where config.json leaves it out (transformers' default).
      null_rope_scaling: to_hf_config writes ``rope_scaling: null`` (else leaves it out) when there is none.
      per_expert: a per-expert checkpoint's (router name, expert name pattern, {grpax weight: HF projection}).
    """

    name: str
    architecture: str
    model_type: str
    write: Callable[[Any, str], dict[str, Any]]
    default_layer_types: Callable[[dict[str, Any], int], tuple[str, ...]] = _no_windows
    window_flag: bool = False
    fixed: tuple[tuple[str, Any], ...] = ()
    read: Callable[[dict[str, Any]], dict[str, Any]] = lambda hf: {}
    rope: Callable[[dict[str, Any]], dict[str, Any]] = _one_rope
    attention_bias: bool = False
    tie_default: bool = False
    null_rope_scaling: bool = False
    per_expert: tuple[str, str, dict[str, str]] | None = None


def read_family(hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """The family fields of ``ModelConfig`` (activation, sliding windows, the family's own) from a config.json
    dict of ``family``.

    Raises:
      ConfigError: an activation, rope type or expert layout grpax does not run.
    """
    n = hf["num_hidden_layers"]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS:
        raise ConfigError(f"hidden_act={act!r} is not supported ({', '.join(HF_ACTIVATIONS)} are)")
    values: dict[str, Any] = dict(family=family.name, mlp_activation=HF_ACTIVATIONS[act])
    window = hf.get("sliding_window")
    if family.window_flag and not hf.get("use_sliding_window", False):
        window = None
    types = hf.get("layer_types")
    if types is not None:
        layer_types = tuple(HF_LAYER_TYPES[t] for t in types)
    else:
        layer_types = family.default_layer_types(hf, n)
    if not window:
        layer_types, window = (), None
    values.update(sliding_window=window, layer_types=() if "local" not in layer_types else layer_types)
    values.update(family.fixed)
    values.update(family.read(hf))
    return values


def _experts(hf: dict[str, Any], mlp_dim_key: str) -> dict[str, Any]:
    """The experts' counts and width of a mixture of experts' config.json.

    Raises:
      ConfigError: dense layers among its sparse ones (``decoder_sparse_step`` > 1 or ``mlp_only_layers``),
        which grpax's stacked layers do not hold.
    """
    n = hf["num_hidden_layers"]
    step, dense = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise ConfigError(
            f"decoder_sparse_step={step}, mlp_only_layers={dense}: grpax runs Qwen3-MoE with every one of its "
            f"{n} layers sparse (decoder_sparse_step=1, mlp_only_layers=[]), as the published models are"
        )
    return dict(
        num_experts=int(hf.get("num_experts") or hf.get("num_local_experts")),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or hf.get("experts_per_token")),
        moe_mlp_dim=int(hf[mlp_dim_key]),
    )


def _read_qwen3_moe(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(_experts(hf, "moe_intermediate_size"), norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _read_gpt_oss(hf: dict[str, Any]) -> dict[str, Any]:
    # GPT-OSS's softmax over the top-k logits is Qwen3-MoE's norm_topk_prob (as Mixtral's renormalised gates)
    return dict(
        _experts(hf, "intermediate_size"),
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        attention_sinks=True,
        attention_bias=True,
        attention_out_bias=True,
    )


def _read_mixtral(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(_experts(hf, "intermediate_size"), norm_topk_prob=True)


def _gemma_reader(attn_cap: float | None, final_cap: float | None):
    """Gemma's fields: (1 + w) norms, post-norms, scaled embeddings, the query scale, soft caps (``attn_cap``
    and ``final_cap`` where config.json leaves them out: Gemma 2's 50 and 30, none for Gemma 3)."""

    def read(hf: dict[str, Any]) -> dict[str, Any]:
        return dict(
            norm_offset=1.0,
            post_norms=True,
            scale_embeddings=True,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            attn_logit_softcap=hf.get("attn_logit_softcapping", attn_cap),
            final_logit_softcap=hf.get("final_logit_softcapping", final_cap),
        )

    return read


def _write_llama(cfg, hidden_act: str) -> dict[str, Any]:
    out: dict[str, Any] = dict(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    # The published Llamas have no window; a config.json that gave one reads back the same
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    if "local" in cfg.layer_types:
        out["layer_types"] = _layer_types_key(cfg)
    return out


def _write_mistral(cfg, hidden_act: str) -> dict[str, Any]:
    return dict(sliding_window=cfg.sliding_window)  # every layer (Mistral has no layer_types)


def _write_mixtral(cfg, hidden_act: str) -> dict[str, Any]:
    return dict(
        sliding_window=cfg.sliding_window, num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
    )  # fmt: skip


def _write_qwen2(cfg, hidden_act: str) -> dict[str, Any]:
    """Qwen's windows: ``use_sliding_window``, ``max_window_layers`` (the first local layer), ``layer_types``."""
    local = [i for i, t in enumerate(cfg.layer_types) if t == "local"]
    out = dict(
        use_sliding_window=bool(local),
        sliding_window=cfg.sliding_window,
        max_window_layers=local[0] if local else cfg.num_layers,
    )
    if local:
        out["layer_types"] = _layer_types_key(cfg)
    return out


def _write_qwen3(cfg, hidden_act: str) -> dict[str, Any]:
    return dict(attention_bias=False, **_write_qwen2(cfg, hidden_act))


def _write_qwen3_moe(cfg, hidden_act: str) -> dict[str, Any]:
    return dict(
        attention_bias=False,
        **_write_qwen2(cfg, hidden_act),
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_mlp_dim,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _write_gemma(cfg, hidden_act: str) -> dict[str, Any]:
    return dict(
        attention_bias=False,
        hidden_activation=hidden_act,
        query_pre_attn_scalar=int_if_whole(cfg.query_pre_attn_scalar),
        attn_logit_softcapping=cfg.attn_logit_softcap,
        final_logit_softcapping=cfg.final_logit_softcap,
        sliding_window=cfg.sliding_window,
        layer_types=_layer_types_key(cfg) or ["full_attention"] * cfg.num_layers,
        cache_implementation="hybrid",
    )


def _write_gemma3(cfg, hidden_act: str) -> dict[str, Any]:
    return dict(_write_gemma(cfg, hidden_act), rope_local_base_freq=cfg.rope_local_theta or cfg.rope_theta)


def _write_gpt_oss(cfg, hidden_act: str) -> dict[str, Any]:
    out = dict(
        sliding_window=cfg.sliding_window,
        layer_types=_layer_types_key(cfg) or ["full_attention"] * cfg.num_layers,
        attention_bias=True,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        swiglu_limit=cfg.swiglu_limit,
    )
    if cfg.swiglu_alpha != 1.702:  # transformers' GptOssConfig has the key; the published configs do not
        out["swiglu_alpha"] = cfg.swiglu_alpha
    return out


_QWEN_WINDOWS = dict(default_layer_types=_local_from_max_window_layers, window_flag=True)
_QK_NORM = (("qk_norm", True),)

# The one table of families, in the order of SUPPORTED_ARCHITECTURES.
FAMILY_TABLE: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", _write_llama, null_rope_scaling=True),
        Family("mistral", "MistralForCausalLM", "mistral", _write_mistral, default_layer_types=_all_local),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", _write_qwen2, fixed=(("attention_bias", True),),
               attention_bias=True, **_QWEN_WINDOWS),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", _write_qwen3, fixed=_QK_NORM, **_QWEN_WINDOWS),
        Family("gemma2", "Gemma2ForCausalLM", "gemma2", _write_gemma, default_layer_types=_every_2nd_global,
               read=_gemma_reader(50.0, 30.0), tie_default=True),
        Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", _write_gemma3, default_layer_types=_gemma3_pattern,
               fixed=_QK_NORM, read=_gemma_reader(None, None), rope=_gemma3_rope, tie_default=True,
               null_rope_scaling=True),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", _write_qwen3_moe, fixed=_QK_NORM,
               read=_read_qwen3_moe, per_expert=("mlp.gate.weight", "mlp.experts.{e}.{proj}.weight",
               {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}),
               **_QWEN_WINDOWS),
        Family("gpt_oss", "GptOssForCausalLM", "gpt_oss", _write_gpt_oss, default_layer_types=_every_2nd_global,
               read=_read_gpt_oss, attention_bias=True, null_rope_scaling=True),
        Family("mixtral", "MixtralForCausalLM", "mixtral", _write_mixtral, default_layer_types=_all_local,
               read=_read_mixtral, per_expert=("block_sparse_moe.gate.weight",
               "block_sparse_moe.experts.{e}.{proj}.weight",
               {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"})),
    )
}  # fmt: skip
BY_MODEL_TYPE = {f.model_type: f for f in FAMILY_TABLE.values()}
SUPPORTED_ARCHITECTURES = (
    ", ".join(f.architecture for f in FAMILY_TABLE.values())
    + " and the text model of Gemma3ForConditionalGeneration"
)
