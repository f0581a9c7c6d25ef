"""Model configurations: the ``model_name`` registry and the Hugging Face ``config.json`` importer/exporter.

The shapes are those of the Hugging Face configs published with each model (Llama 3, SmolLM2, Qwen2.5, Qwen3,
Gemma 2, Gemma 3, Mistral, and the mixtures of experts Qwen3-MoE, GPT-OSS and Mixtral). Any config.json of a
supported architecture (``SUPPORTED_ARCHITECTURES``) is accepted too, in the transformers 4 form
(``rope_theta`` + ``rope_scaling``) and the transformers 5 form (``rope_parameters``, ``layer_types``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from grpax.errors import ConfigError, suggest
from grpax.models.families import (
    BY_MODEL_TYPE,
    FAMILY_TABLE,
    SUPPORTED_ARCHITECTURES,
    every_nth_global,
    read_family,
)

# The dtypes a model's parameters (weight_dtype) and activations (dtype) may take.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# Rematerialisation of each layer in the backward pass (grpax.models.llama: jax.checkpoint policies).
REMAT_POLICIES = ("none", "full", "dots", "minimal", "custom")
# MaxText's remat_policy=custom: activations the layer names (jax.ad_checkpoint.checkpoint_name), each rematerialised
# (remat), saved on the device (device) or offloaded to host memory (offload) for the backward pass.
REMAT_NAMES = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1",
    "mlpwo",
)  # fmt: skip
REMAT_CHOICES = ("remat", "device", "offload")
# The attention implementations (grpax.models.attention.IMPLEMENTATIONS): MaxText's ``attention`` key, its
# dot_product value (the plain XLA einsums); jax.nn.dot_product_attention's XLA and cuDNN implementations; flash,
# MaxText's TPU value: Pallas's splash attention kernel.
ATTENTION_IMPLEMENTATIONS = ("dot_product", "jax_nn", "cudnn", "flash")
# The implementations by jax.nn.dot_product_attention: no soft-capping, no sinks.
_NN_ATTENTION = ("jax_nn", "cudnn")
# MaxText's other values, each a kernel grpax does not have: the refusal says so.
_MAXTEXT_ATTENTION = {
    "autoselected": "MaxText's per-platform choice",
    "cudnn_flash_te": "MaxText's TransformerEngine kernel",
}


MLP_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
LAYER_TYPES = ("global", "local")  # full causal attention | sliding-window attention


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters of every supported family (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3,
    Qwen3-MoE, GPT-OSS).

    Llama (Touvron et al. 2023; Llama 3 herd paper for rope scaling) is the base; the family fields switch on
    what each adds: q/k/v biases (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3), Gemma's
    (1 + w) RMSNorm, norms after attention and MLP, GeGLU, sqrt(D)-scaled embeddings, logit soft-capping and
    ``query_pre_attn_scalar`` (Gemma 2/3 reports), sliding-window attention on the ``local`` layers
    (Mistral, Gemma 2/3, GPT-OSS) with Gemma 3's own local RoPE base; a mixture of experts in place of the MLP
    (Qwen3-MoE, GPT-OSS: ``grpax.models.moe``), attention sinks, an o-projection bias and YaRN RoPE (GPT-OSS).

    Shape letters: D hidden_dim, N num_heads, K num_kv_heads, H head_dim, F mlp_dim (moe_mlp_dim of each
    expert), V vocab_size, L num_layers, E num_experts, k num_experts_per_tok.
    """

    vocab_size: int  # V
    hidden_dim: int  # D
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H (need not equal D / N)
    mlp_dim: int  # F
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # RoPE frequency scaling of the global layers: Llama 3's {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, linear {"factor"} (positions / factor, Gemma 3), or None.
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Run-time choices (not part of the checkpoint's architecture).
    dtype: str = "float32"  # activations / matmul inputs
    weight_dtype: str = "float32"  # stored parameters
    scan_layers: bool = True
    # none | full | dots | minimal | custom (jax.checkpoint policies on each layer)
    remat_policy: str = "none"
    # remat_policy=custom: (name, "device" | "offload") for the REMAT_NAMES kept; the others are rematerialised.
    remat_names: tuple[tuple[str, str], ...] = ()
    attention: str = "dot_product"  # one of ATTENTION_IMPLEMENTATIONS (grpax.models.attention)
    # Architecture of the family (defaults: Llama).
    family: str = "llama"  # a key of grpax.models.families.FAMILY_TABLE: HF names, config.json form
    attention_bias: bool = False  # q, k and v projections have biases (Qwen2); o has none
    qk_norm: bool = False  # RMSNorm over H of each query and key head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): 1.0 for Gemma, 0.0 for the others
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add (Gemma 2/3)
    mlp_activation: str = "silu"  # of the gate: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma) | gelu
    scale_embeddings: bool = False  # embeddings times sqrt(D), rounded to the compute dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (Gemma); None: H ** -0.5
    attn_logit_softcap: float | None = None  # scores -> c * tanh(scores / c) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2): sampled and scored
    sliding_window: int | None = None  # a local layer's query at p sees keys at p - window < q <= p (tokens)
    layer_types: tuple[str, ...] = ()  # "global" | "local" per layer; () = every layer global
    rope_local_theta: float | None = None  # RoPE base of the local layers, unscaled (Gemma 3); None: global's
    # Mixture of experts (Qwen3-MoE, GPT-OSS; grpax.models.moe): every layer's MLP is E experts of moe_mlp_dim,
    # each token sent to k of them by a linear router; 0 experts = the dense MLP of mlp_dim.
    num_experts: int = 0  # E (MaxText's key)
    num_experts_per_tok: int = 0  # k (MaxText's key)
    moe_mlp_dim: int = 0  # F of each expert
    norm_topk_prob: bool = False  # the k gates renormalised to sum to 1 (Qwen3-MoE's key; GPT-OSS's softmax)
    router_bias: bool = False  # the router has a bias (GPT-OSS)
    expert_bias: bool = False  # the experts' gate, up and down projections have biases (GPT-OSS)
    # GPT-OSS's clamped SwiGLU: (clip(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l); None: SwiGLU
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = (
        False  # a learned logit per head in every attention softmax's denominator (GPT-OSS)
    )
    attention_out_bias: bool = False  # the o projection has a bias (GPT-OSS)

    def __post_init__(self) -> None:
        for key in ("dtype", "weight_dtype"):
            value = getattr(self, key)
            if value not in FLOAT_DTYPES:
                raise ConfigError(
                    f"{key}={value!r} is not a supported dtype: use one of {', '.join(FLOAT_DTYPES)}."
                    f"{suggest(str(value), FLOAT_DTYPES)}"
                )
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(
                f"remat_policy={self.remat_policy!r}: expected one of {', '.join(REMAT_POLICIES)}"
                f".{suggest(str(self.remat_policy), REMAT_POLICIES)}"
            )
        for name, choice in self.remat_names:
            if name not in REMAT_NAMES or choice not in ("device", "offload"):
                raise ConfigError(
                    f"{name}={choice!r}: expected a name of {', '.join(REMAT_NAMES)} kept on the device or offloaded"
                )
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            known = _MAXTEXT_ATTENTION.get(self.attention)
            raise ConfigError(
                f"attention={self.attention!r}{f' is {known}, which grpax does not have' if known else ''}: "
                f"expected one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
                f".{suggest(str(self.attention), ATTENTION_IMPLEMENTATIONS)}"
            )
        if self.attention in _NN_ATTENTION and self.attn_logit_softcap:
            raise ConfigError(
                f"attention={self.attention} has no soft-capping of the scores, which this model uses "
                f"(attn_logit_softcap={self.attn_logit_softcap}): pass attention=dot_product"
            )
        if not isinstance(self.family, str) or self.family not in FAMILY_TABLE:  # a family is its record
            raise ConfigError(f"family={self.family!r}: expected one of {', '.join(FAMILY_TABLE)}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ConfigError(
                f"mlp_activation={self.mlp_activation!r}: expected one of {', '.join(MLP_ACTIVATIONS)}"
            )
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES)
        ):
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries {sorted(set(self.layer_types))}: expected "
                f"num_layers={self.num_layers} entries of {', '.join(LAYER_TYPES)}"
            )
        if "local" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError(f"local layers need a positive sliding_window (got {self.sliding_window})")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_mlp_dim > 0
        ):
            raise ConfigError(
                f"num_experts={self.num_experts} needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                f"num_experts and moe_mlp_dim > 0 (got {self.moe_mlp_dim})"
            )
        if self.attention == "flash" and "local" in self.layer_types:
            raise ConfigError(
                "attention=flash has no sliding-window layers, which this model has (layer_types with local "
                "layers): pass attention=dot_product"
            )
        if self.attention in _NN_ATTENTION and self.attention_sinks:
            raise ConfigError(
                f"attention={self.attention} has no attention sinks, which this model uses: pass "
                "attention=dot_product"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, float] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within ``sliding_window`` only."""
        return tuple(t == "local" for t in self.layer_types) or (False,) * self.num_layers

    @property
    def attention_scale(self) -> float:
        """The factor of the query-key scores: ``query_pre_attn_scalar ** -0.5``, else ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **kwargs: Any) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)

    def num_params(self) -> int:
        """Parameter count from shapes alone (no memory is allocated)."""
        D, N, K, H, F, V = (
            self.hidden_dim,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.mlp_dim,
            self.vocab_size,
        )
        E, Fe = self.num_experts, self.moe_mlp_dim
        mlp = (3 * D * Fe * E + D * E) if E else 3 * D * F
        mlp += E * self.router_bias + E * (2 * Fe + D) * self.expert_bias
        per_layer = D * N * H + 2 * D * K * H + N * H * D + mlp + 2 * D
        per_layer += (N + 2 * K) * H if self.attention_bias else 0
        per_layer += D if self.attention_out_bias else 0
        per_layer += N if self.attention_sinks else 0
        per_layer += 2 * H if self.qk_norm else 0
        per_layer += 2 * D if self.post_norms else 0
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + D

    def expert_params(self) -> int:
        """The experts' parameters of all layers, their biases included (0 for a dense model)."""
        D, Fe = self.hidden_dim, self.moe_mlp_dim
        return self.num_layers * self.num_experts * (3 * D * Fe + (2 * Fe + D) * self.expert_bias)


