"""grpax ``forward`` against transformers ``LlamaForCausalLM`` (torch, CPU, float32) on tiny random configs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from grpax.checkpoint.hf import load_params_from_tensors
from grpax.models.llama import forward
from grpax.models.params import abstract_params
from grpax.models.registry import from_hf_config, get_model_config, to_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# GQA + llama3 rope scaling (original length 32 < sequence 70, so scaling changes the frequencies) +
# head_dim 12 != 48 / 6 + odd vocab + untied; and MHA + tied + plain rope.
CONFIGS = {
    "gqa_untied_llama3": dict(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
    "mha_tied": dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
}


def _hf_model(kwargs: dict):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    # Random init leaves norms at 1; perturb them so the norm weights are checked too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _grpax(model, scan_layers: bool):
    cfg = from_hf_config(model.config.to_dict(), scan_layers=scan_layers)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return load_params_from_tensors(state.__getitem__, state.__contains__, cfg), cfg


def _hf_logits(model, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kwargs = {"attention_mask": torch.tensor(mask)} if mask is not None else {}
        return model(torch.tensor(tokens), **kwargs).logits.numpy()


def _kl(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Per-token KL(ref || out) from logits [..., V]."""
    lp = jax.nn.log_softmax(ref.astype(np.float64), axis=-1)
    lq = jax.nn.log_softmax(out.astype(np.float64), axis=-1)
    return np.asarray(np.sum(np.exp(lp) * (lp - lq), axis=-1))


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, scan_layers):
    model = _hf_model(CONFIGS[name])
    params, cfg = _grpax(model, scan_layers)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 70))
    ref = _hf_logits(model, tokens)
    out = np.asarray(forward(params, tokens, cfg)[0])
    assert out.shape == ref.shape == (2, 70, cfg.vocab_size)
    assert np.abs(out - ref).max() <= 1e-4
    assert _kl(ref, out).max() <= 1e-6
    assert ("lm_head" in params) == (not cfg.tie_word_embeddings)


def test_llama3_scaling_changes_frequencies_at_test_length():
    from grpax.models.llama import rope_inv_freq

    cfg = from_hf_config(CONFIGS["gqa_untied_llama3"])
    plain = np.asarray(rope_inv_freq(cfg.replace(rope_scaling=None)))
    scaled = np.asarray(rope_inv_freq(cfg))
    assert (np.abs(plain - scaled) > 1e-6).sum() >= 2  # low and medium frequencies are rescaled


def test_padding_invariance():
    """Left- and right-padded rows give the logits of the unpadded sequence on their real tokens."""
    model = _hf_model(CONFIGS["gqa_untied_llama3"])
    params, cfg = _grpax(model, scan_layers=True)
    rng = np.random.RandomState(1)
    T, pad = 40, 7
    full = rng.randint(0, cfg.vocab_size, (1, T))
    short = rng.randint(0, cfg.vocab_size, (1, T - pad))
    tokens = np.zeros((3, T), np.int32)
    mask = np.zeros((3, T), np.int32)
    tokens[0], mask[0] = full[0], 1
    tokens[1, pad:], mask[1, pad:] = short[0], 1  # left-padded
    tokens[2, : T - pad], mask[2, : T - pad] = short[0], 1  # right-padded
    out = np.asarray(forward(params, tokens, cfg, attention_mask=mask)[0])
    ref_full = _hf_logits(model, full)[0]
    ref_short = _hf_logits(model, short)[0]
    assert np.abs(out[0] - ref_full).max() <= 1e-4
    assert np.abs(out[1, pad:] - ref_short).max() <= 1e-4
    assert np.abs(out[2, : T - pad] - ref_short).max() <= 1e-4
    assert np.isfinite(out).all()
    # transformers on the same padded batch agrees on the real tokens too.
    hf_padded = _hf_logits(model, tokens, mask)
    assert np.abs(out[1, pad:] - hf_padded[1, pad:]).max() <= 1e-4


def test_rope_config_forms_import_alike():
    common = {
        k: v for k, v in CONFIGS["gqa_untied_llama3"].items() if k not in ("rope_theta", "rope_scaling")
    }
    common.update(architectures=["LlamaForCausalLM"], model_type="llama")
    v4 = dict(common, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    v5 = dict(common, rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    a, b = from_hf_config(v4), from_hf_config(v5)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling_dict == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32.0,
    }
    # The exported 4-form re-imports to the same config, and transformers 5 reads it.
    assert from_hf_config(to_hf_config(a)) == a
    hf = transformers.LlamaConfig(**{k: v for k, v in to_hf_config(a).items() if k != "architectures"})
    assert hf.to_dict()["rope_parameters"]["rope_type"] == "llama3"
    # transformers' own dict (5-form, rope_theta inside rope_parameters) imports the same rope.
    c = from_hf_config(transformers.LlamaConfig(**CONFIGS["gqa_untied_llama3"]).to_dict())
    assert (c.rope_theta, c.rope_scaling, c.head_dim) == (a.rope_theta, a.rope_scaling, 12)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama3.1-8b", 8_030_261_248),
        ("llama3.1-70b", 70_553_706_496),
        ("llama3.2-1b", 1_235_814_400),
        ("llama3.2-3b", 3_212_749_824),
        ("smollm2-135m", 134_515_008),
    ],
)
def test_param_counts(name, expected):
    cfg = get_model_config(name)
    assert sum(x.size for x in jax.tree.leaves(abstract_params(cfg))) == expected
    assert cfg.num_params() == expected
