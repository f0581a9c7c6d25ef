"""Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 (text) and Mistral against transformers (torch, CPU, float32).

Each family is a tiny random model built with transformers' own config and ``*ForCausalLM`` class, tied and
untied, with GQA, head_dim != hidden / heads, Qwen2's biases, Gemma 2's soft-capping, and sequences longer than
the sliding window: logits parity, HF -> native -> HF bit-exact, left-padding invariance, the CPU backend's
fallback, and the parameter counts of the registered names on transformers' meta device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.checkpoint.hf import iter_hf_tensors, load_params_from_tensors
from grpax.config import ConfigError
from grpax.models.llama import forward, forward_grouped, logits_from_hidden
from grpax.models.params import abstract_params
from grpax.models.registry import (
    ARCH_FIELDS,
    check_matches,
    from_hf_config,
    get_model_config,
    load_hf_config,
    to_hf_config,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_BASE = dict(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,  # != 48 / 6
    max_position_embeddings=512,
    bos_token_id=96,
    eos_token_id=98,
    pad_token_id=99,
)
_GEMMA = dict(num_attention_heads=4, head_dim=16)  # 48 / 4 = 12 != 16
# family -> (config class, model class, config overrides). Windows of 8-16 tokens against 70-token sequences.
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(_GEMMA, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=0.5, final_logit_softcapping=1.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _GEMMA,
            num_hidden_layers=6,  # 5 local : 1 global
            sliding_window=8,
            query_pre_attn_scalar=16,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),
}  # fmt: skip


def hf_model(family: str, tie: bool):
    """A random tiny transformers model of ``family``; norms and biases perturbed (so they are checked) and
    projections scaled x5 (so the scores reach Gemma 2's soft caps)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_BASE, **extra, "tie_word_embeddings": tie})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "proj" in name:
                p.mul_(5.0)
    return model


def to_grpax(model, scan_layers: bool = True):
    cfg = from_hf_config(model.config.to_dict(), scan_layers=scan_layers)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return load_params_from_tensors(state.__getitem__, state.__contains__, cfg), cfg


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Per-token KL(ref || out) of logits [..., V], in float64."""
    lp, lq = _log_softmax(ref), _log_softmax(out)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


CASES = [(f, tie) for f in FAMILIES for tie in (False, True)]


@pytest.mark.parametrize("family, tie", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_logits_match_transformers(family, tie):
    model = hf_model(family, tie)
    params, cfg = to_grpax(model, scan_layers=not tie)  # scanned and unrolled layers both covered
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 70))
    ref = hf_logits(model, tokens)
    out = np.asarray(forward(params, tokens, cfg)[0])
    assert out.shape == ref.shape == (2, 70, cfg.vocab_size)
    assert np.abs(out - ref).max() <= 1e-4
    assert kl(ref, out).max() <= 1e-6
    assert ("lm_head" in params) == (not tie) and cfg.family == family
    if family in ("qwen2", "mistral", "gemma2", "gemma3"):
        assert "local" in cfg.layer_types and 70 > cfg.sliding_window


def test_family_features_change_the_logits():
    """The tiny configs exercise what they claim: without the window, the soft caps, Gemma 3's local RoPE
    base or Qwen2's biases the logits move by far more than the parity tolerance."""
    tokens = np.random.RandomState(0).randint(0, 101, (1, 70))
    for family, change in [
        ("gemma2", dict(layer_types=(), sliding_window=None)),
        ("gemma2", dict(attn_logit_softcap=None)),
        ("gemma2", dict(final_logit_softcap=None)),
        ("gemma3", dict(rope_local_theta=None)),
        ("mistral", dict(layer_types=(), sliding_window=None)),
    ]:
        params, cfg = to_grpax(hf_model(family, tie=False))
        base = np.asarray(forward(params, tokens, cfg)[0])
        other = np.asarray(forward(params, tokens, cfg.replace(**change))[0])
        assert np.abs(base - other).max() > 1e-2, (family, change)
    params, cfg = to_grpax(hf_model("qwen2", tie=False))
    no_bias = jax.tree.map(jnp.zeros_like, params["layers"]["q_bias"])
    other = forward({**params, "layers": {**params["layers"], "q_bias": no_bias}}, tokens, cfg)[0]
    assert np.abs(np.asarray(forward(params, tokens, cfg)[0]) - np.asarray(other)).max() > 1e-2


@pytest.mark.parametrize("family, tie", CASES[::3], ids=[f for f, _ in CASES[::3]])
def test_hf_native_hf_is_bit_exact(family, tie):
    model = hf_model(family, tie)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for scan_layers in (True, False):
        params, cfg = to_grpax(model, scan_layers)
        back = dict(iter_hf_tensors(params, cfg))
        expected = {k for k in state if not (tie and k == "lm_head.weight")}
        assert set(back) == expected
        for name, w in back.items():
            assert w.dtype == np.float32 and np.array_equal(w, state[name]), name
    # The exported config.json re-imports to the same config, and transformers builds the same model from it.
    assert from_hf_config(to_hf_config(cfg), scan_layers=False) == cfg
    exported = transformers.AutoConfig.for_model(**to_hf_config(cfg, "float32"))
    again = type(model)(exported).eval()
    again.load_state_dict(model.state_dict())
    tokens = np.random.RandomState(2).randint(0, 101, (1, 40))
    assert np.array_equal(hf_logits(again, tokens), hf_logits(model, tokens))


def _logprobs(params, cfg, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    logits = forward(params, tokens, cfg, attention_mask=mask)[0]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return np.asarray(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])


# gemma2 (window, soft caps) in the fast suite; the other families with -m slow.
@pytest.mark.parametrize(
    "family", [f if f == "gemma2" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_left_padding_invariance(family):
    """A 40-token sequence scored after 0, 7 and 300 pad tokens gives the same log-probabilities."""
    params, cfg = to_grpax(hf_model(family, tie=False))
    seq = np.random.RandomState(3).randint(0, 99, 40)
    got = []
    for pad in (0, 7, 300):
        tokens = np.concatenate([np.full(pad, 99), seq])[None]
        mask = (np.arange(pad + 40) >= pad).astype(np.int32)[None]
        got.append(_logprobs(params, cfg, tokens, mask)[0, pad:])
    ref = np.asarray(jax.nn.log_softmax(hf_logits(hf_model(family, tie=False), seq[None])[0, :-1], axis=-1))
    ref = ref[np.arange(39), seq[1:]]
    for lp in got:
        assert np.abs(lp - got[0]).max() <= 1e-5
        assert np.abs(lp - ref).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen2"])
def test_grouped_forward_equals_forward(family):
    """The trainer's shared-prompt forward scores completions as ``forward`` on prompt + completion, the
    window counted in positions across the prompt/completion seam."""
    params, cfg = to_grpax(hf_model(family, tie=False))
    rng = np.random.RandomState(4)
    P, C, G = 12, 20, 2
    prompt_ids = np.full((2, P), 99, np.int32)
    prompt_mask = np.zeros((2, P), np.int32)
    for i, n in enumerate((12, 5)):  # one full prompt, one left-padded
        prompt_ids[i, P - n :], prompt_mask[i, P - n :] = rng.randint(0, 99, n), 1
    completions = rng.randint(0, 99, (2 * G, C)).astype(np.int32)
    hidden = forward_grouped(params, prompt_ids, prompt_mask, completions, cfg)
    grouped = np.asarray(logits_from_hidden(params, hidden, cfg))
    rows = np.repeat(prompt_ids, G, 0), np.repeat(prompt_mask, G, 0)
    tokens = np.concatenate([rows[0], completions], 1)
    mask = np.concatenate([rows[1], np.ones_like(completions)], 1)
    full = np.asarray(forward(params, tokens, cfg, attention_mask=mask)[0])[:, P - 1 : -1]
    assert np.abs(grouped - full).max() <= 1e-4


def test_cpu_backend_is_for_llama_only():
    from grpax.sampler.backend import XlaBackend, select_backend

    params, cfg = to_grpax(hf_model("qwen3", tie=True))
    assert isinstance(select_backend("auto", params, cfg), XlaBackend)
    with pytest.raises(ValueError, match="backend='cpu' runs Llama-family models only; this is a qwen3"):
        select_backend("cpu", params, cfg)


# The public config.json of each registered name (its architecture keys; Gemma 3 4b/12b: the text_config of
# Gemma3ForConditionalGeneration, the keys it leaves out at Gemma3TextConfig's defaults).
_QWEN = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, head_dim=128)
PUBLIC = {
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", dict(_QWEN, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=131072, eos_token_id=151643)),
    "qwen2.5-7b": ("Qwen2ForCausalLM", dict(_QWEN, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=131072, eos_token_id=151643)),
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(_QWEN, vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=40960, eos_token_id=151645)),
    "qwen3-4b": ("Qwen3ForCausalLM", dict(_QWEN, vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=40960, eos_token_id=151645)),
    "qwen3-8b": ("Qwen3ForCausalLM", dict(_QWEN, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=40960, eos_token_id=151645)),
    "qwen3-14b": ("Qwen3ForCausalLM", dict(_QWEN, vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=40960, eos_token_id=151645)),
    "gemma2-2b": ("Gemma2ForCausalLM", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", eos_token_id=1)),
    "gemma2-9b": ("Gemma2ForCausalLM", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", eos_token_id=1)),
    "gemma3-1b": ("Gemma3ForCausalLM", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, max_position_embeddings=32768, eos_token_id=1)),
    "gemma3-4b": ("Gemma3ForConditionalGeneration", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)),
    "gemma3-12b": ("Gemma3ForConditionalGeneration", dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)),
    "mistral-7b": ("MistralForCausalLM", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, sliding_window=None, max_position_embeddings=32768, bos_token_id=1, eos_token_id=2)),
}  # fmt: skip
_MODEL_TYPES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MistralForCausalLM": "mistral",
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_registered_shapes_and_counts_match_transformers_on_meta(name):
    arch, keys = PUBLIC[name]
    if arch == "Gemma3ForConditionalGeneration":
        hf = dict(architectures=[arch], model_type="gemma3", eos_token_id=[1, 106], text_config=keys)
        text = transformers.Gemma3TextConfig(**keys)
    else:
        hf = dict(keys, architectures=[arch], model_type=_MODEL_TYPES[arch])
        text = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    cfg = get_model_config(name)
    imported = from_hf_config(hf)
    for field in (
        *ARCH_FIELDS,
        "rope_theta",
        "rope_scaling",
        "rope_local_theta",
        "sliding_window",
        "layer_types",
    ):
        assert getattr(imported, field) == getattr(cfg, field), field
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text)
    expected = sum(p.numel() for p in model.parameters())
    assert sum(x.size for x in jax.tree.leaves(abstract_params(cfg))) == cfg.num_params() == expected