def _llama3_scaling(factor: float) -> tuple[tuple[str, float], ...]:
    return (
        ("factor", factor),
        ("high_freq_factor", 4.0),
        ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 8192.0),
    )


_LLAMA3_INSTRUCT_EOS = (128001, 128008, 128009)
_LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_dim=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=14336,
    rope_theta=500000.0,
    rope_scaling=_llama3_scaling(8.0),
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001,),
)
_LLAMA31_70B = dict(_LLAMA31_8B, hidden_dim=8192, num_layers=80, num_heads=64, mlp_dim=28672)
_LLAMA32_1B = dict(
    _LLAMA31_8B,
    hidden_dim=2048,
    num_layers=16,
    num_heads=32,
    head_dim=64,
    mlp_dim=8192,
    rope_scaling=_llama3_scaling(32.0),
    tie_word_embeddings=True,
)
_LLAMA32_3B = dict(_LLAMA32_1B, hidden_dim=3072, num_layers=28, num_heads=24, head_dim=128)
_SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_dim=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    mlp_dim=1536,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=0,
    eos_token_ids=(0,),
)
_SMOLLM2_360M = dict(_SMOLLM2_135M, hidden_dim=960, num_layers=32, num_heads=15, num_kv_heads=5, mlp_dim=2560)
_SMOLLM2_17B = dict(
    _SMOLLM2_135M,
    hidden_dim=2048,
    num_layers=24,
    num_heads=32,
    num_kv_heads=32,
    mlp_dim=8192,
    rope_theta=130000.0,
)
_SMOL_INSTRUCT = dict(bos_token_id=1, eos_token_ids=(2,), pad_token_id=2)
_LLAMA_INSTRUCT = dict(eos_token_ids=_LLAMA3_INSTRUCT_EOS)


