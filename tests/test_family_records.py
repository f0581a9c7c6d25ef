"""The family records (``grpax.models.families``): one record per family is all the Hugging Face side knows.

Every registered family has its record and nothing else names it; a new family of the Llama pattern added as one
record reads its config.json, runs the same forward as Llama and writes its own names back; a Llama export
carries Llama's keys only (before the records, Gemma's keys leaked into every Llama config.json, among them
``cache_implementation: hybrid``, which made transformers' ``generate`` use Gemma's cache for a Llama).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from grpax.config import ConfigError
from grpax.models import families
from grpax.models.families import BY_MODEL_TYPE, FAMILY_TABLE, Family
from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.models.registry import (
    MODELS,
    ModelConfig,
    from_hf_config,
    get_model_config,
    to_hf_config,
)

_LLAMA_JSON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def test_every_registered_model_reads_back_through_its_record():
    """Each registered model's config.json names its family's record and reads back as the same config; the
    refusal lists every record's architecture."""
    for name in MODELS:
        cfg = get_model_config(name)
        out, record = to_hf_config(cfg), FAMILY_TABLE[cfg.family]
        assert out["architectures"] == [record.architecture] and BY_MODEL_TYPE[out["model_type"]] is record
        assert from_hf_config(out) == cfg, name
    with pytest.raises(ConfigError) as refusal:
        from_hf_config(dict(_LLAMA_JSON, model_type="phi3", architectures=["Phi3ForCausalLM"]))
    assert all(f.architecture in str(refusal.value) for f in FAMILY_TABLE.values())
    assert "text model of Gemma3ForConditionalGeneration" in str(refusal.value)


def test_a_llama_pattern_family_is_one_record(monkeypatch):
    """A new family added as one record: its config.json is read, the forward is Llama's (the same logits for
    the same weights), and the export names it; without the record it is refused in one line."""
    hf = dict(_LLAMA_JSON, model_type="tinyllama_like", architectures=["TinyLlamaLikeForCausalLM"])
    with pytest.raises(ConfigError, match="TinyLlamaLikeForCausalLM.*is not supported"):
        from_hf_config(hf)
    record = Family("tinyllama_like", "TinyLlamaLikeForCausalLM", "tinyllama_like", families._write_llama)
    monkeypatch.setitem(FAMILY_TABLE, record.name, record)
    monkeypatch.setitem(BY_MODEL_TYPE, record.model_type, record)
    cfg = from_hf_config(hf)
    llama = from_hf_config(dict(_LLAMA_JSON, model_type="llama", architectures=["LlamaForCausalLM"]))
    assert cfg.family == "tinyllama_like" and cfg == ModelConfig(
        **{**vars(llama), "family": "tinyllama_like"}
    )
    params = init_params(llama, jax.random.key(0))
    ids = np.array([[3, 4, 5, 6]], np.int32)
    np.testing.assert_array_equal(forward(params, ids, cfg)[0], forward(params, ids, llama)[0])
    out = to_hf_config(cfg)
    assert out["architectures"] == ["TinyLlamaLikeForCausalLM"] and out["model_type"] == "tinyllama_like"
    assert from_hf_config(out) == cfg


def test_refusals_stay_one_line(tmp_path):
    """Every mixture of experts with dense layers among its sparse ones is refused (not Qwen3-MoE's alone), and a
    family that is no name is a ConfigError."""
    for model_type, arch in (("qwen3_moe", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM")):
        hf = dict(_LLAMA_JSON, model_type=model_type, architectures=[arch], num_local_experts=4,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2)  # fmt: skip
        with pytest.raises(ConfigError, match="decoder_sparse_step=2"):
            from_hf_config(hf)
    with pytest.raises(ConfigError, match="family="):
        ModelConfig(**{**vars(from_hf_config(dict(_LLAMA_JSON))), "family": ["llama"]})


def test_a_windowed_llama_reads_back_the_same():
    """A Llama-family config.json that gave sliding windows (none of the published ones do) survives export."""
    hf = dict(_LLAMA_JSON, model_type="llama", architectures=["LlamaForCausalLM"], sliding_window=8,
              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    cfg = from_hf_config(hf)
    assert cfg.sliding_window == 8 and cfg.layer_types == ("local", "global")
    assert from_hf_config(to_hf_config(cfg)) == cfg
    unused = from_hf_config(dict(hf, layer_types=["full_attention"] * 2))  # a window no layer uses
    assert from_hf_config(to_hf_config(unused)) == unused


def test_a_llama_export_carries_llama_keys_only():
    out = to_hf_config(get_model_config("llama3.1-8b-Instruct"))
    gemma_keys = {
        "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
        "layer_types", "cache_implementation", "sliding_window",
    }  # fmt: skip
    assert not gemma_keys & set(out), sorted(gemma_keys & set(out))
    assert out["architectures"] == ["LlamaForCausalLM"] and out["rope_scaling"]["rope_type"] == "llama3"
    transformers = pytest.importorskip("transformers")
    known = set(transformers.LlamaConfig().to_dict())
    # transformers 5 keeps rope_theta / rope_scaling in rope_parameters and torch_dtype as dtype; 4 reads them
    assert set(out) - known <= {"rope_theta", "rope_scaling", "torch_dtype"}, sorted(set(out) - known)
    assert from_hf_config(out) == get_model_config("llama3.1-8b-Instruct")