def test_unsupported_architectures_are_one_line_errors(tmp_path):
    for arch, model_type in [
        ("DeepseekV3ForCausalLM", "deepseek_v3"),
        ("LlavaForConditionalGeneration", "llava"),
    ]:
        with pytest.raises(ConfigError, match="grpax supports LlamaForCausalLM, MistralForCausalLM") as e:
            from_hf_config(dict(PUBLIC["qwen3-8b"][1], architectures=[arch], model_type=model_type))
        assert "\n" not in str(e.value) and arch in str(e.value)
    # Read from a folder (as to_native reads hf_model_path), the error names the file; transformers' own
    # save_pretrained writes no ``architectures`` for a bare config, so the message names the model_type.
    folder = tmp_path / "phi"
    transformers.PhiConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(folder)
    with pytest.raises(ConfigError) as e:
        load_hf_config(folder)
    message = str(e.value)
    assert message.startswith(f"{folder / 'config.json'}: ") and "model_type='phi'" in message, message
    assert "'?'" not in message and "grpax supports LlamaForCausalLM" in message, message
    with pytest.raises(ConfigError, match="^config.json: rope type 'longrope' is not supported"):
        from_hf_config(
            dict(PUBLIC["qwen3-8b"][1], architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                 rope_scaling={"rope_type": "longrope", "factor": 4.0})
        )  # fmt: skip