# Qwen2.5 and Qwen3 (config.json of Qwen/Qwen2.5-*, Qwen/Qwen3-*): <|endoftext|> 151643, <|im_end|> 151645.
_QWEN = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_ids=(151643,))
_QWEN_CHAT = dict(eos_token_ids=(151645,), pad_token_id=151643)
_QWEN25_15B = dict(
    _QWEN,
    family="qwen2",
    attention_bias=True,
    vocab_size=151936,
    hidden_dim=1536,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    mlp_dim=8960,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
_QWEN25_7B = dict(
    _QWEN25_15B,
    vocab_size=152064,
    hidden_dim=3584,
    num_heads=28,
    num_kv_heads=4,
    mlp_dim=18944,
    tie_word_embeddings=False,
)
_QWEN25_INSTRUCT = dict(_QWEN_CHAT, max_position_embeddings=32768)
_QWEN3_06B = dict(
    _QWEN,
    **_QWEN_CHAT,
    family="qwen3",
    qk_norm=True,
    vocab_size=151936,
    hidden_dim=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=3072,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
)
_QWEN3_4B = dict(_QWEN3_06B, hidden_dim=2560, num_layers=36, num_heads=32, mlp_dim=9728)
_QWEN3_8B = dict(_QWEN3_4B, hidden_dim=4096, mlp_dim=12288, tie_word_embeddings=False)
_QWEN3_14B = dict(_QWEN3_8B, hidden_dim=5120, num_layers=40, num_heads=40, mlp_dim=17408)
# Gemma 2 (google/gemma-2-*): <eos> 1, <bos> 2, <pad> 0; the -it models also stop at <end_of_turn> 107.
_GEMMA = dict(
    norm_offset=1.0,
    post_norms=True,
    mlp_activation="gelu_tanh",
    scale_embeddings=True,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_ids=(1,),
    pad_token_id=0,
    head_dim=256,
    query_pre_attn_scalar=256.0,
)
_GEMMA2_2B = dict(
    _GEMMA,
    family="gemma2",
    vocab_size=256000,
    hidden_dim=2304,
    num_layers=26,
    num_heads=8,
    num_kv_heads=4,
    mlp_dim=9216,
    max_position_embeddings=8192,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    sliding_window=4096,
    layer_types=every_nth_global(26, 2),
)
_GEMMA2_9B = dict(
    _GEMMA2_2B,
    hidden_dim=3584,
    num_layers=42,
    num_heads=16,
    num_kv_heads=8,
    mlp_dim=14336,
    layer_types=every_nth_global(42, 2),
)
# Gemma 3 text (google/gemma-3-1b-*: Gemma3ForCausalLM; 4b/12b: the text_config of
# Gemma3ForConditionalGeneration, whose unset keys take Gemma3TextConfig's defaults); <end_of_turn> is 106.
_GEMMA3_1B = dict(
    _GEMMA,
    family="gemma3",
    qk_norm=True,
    vocab_size=262144,
    hidden_dim=1152,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    mlp_dim=6912,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rope_local_theta=10000.0,
    sliding_window=512,
    layer_types=every_nth_global(26, 6),
)
_GEMMA3_4B = dict(
    _GEMMA3_1B,
    vocab_size=262208,
    hidden_dim=2560,
    num_layers=34,
    num_heads=8,
    num_kv_heads=4,
    mlp_dim=10240,
    max_position_embeddings=131072,
    rope_scaling=(("factor", 8.0),),
    sliding_window=1024,
    layer_types=every_nth_global(34, 6),
)
_GEMMA3_12B = dict(
    _GEMMA3_4B,
    hidden_dim=3840,
    num_layers=48,
    num_heads=16,
    num_kv_heads=8,
    mlp_dim=15360,
    layer_types=every_nth_global(48, 6),
)
_GEMMA2_IT, _GEMMA3_IT = dict(eos_token_ids=(1, 107)), dict(eos_token_ids=(1, 106))
# Mistral 7B v0.3 (mistralai/Mistral-7B-v0.3): full attention (v0.1's sliding_window=4096 was dropped in v0.2).
_MISTRAL_7B = dict(
    family="mistral",
    vocab_size=32768,
    hidden_dim=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=14336,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    bos_token_id=1,
    eos_token_ids=(2,),
)


# Mixtures of experts. Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): 128 experts of 768, 8 per token, every layer sparse.
_QWEN3_30B_A3B = dict(
    _QWEN3_06B,
    family="qwen3_moe",
    hidden_dim=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    mlp_dim=6144,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_mlp_dim=768,
    norm_topk_prob=True,
)
# GPT-OSS 20B (openai/gpt-oss-20b): 32 experts of 2880, 4 per token; sliding (128 tokens) and full layers
# alternate; YaRN RoPE x32 over 4096 positions; <|return|> 200002 ends a reply, <|endoftext|> 199999 pads.
_GPT_OSS_20B = dict(
    family="gpt_oss",
    vocab_size=201088,
    hidden_dim=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    mlp_dim=2880,
    rope_theta=150000.0,
    rope_scaling=(
        ("beta_fast", 32.0),
        ("beta_slow", 1.0),
        ("factor", 32.0),
        ("original_max_position_embeddings", 4096.0),
        ("truncate", 0.0),
    ),
    max_position_embeddings=131072,
    eos_token_ids=(200002,),
    pad_token_id=199999,
    sliding_window=128,
    layer_types=every_nth_global(24, 2),
    attention_bias=True,
    attention_out_bias=True,
    attention_sinks=True,
    num_experts=32,
    num_experts_per_tok=4,
    moe_mlp_dim=2880,
    norm_topk_prob=True,
    router_bias=True,
    expert_bias=True,
    swiglu_limit=7.0,
)


# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): Mistral's attention, 8 experts of 14336, 2 per token.
_MIXTRAL_8X7B = dict(
    _MISTRAL_7B,
    family="mixtral",
    vocab_size=32000,
    num_experts=8,
    num_experts_per_tok=2,
    moe_mlp_dim=14336,
    norm_topk_prob=True,
)


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """One row of the model table: what ``model_name`` selects."""

    shapes: dict[str, Any]  # ModelConfig fields of the published config.json
    hf_repo: str  # the Hub repository (``grpax to_native model_name=...`` downloads it)
    preset: str  # grpax/configs/<preset>.yml: the defaults of every command for this model


_SMOL, _LLAMA = "smollm2", "llama3"  # presets: small CPU-friendly models, accelerator-sized models

# The one table of registered models: shapes, Hub repository, preset.
MODELS: dict[str, RegisteredModel] = {
    "llama3.1-8b": RegisteredModel(_LLAMA31_8B, "meta-llama/Llama-3.1-8B", _LLAMA),
    "llama3.1-8b-Instruct": RegisteredModel(
        dict(_LLAMA31_8B, **_LLAMA_INSTRUCT), "meta-llama/Llama-3.1-8B-Instruct", _LLAMA
    ),
    "llama3.1-70b": RegisteredModel(_LLAMA31_70B, "meta-llama/Llama-3.1-70B", _LLAMA),
    "llama3.1-70b-Instruct": RegisteredModel(
        dict(_LLAMA31_70B, **_LLAMA_INSTRUCT), "meta-llama/Llama-3.1-70B-Instruct", _LLAMA
    ),
    "llama3.2-1b": RegisteredModel(_LLAMA32_1B, "meta-llama/Llama-3.2-1B", _LLAMA),
    "llama3.2-1b-Instruct": RegisteredModel(
        dict(_LLAMA32_1B, **_LLAMA_INSTRUCT), "meta-llama/Llama-3.2-1B-Instruct", _LLAMA
    ),
    "llama3.2-3b": RegisteredModel(_LLAMA32_3B, "meta-llama/Llama-3.2-3B", _LLAMA),
    "llama3.2-3b-Instruct": RegisteredModel(
        dict(_LLAMA32_3B, **_LLAMA_INSTRUCT), "meta-llama/Llama-3.2-3B-Instruct", _LLAMA
    ),
    "smollm2-135m": RegisteredModel(_SMOLLM2_135M, "HuggingFaceTB/SmolLM2-135M", _SMOL),
    "smollm2-135m-Instruct": RegisteredModel(
        dict(_SMOLLM2_135M, **_SMOL_INSTRUCT), "HuggingFaceTB/SmolLM2-135M-Instruct", _SMOL
    ),
    "smollm2-360m": RegisteredModel(_SMOLLM2_360M, "HuggingFaceTB/SmolLM2-360M", _SMOL),
    "smollm2-360m-Instruct": RegisteredModel(
        dict(_SMOLLM2_360M, **_SMOL_INSTRUCT), "HuggingFaceTB/SmolLM2-360M-Instruct", _SMOL
    ),
    "smollm2-1.7b": RegisteredModel(_SMOLLM2_17B, "HuggingFaceTB/SmolLM2-1.7B", _SMOL),
    "smollm2-1.7b-Instruct": RegisteredModel(
        dict(_SMOLLM2_17B, **_SMOL_INSTRUCT), "HuggingFaceTB/SmolLM2-1.7B-Instruct", _SMOL
    ),
    "qwen2.5-1.5b": RegisteredModel(_QWEN25_15B, "Qwen/Qwen2.5-1.5B", _LLAMA),
    "qwen2.5-1.5b-Instruct": RegisteredModel(
        dict(_QWEN25_15B, **_QWEN25_INSTRUCT), "Qwen/Qwen2.5-1.5B-Instruct", _LLAMA
    ),
    "qwen2.5-7b": RegisteredModel(_QWEN25_7B, "Qwen/Qwen2.5-7B", _LLAMA),
    "qwen2.5-7b-Instruct": RegisteredModel(
        dict(_QWEN25_7B, **_QWEN25_INSTRUCT), "Qwen/Qwen2.5-7B-Instruct", _LLAMA
    ),
    # Qwen3's released names are its chat models (thinking and non-thinking in one); -Base: pre-trained only.
    "qwen3-0.6b": RegisteredModel(_QWEN3_06B, "Qwen/Qwen3-0.6B", _LLAMA),
    "qwen3-0.6b-Base": RegisteredModel(dict(_QWEN3_06B, **_QWEN), "Qwen/Qwen3-0.6B-Base", _LLAMA),
    "qwen3-4b": RegisteredModel(_QWEN3_4B, "Qwen/Qwen3-4B", _LLAMA),
    "qwen3-4b-Base": RegisteredModel(dict(_QWEN3_4B, **_QWEN), "Qwen/Qwen3-4B-Base", _LLAMA),
    "qwen3-8b": RegisteredModel(_QWEN3_8B, "Qwen/Qwen3-8B", _LLAMA),
    "qwen3-8b-Base": RegisteredModel(dict(_QWEN3_8B, **_QWEN), "Qwen/Qwen3-8B-Base", _LLAMA),
    "qwen3-14b": RegisteredModel(_QWEN3_14B, "Qwen/Qwen3-14B", _LLAMA),
    "qwen3-14b-Base": RegisteredModel(dict(_QWEN3_14B, **_QWEN), "Qwen/Qwen3-14B-Base", _LLAMA),
    "gemma2-2b": RegisteredModel(_GEMMA2_2B, "google/gemma-2-2b", _LLAMA),
    "gemma2-2b-it": RegisteredModel(dict(_GEMMA2_2B, **_GEMMA2_IT), "google/gemma-2-2b-it", _LLAMA),
    "gemma2-9b": RegisteredModel(_GEMMA2_9B, "google/gemma-2-9b", _LLAMA),
    "gemma2-9b-it": RegisteredModel(dict(_GEMMA2_9B, **_GEMMA2_IT), "google/gemma-2-9b-it", _LLAMA),
    "gemma3-1b": RegisteredModel(_GEMMA3_1B, "google/gemma-3-1b-pt", _LLAMA),
    "gemma3-1b-it": RegisteredModel(dict(_GEMMA3_1B, **_GEMMA3_IT), "google/gemma-3-1b-it", _LLAMA),
    "gemma3-4b": RegisteredModel(_GEMMA3_4B, "google/gemma-3-4b-pt", _LLAMA),
    "gemma3-4b-it": RegisteredModel(dict(_GEMMA3_4B, **_GEMMA3_IT), "google/gemma-3-4b-it", _LLAMA),
    "gemma3-12b": RegisteredModel(_GEMMA3_12B, "google/gemma-3-12b-pt", _LLAMA),
    "gemma3-12b-it": RegisteredModel(dict(_GEMMA3_12B, **_GEMMA3_IT), "google/gemma-3-12b-it", _LLAMA),
    "mistral-7b": RegisteredModel(_MISTRAL_7B, "mistralai/Mistral-7B-v0.3", _LLAMA),
    "mistral-7b-Instruct": RegisteredModel(_MISTRAL_7B, "mistralai/Mistral-7B-Instruct-v0.3", _LLAMA),
    "qwen3-30b-a3b": RegisteredModel(_QWEN3_30B_A3B, "Qwen/Qwen3-30B-A3B", _LLAMA),
    "qwen3-30b-a3b-Base": RegisteredModel(dict(_QWEN3_30B_A3B, **_QWEN), "Qwen/Qwen3-30B-A3B-Base", _LLAMA),
    "gpt-oss-20b": RegisteredModel(_GPT_OSS_20B, "openai/gpt-oss-20b", _LLAMA),
    "mixtral-8x7b": RegisteredModel(_MIXTRAL_8X7B, "mistralai/Mixtral-8x7B-v0.1", _LLAMA),
    "mixtral-8x7b-Instruct": RegisteredModel(_MIXTRAL_8X7B, "mistralai/Mixtral-8x7B-Instruct-v0.1", _LLAMA),
}


def get_model_config(model_name: str, **overrides: Any) -> ModelConfig:
    """Returns the registered ``ModelConfig`` for ``model_name`` (see ``MODELS``).

    Raises:
      ConfigError: if ``model_name`` is not registered (with a did-you-mean).
    """
    if model_name not in MODELS:
        raise ConfigError(
            f"model_name={model_name!r} is not registered.{suggest(model_name, MODELS)} "
            f"Known: {', '.join(MODELS)}; or pass a Hugging Face config.json via hf_model_path."
        )
    return ModelConfig(**{**MODELS[model_name].shapes, **overrides})


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)


