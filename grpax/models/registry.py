"""Model configurations: the ``model_name`` registry and the Hugging Face ``config.json`` importer/exporter.

The shapes are those of the Hugging Face ``LlamaForCausalLM`` configs published with each model. Any
``LlamaForCausalLM`` config.json is accepted too, in the transformers 4 form (``rope_theta`` +
``rope_scaling``) and the transformers 5 form (``rope_parameters``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from grpax.errors import ConfigError, suggest

# The dtypes a model's parameters (weight_dtype) and activations (dtype) may take.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# Rematerialisation of each layer in the backward pass (grpax.models.llama: jax.checkpoint policies).
REMAT_POLICIES = ("none", "full", "dots", "minimal")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-architecture hyper-parameters (Touvron et al. 2023; Llama 3 herd paper for rope scaling).

    Shape letters: D hidden_dim, N num_heads, K num_kv_heads, H head_dim, F mlp_dim, V vocab_size, L num_layers.
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
    # Llama 3 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, or None for plain RoPE.
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
    remat_policy: str = "none"  # none | full | dots | minimal (jax.checkpoint policies on each layer)
    attention_bias: bool = False

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

    @property
    def rope_scaling_dict(self) -> dict[str, float] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

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
        per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + D


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


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Builds a ``ModelConfig`` from a ``LlamaForCausalLM`` config.json dict (transformers 4 or 5 form).

    Raises:
      ConfigError: for a non-Llama architecture or an unsupported rope type.
    """
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
        raise ConfigError(
            f"config.json describes {archs} (model_type={hf.get('model_type')!r}); "
            "grpax supports LlamaForCausalLM only"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = tuple(
            sorted(
                (k, float(rope[k]))
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            )
        )
    elif rope_type not in ("default", None):
        raise ConfigError(f"config.json rope type {rope_type!r} is not supported (default and llama3 are)")
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
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        attention_bias=bool(hf.get("attention_bias", False)),
    )
    if values["attention_bias"] or hf.get("mlp_bias"):
        raise ConfigError("config.json has attention_bias/mlp_bias=true; grpax supports bias-free Llama only")
    values.update(overrides)
    return ModelConfig(**values)


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """The transformers 4-form ``config.json`` dict for ``cfg`` (loads in transformers 4 and 5, and vLLM)."""
    eos = list(cfg.eos_token_ids)
    scaling = cfg.rope_scaling_dict
    if scaling:
        scaling = {
            "rope_type": "llama3",
            **{k: (int(v) if k == "original_max_position_embeddings" else v) for k, v in scaling.items()},
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": torch_dtype,
    }


def load_hf_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """Reads ``config.json`` (a file or the folder holding it).

    Raises:
      ConfigError: if the file is missing, not JSON, or not a Llama config.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: hf_model_path must be a folder with config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    try:
        return from_hf_config(hf, **overrides)
    except KeyError as e:
        raise ConfigError(
            f"{path} lacks the key {e.args[0]!r} that a LlamaForCausalLM config needs"
        ) from None


ARCH_FIELDS = (
    "vocab_size",
    "hidden_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "tie_word_embeddings",
)


def check_matches(cfg: ModelConfig, model_name: str, source: str) -> None:
    """Raises ConfigError if ``cfg``'s shapes differ from the registered ``model_name``'s."""
    if model_name not in MODELS:
        return
    ref = get_model_config(model_name)
    diffs = [
        f"{f}: {getattr(cfg, f)} vs {getattr(ref, f)}"
        for f in ARCH_FIELDS
        if getattr(cfg, f) != getattr(ref, f)
    ]
    if diffs:
        raise ConfigError(
            f"{source} does not match model_name={model_name} ({'; '.join(diffs)}); "
            "pass the model_name of that checkpoint"
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


def check_context_length(total: int, what: str, checkpoint: str) -> None:
    """Refuses prompt + completion budgets beyond the checkpoint's ``max_position_embeddings`` (its config.json).

    Args:
      total: the longest sequence a run will form, in tokens.
      what: the key(s) that set it, for the message (e.g. ``"max_target_length=9000"``).
      checkpoint: the params folder; without a config.json above it nothing is checked (the load says so).
    """
    config = find_hf_config(checkpoint) if checkpoint else None
    if config is None:
        return
    limit = load_hf_config(config).max_position_embeddings
    if total > limit:
        raise ConfigError(
            f"{what} exceeds the model's max_position_embeddings={limit} ({config}): positions past it were "
            f"never trained; pass at most {limit} tokens"
        )