def test_weights_that_do_not_match_config_json_name_the_file(tmp_path, capsys):
    """A config.json edited after save_pretrained (head_dim 16 -> 8): the error names the tensor, both shapes
    and config.json as the thing to fix (there is no model_name to blame)."""
    from grpax.cli.main import main

    hf_model("qwen3", tie=True).save_pretrained(tmp_path / "src")
    config = tmp_path / "src" / "config.json"
    config.write_text(config.read_text().replace('"head_dim": 16', '"head_dim": 8'))
    assert (
        main(["to_native", f"hf_model_path={tmp_path / 'src'}", f"base_output_directory={tmp_path / 'out'}"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tensor 'model.layers.0.self_attn.q_proj.weight' has shape (64, 48)" in err, err
    assert "config.json (or model_name) does not describe these weights" in err, err


def test_a_mismatched_model_name_names_the_fix():
    """train_rl's default model_name (smollm2-135m-Instruct) against a converted Qwen3 checkpoint: the error
    names the fix, model_name='' (the checkpoint's own config.json) or the checkpoint's registered name."""
    tiny = from_hf_config(hf_model("qwen3", tie=True).config.to_dict())
    with pytest.raises(ConfigError) as e:
        check_matches(tiny, "smollm2-135m-Instruct", "ckpt/config.json")
    message = str(e.value)
    assert "family: qwen3 vs llama" in message, message
    assert message.endswith("; pass model_name='' to use the checkpoint's own config.json"), message
    with pytest.raises(ConfigError) as e:
        check_matches(get_model_config("qwen3-0.6b"), "qwen3-4b", "ckpt/config.json")
    assert "pass model_name=qwen3-0.6b (its registered name) or model_name=''" in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers_across_the_window(family):
    """48 greedy tokens after prompts of 10 and 6 tokens, past every sliding window (8-16 tokens), equal
    transformers' ``generate``: the sampler's prefill and decode keep to each local layer's window (on a
    full-length cache, masked)."""
    from grpax.sampler.engine import generate
    from grpax.sampler.keys import SamplerConfig

    model = hf_model(family, tie=False)
    model.generation_config.eos_token_id = None  # no stop: all 48 tokens are compared
    params, cfg = to_grpax(model, scan_layers=False)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, 96, n).tolist() for n in (10, 6)]
    sc = SamplerConfig(max_prompt_length=16, max_completion_length=48, greedy=True, pad_token_id=99)
    out = generate(params, prompts, cfg, sc, jax.random.key(0))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, pad_token_id=99)
        assert out.completion_ids[i].tolist() == ref[0, len(prompt) :].tolist(), i
        assert out.lengths[i] == 48
        # The sampler's logprobs are those of transformers' (soft-capped, for Gemma 2) logits.
        logp = _log_softmax(hf_logits(model, ref.numpy())[0, len(prompt) - 1 : -1])
        assert np.abs(out.logprobs[i] - logp[np.arange(48), out.completion_ids[i]]).max() <= 1e-4