def from_hf_config(hf: dict[str, Any], source: str = "config.json", **overrides: Any) -> ModelConfig:
    """Builds a ``ModelConfig`` from a config.json dict of a supported architecture (transformers 4 or 5 form).

    Supported: ``SUPPORTED_ARCHITECTURES`` (Gemma3ForConditionalGeneration: its ``text_config``, the vision
    tower ignored). ``source`` (the file's path) opens every error message.

    Raises:
      ConfigError: for another architecture (multimodal towers, other mixtures of experts, ...), biases Llama
        or Qwen3 do not have, an unsupported rope type or activation, a Qwen3-MoE with dense layers.
    """
    model_type = hf.get("model_type", "llama")
    family = BY_MODEL_TYPE.get(model_type)
    default_arch = (
        "Gemma3ForConditionalGeneration" if model_type == "gemma3" else getattr(family, "architecture", "?")
    )
    given = hf.get("architectures")
    archs = given or [default_arch]  # transformers' own to_dict() leaves them out
    if model_type == "gemma3" and "Gemma3ForConditionalGeneration" in archs:
        text = dict(hf.get("text_config") or {})
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if hf.get(key) is not None:  # the top level's (eos: <eos> and <end_of_turn>) over text_config's
                text[key] = hf[key]
        # Gemma3TextConfig's defaults, which published text_configs leave out.
        defaults = dict(
            vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
            max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
            sliding_window=4096, hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        )  # fmt: skip
        hf = {**defaults, **{k: v for k, v in text.items() if v is not None}}
        hf.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
        model_type, archs, family = "gemma3_text", hf["architectures"], FAMILY_TABLE["gemma3"]
    if family is None or family.architecture not in archs:
        raise ConfigError(
            f"{source}: architectures={given or '(none)'}, model_type={model_type!r} is not supported; "
            f"grpax supports {SUPPORTED_ARCHITECTURES}: convert a checkpoint of one of them"
        )
    if (not family.attention_bias and hf.get("attention_bias")) or hf.get("mlp_bias"):
        raise ConfigError(
            f"{source}: attention_bias/mlp_bias=true is not supported; grpax runs {family.architecture} without them"
        )
    try:
        rope, family_values = family.rope(hf), read_family(hf, family)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    num_heads = hf["num_attention_heads"]
    values = dict(
        vocab_size=hf["vocab_size"],
        hidden_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        mlp_dim=hf["intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tie_default)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        **rope,
        **family_values,
    )
    values.update(overrides)
    return ModelConfig(**values)


def _hf_rope(theta: float, scaling: dict[str, float] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    if "beta_fast" in scaling:
        ints = ("original_max_position_embeddings",)
        yarn = {k: (int(v) if k in ints else bool(v) if k == "truncate" else v) for k, v in scaling.items()}
        return {"rope_type": "yarn", **yarn}
    if "low_freq_factor" not in scaling:
        return {"rope_type": "linear", "factor": scaling["factor"]}
    return {
        "rope_type": "llama3",
        **{k: (int(v) if k == "original_max_position_embeddings" else v) for k, v in scaling.items()},
    }


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """The transformers 4-form ``config.json`` dict for ``cfg`` (loads in transformers 4 and 5, and vLLM)."""
    eos = list(cfg.eos_token_ids)
    family = FAMILY_TABLE[cfg.family]
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp_activation, cfg.mlp_activation),
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _hf_rope(cfg.rope_theta, cfg.rope_scaling_dict),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": torch_dtype,
    }
    out.update(family.write(cfg, out["hidden_act"]))
    if not family.null_rope_scaling and out["rope_scaling"] is None:
        del out["rope_scaling"]
    return out


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The dict of ``config.json`` (a file or the folder holding it), parsed.

    Raises:
      ConfigError: if the file is missing or not JSON.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: hf_model_path must be a folder with config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None