def _write_qwen_gguf(path, model) -> None:
    """Writes a transformers Qwen2/Qwen3 model as llama.cpp's converter does (F32, llama.cpp names, Q/K rows as
    stored: Qwen runs on llama.cpp's NeoX rope, so its converter does not permute them)."""
    import gguf

    c = model.config
    arch = c.model_type
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
    }
    names |= {"mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.o_proj": "attn_output"}
    names |= {f"self_attn.{x}_proj": f"attn_{x}" for x in "qkv"} | {
        f"self_attn.{x}_norm": f"attn_{x}_norm" for x in "qk"
    }
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = "output.weight"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name not in top:
            _, _, i, *module, leaf = name.split(".")
            name = f"blk.{i}.{names['.'.join(module)]}.{leaf}"
        w.add_tensor(top.get(name, name), np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family, tie", [("qwen2", False), ("qwen3", True)])
def test_qwen_gguf_imports_exactly(tmp_path, family, tie):
    """A tiny Qwen2 (biases) / Qwen3 (q/k norms) written with gguf's GGUFWriter reads back as the same tensors
    and the same logits as the transformers model."""
    from grpax.checkpoint.gguf import read_gguf

    model = hf_model(family, tie)
    model.config.use_sliding_window, model.config.sliding_window = False, None  # GGUF metadata has no window
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    _write_qwen_gguf(tmp_path / "tiny.gguf", model)
    source = read_gguf(tmp_path / "tiny.gguf")
    cfg = from_hf_config(source.hf_config)
    expected = from_hf_config(model.config.to_dict())
    assert cfg.replace(bos_token_id=96, eos_token_ids=(98,), pad_token_id=99) == expected
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for name in source.tensor_names:
        assert np.array_equal(source.get_tensor(name), state[name]), name
    params = load_params_from_tensors(source.get_tensor, source.has_tensor, cfg)
    tokens = np.random.RandomState(6).randint(0, 101, (1, 30))
    model = type(model)(model.config).eval()  # the window change applies to a freshly built model
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    assert np.abs(np.asarray(forward(params, tokens, cfg)[0]) - hf_logits(model, tokens)).max() <= 1e-4


def _save_tokenizer(folder, end_of_turn: str) -> str:
    """A word-level tokenizer over w0..w94 plus <unk> <bos> <eos> ``end_of_turn`` <pad> <x> (ids 95..100), with
    a chat template; returns the template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(95)}
    vocab |= {"<unk>": 95, "<bos>": 96, "<eos>": 97, end_of_turn: 98, "<pad>": 99, "<x>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}" + end_of_turn + "{% endfor %}"
    fast.save_pretrained(str(folder))
    return fast.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("family, end_of_turn", [("gemma3", "<end_of_turn>"), ("qwen2", "<|im_end|>")])
def test_export_round_trip_generation_config_and_bfloat16(tmp_path, family, end_of_turn):
    """HF folder -> to_native -> to_huggingface: float32 tensors bit-exact, bfloat16 export equal to torch's
    rounding, the same logits in transformers, the chat template kept and every end-of-turn id in
    generation_config.json."""
    import json

    from safetensors.numpy import load_file

    from grpax.checkpoint.convert import to_huggingface, to_native

    model = hf_model(family, tie=True)
    model.config.eos_token_id = 97
    model.save_pretrained(str(tmp_path / "src"))
    template = _save_tokenizer(tmp_path / "src", end_of_turn)
    native = to_native("", tmp_path / "native", hf_model_path=tmp_path / "src", progress=False)
    source = load_file(str(tmp_path / "src" / "model.safetensors"))
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"hf_{dtype}"
        to_huggingface(native["params_path"], out, weight_dtype=dtype, progress=False)
        got = {}
        for f in out.glob("*.safetensors"):
            got |= load_file(str(f))
        assert sorted(got) == sorted(source)
        for name, w in source.items():
            ref = w if dtype == "float32" else torch.from_numpy(w).to(torch.bfloat16).float().numpy()
            assert np.array_equal(np.asarray(got[name], np.float32), ref), (dtype, name)
    gen = json.loads((tmp_path / "hf_float32" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [97, 98]  # the config's <eos> and the tokenizer's end-of-turn token
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf_float32"))
    assert reloaded.chat_template == template and reloaded.convert_tokens_to_ids(end_of_turn) == 98
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_float32")).eval()
    assert type(again) is type(model)
    tokens = np.random.RandomState(7).randint(0, 101, (1, 40))
    assert np.array_equal(hf_logits(again, tokens), hf_logits(model, tokens))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_grpo_step_scores_capped_logits_and_changes_every_weight(family):
    """One GRPO update on a tiny Qwen3 / Gemma 2: the trainer's logprobs are transformers' (soft-capped)
    ones, the update is finite, changes every weight and raises the positive-advantage completions."""
    from grpax.rl.config import GRPOConfig
    from grpax.rl.optim import make_lr_schedule, make_optimizer
    from grpax.rl.train_step import TrainState, compute_logprobs, make_train_step

    model = hf_model(family, tie=False)
    params, cfg = to_grpax(model)
    rng = np.random.RandomState(8)
    P, C = 6, 12  # 18 tokens: past gemma2's 8-token window
    prompt_mask = (np.arange(P)[None] >= np.array([[0], [2]])).astype(np.int32)
    batch = {
        "prompt_ids": (rng.randint(1, 99, (2, P)) * prompt_mask).astype(np.int32),
        "prompt_mask": prompt_mask,
        "completion_ids": rng.randint(1, 99, (4, C)).astype(np.int32),
        "completion_mask": np.ones((4, C), np.int32),
        "advantages": np.array([1.0, -1.0, -1.0, 1.0], np.float32),
    }
    old = np.asarray(compute_logprobs(params, batch, cfg, 1.0, 1))
    for b in range(4):
        prompt = batch["prompt_ids"][b // 2][prompt_mask[b // 2] == 1]
        seq = np.concatenate([prompt, batch["completion_ids"][b]])
        logp = _log_softmax(hf_logits(model, seq[None])[0, len(prompt) - 1 : -1])
        assert np.abs(old[b] - logp[np.arange(C), batch["completion_ids"][b]]).max() <= 1e-4
    batch["old_logprobs"] = old
    grpo = GRPOConfig(num_generations=2, beta=0.0, temperature=1.0, max_grad_norm=0.0, weight_decay=0.0)
    schedule = make_lr_schedule(1e-3, 1, schedule="constant")
    optimizer = make_optimizer(schedule, 1, weight_decay=0.0)
    step = make_train_step(cfg, grpo, optimizer, num_micro_batches=1)
    start = jax.tree.map(np.array, params)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    state, metrics = step(state, batch)
    assert not bool(metrics["nonfinite"]) and np.isfinite(float(metrics["loss"]))
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), state.params, start)
    assert all(jax.tree.leaves(changed)), changed
    delta = (np.asarray(compute_logprobs(state.params, batch, cfg, 1.0, 1)) - old).sum(1)
    assert (delta[batch["advantages"] > 0] > 0).all() and (delta[batch["advantages"] < 0] < 0).all()


@pytest.mark.slow
def test_gemma3_conditional_generation_converts_its_text_model(tmp_path):
    """A tiny Gemma3ForConditionalGeneration folder: to_native reads its text_config and text model (the vision
    tower left out), with the same text logits and the top level's eos ids; the export is a Gemma3ForCausalLM."""
    import json

    from grpax.checkpoint.convert import to_huggingface, to_native
    from grpax.checkpoint.orbax import restore_params

    text = dict(_BASE, **FAMILIES["gemma3"][2])
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28
    )
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**text),
        vision_config=transformers.SiglipVisionConfig(**vision, patch_size=14), mm_tokens_per_image=4, image_token_index=100,
        boi_token_index=97, eoi_token_index=98, eos_token_id=[98, 97],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(str(tmp_path / "src"))
    native = to_native("", tmp_path / "native", hf_model_path=tmp_path / "src", progress=False)
    cfg = from_hf_config(json.loads((tmp_path / "native" / "config.json").read_text()))
    assert cfg.family == "gemma3" and cfg.eos_token_ids == (98, 97) and cfg.layer_types[-1] == "global"
    params = restore_params(native["params_path"], cfg)
    tokens = np.random.RandomState(9).randint(0, 96, (1, 40))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.abs(np.asarray(forward(params, tokens, cfg)[0]) - ref).max() <= 1e-4
    to_huggingface(native["params_path"], tmp_path / "hf", weight_dtype="float32", progress=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    assert np.abs(hf_logits(exported, tokens) - ref).max() <= 1e-5