def load_hf_config(path: str | Path, hf: dict[str, Any] | None = None, **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` of ``config.json`` (a file or the folder holding it).

    Args:
      path: the file or its folder.
      hf: its dict when the caller has already read it (``read_hf_config``); None: read here.
      **overrides: ``ModelConfig`` fields to set (the run-time choices: dtype, scan_layers, ...).

    Raises:
      ConfigError: if the file is missing, not JSON, or not a supported architecture.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if hf is None:
        hf = read_hf_config(path)
    try:
        return from_hf_config(hf, source=str(path), **overrides)
    except KeyError as e:
        raise ConfigError(
            f"{path} lacks the key {e.args[0]!r} that a config of its architecture needs"
        ) from None


def checkpoint_config(checkpoint: str | Path, **overrides: Any) -> tuple[ModelConfig | None, Path | None]:
    """The model of a checkpoint's params folder from the nearest ``config.json`` at or above it, read once
    per command: the checks before the load (``check_context_length``) and the load (``load_model``'s
    ``model_cfg``) take it from here.

    Returns:
      ``(ModelConfig with overrides, its config.json)``, or ``(None, None)`` when no folder at or above
      ``checkpoint`` holds one (the load then says so).
    """
    found = find_hf_config(checkpoint) if checkpoint else None
    return (load_hf_config(found, **overrides), found) if found else (None, None)


ARCH_FIELDS = (
    "family",
    "vocab_size",
    "hidden_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_mlp_dim",
)


def shape_diffs(cfg: ModelConfig, model_name: str) -> list[str]:
    """``"field: cfg's vs the registered model's"`` for each of ``ARCH_FIELDS`` where ``cfg`` differs from the
    registered ``model_name`` ([] for a name that is not registered)."""
    if model_name not in MODELS:
        return []
    ref = get_model_config(model_name)
    return [
        f"{f}: {getattr(cfg, f)} vs {getattr(ref, f)}"
        for f in ARCH_FIELDS
        if getattr(cfg, f) != getattr(ref, f)
    ]


def check_matches(cfg: ModelConfig, model_name: str, source: str) -> None:
    """Raises ConfigError if ``cfg``'s shapes differ from the registered ``model_name``'s."""
    diffs = shape_diffs(cfg, model_name)
    if diffs:
        names = registered_names_of(cfg)
        own = f"model_name={' or model_name='.join(names)} (its registered name) or " if names else ""
        raise ConfigError(
            f"{source} does not match model_name={model_name} ({'; '.join(diffs)}); "
            f"pass {own}model_name='' to use the checkpoint's own config.json"
        )


def find_hf_config(path: str | Path) -> Path | None:
    """The nearest ``config.json`` at or above ``path`` (where a converted or trained checkpoint keeps it)."""
    path = Path(path).absolute()
    return next((f / "config.json" for f in [path, *path.parents] if (f / "config.json").is_file()), None)


def registered_names_of(cfg: ModelConfig) -> list[str]:
    """The registered names with ``cfg``'s shapes; those with its special tokens too when any has them."""
    refs = {name: get_model_config(name) for name in MODELS}
    same = [
        name for name, ref in refs.items() if all(getattr(cfg, f) == getattr(ref, f) for f in ARCH_FIELDS)
    ]
    tokens = ("bos_token_id", "eos_token_ids")
    exact = [name for name in same if all(getattr(cfg, f) == getattr(refs[name], f) for f in tokens)]
    return exact or same


def check_context_length(total: int, what: str, cfg: ModelConfig | None, source: str | Path | None) -> None:
    """Refuses prompt + completion budgets beyond the checkpoint's ``max_position_embeddings`` (its config.json).

    Args:
      total: the longest sequence a run will form, in tokens.
      what: the key(s) that set it, for the message (e.g. ``"max_target_length=9000"``).
      cfg: the checkpoint's model (``checkpoint_config``); None: nothing is checked (the load says why).
      source: its config.json, for the message.
    """
    if cfg is None:
        return
    limit = cfg.max_position_embeddings
    if total > limit:
        raise ConfigError(
            f"{what} exceeds the model's max_position_embeddings={limit} ({source}): positions past it were "
            f"never trained; pass at most {limit} tokens"
        )
