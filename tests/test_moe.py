"""Qwen3-MoE, GPT-OSS and Mixtral against transformers (torch, CPU, float32), from the checkpoints' own files.

Each family is a tiny random transformers model saved with ``save_pretrained`` (Qwen3-MoE and Mixtral: one tensor
per expert, the Hub's layout; GPT-OSS: fused, interleaved gate/up experts; Mixtral's window of 16 tokens),
routers scaled so that routing is decisive, GPT-OSS's sinks, biases and norms perturbed and its sliding window
(8 tokens) far shorter than the sequences: logits parity, HF -> native -> HF exact, greedy decoding equal to
``generate`` over 40 tokens, the MXFP4 experts of the Hub's GPT-OSS checkpoint dequantised as transformers
dequantises them, and the registered models' parameter counts on transformers' meta device.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from grpax.checkpoint.convert import SafetensorsSource
from grpax.checkpoint.hf import dequantize_mxfp4, iter_hf_tensors, load_params_from_tensors
from grpax.config import ConfigError
from grpax.models.llama import forward
from grpax.models.registry import from_hf_config, get_model_config, load_hf_config, to_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_BASE = dict(
    vocab_size=101,
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    bos_token_id=96,
    eos_token_id=98,
    pad_token_id=99,
)
_YARN = {
    "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 16, "rope_theta": 150000.0,
}  # fmt: skip
# family -> (config class, model class, config keys)
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=80, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, rope_parameters=_YARN),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, sliding_window=16),
    ),
}  # fmt: skip


def hf_model(family: str, tie: bool = False, **keys):
    """A random tiny transformers model of ``family``: routers x50 (decisive routing: no near-ties for float32
    rounding to flip), projections x5, norms, biases and sinks perturbed so that each is checked."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_BASE, **extra, "tie_word_embeddings": tie, **keys})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias", "sinks")):
                p.add_(0.5 * torch.randn_like(p))
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.mul_(50.0)
            elif "proj" in name:
                p.mul_(5.0)
    return model


def saved(model, folder):
    """``model`` saved as transformers writes it, converted from the folder: (params, cfg, source)."""
    model.save_pretrained(str(folder))
    cfg = load_hf_config(folder)
    source = SafetensorsSource(folder)
    return load_params_from_tensors(source.get_tensor, source.has_tensor, cfg), cfg, source


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


CASES = [(f, scan) for f in FAMILIES for scan in (True, False)]


@pytest.mark.parametrize(
    "family, scan_layers", CASES, ids=[f"{f}-{'scan' if s else 'list'}" for f, s in CASES]
)
def test_logits_match_transformers(tmp_path, family, scan_layers):
    model = hf_model(family)
    params, cfg, _ = saved(model, tmp_path)
    cfg = cfg.replace(scan_layers=scan_layers)
    if not scan_layers:
        source = SafetensorsSource(tmp_path)
        params = load_params_from_tensors(source.get_tensor, source.has_tensor, cfg)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
    ref = hf_logits(model, tokens)
    out = np.asarray(forward(params, tokens, cfg)[0])
    assert cfg.family == family and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert out.shape == ref.shape and np.abs(ref).max() > 0.1
    assert np.abs(out - ref).max() <= 1e-4
    layer = params["layers"] if scan_layers else params["layers"][0]
    assert np.shape(layer["expert_gate"])[-3:] == (8, 48, 24) and np.shape(layer["router"])[-2:] == (48, 8)
    if family == "gpt_oss":
        assert cfg.layer_types == ("local", "global", "local") and cfg.sliding_window == 8 < 40
    if family == "mixtral":
        assert cfg.layer_types == ("local",) * 3 and cfg.sliding_window == 16 < 40


def test_gpt_oss_features_change_the_logits(tmp_path):
    """The tiny GPT-OSS exercises what it claims: without the sinks, the window, YaRN, the SwiGLU clamp, the
    router bias or the expert biases the logits move by far more than the parity tolerance."""
    import jax.numpy as jnp

    params, cfg, _ = saved(hf_model("gpt_oss"), tmp_path)
    tokens = np.random.RandomState(0).randint(0, 101, (1, 40))
    base = np.asarray(forward(params, tokens, cfg)[0])

    def zero(name):
        return {**params, "layers": {**params["layers"], name: jnp.zeros_like(params["layers"][name])}}

    for what, p, c in [
        ("sinks", zero("sinks"), cfg),
        ("router_bias", zero("router_bias"), cfg),
        ("expert_down_bias", zero("expert_down_bias"), cfg),
        ("window", params, cfg.replace(layer_types=(), sliding_window=None)),
        ("yarn", params, cfg.replace(rope_scaling=None)),
        ("swiglu_limit", params, cfg.replace(swiglu_limit=1.0)),
    ]:
        assert np.abs(np.asarray(forward(p, tokens, c)[0]) - base).max() > 1e-2, what


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_native_hf_is_exact(tmp_path, family):
    """The saved tensors come back bit for bit (Qwen3-MoE's per-expert tensors from the stacked experts,
    GPT-OSS's interleaved gate/up), the exported config.json re-imports to the same config, and transformers
    loads the export as the same model."""
    from safetensors.numpy import load_file, save_file

    model = hf_model(family)
    params, cfg, _ = saved(model, tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    back = dict(iter_hf_tensors(params, cfg))
    assert set(back) == set(state)
    for name, w in back.items():
        assert w.dtype == np.float32 and np.array_equal(w, state[name]), name
    assert from_hf_config(to_hf_config(cfg)) == cfg
    (tmp_path / "out").mkdir()
    save_file(
        {k: np.ascontiguousarray(v) for k, v in back.items()}, str(tmp_path / "out" / "model.safetensors")
    )
    (tmp_path / "out" / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    again.config._attn_implementation = "eager"
    tokens = np.random.RandomState(2).randint(0, 101, (1, 30))
    assert type(again) is type(model)
    assert np.array_equal(hf_logits(again, tokens), hf_logits(model, tokens))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(tmp_path, family):
    """40 greedy tokens after prompts of 10 and 6 tokens (GPT-OSS: past its 8-token window) equal transformers'
    ``generate``, layers scanned and listed; the sampler's logprobs are transformers'."""
    from grpax.sampler.engine import generate
    from grpax.sampler.keys import SamplerConfig

    model = hf_model(family)
    model.generation_config.eos_token_id = None  # no stop: all 40 tokens are compared
    params, cfg, source = saved(model, tmp_path)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, 96, n).tolist() for n in (10, 6)]
    sc = SamplerConfig(max_prompt_length=16, max_completion_length=40, greedy=True, pad_token_id=99)
    for scan_layers in (True, False):
        c = cfg.replace(scan_layers=scan_layers)
        p = load_params_from_tensors(source.get_tensor, source.has_tensor, c)
        out = generate(p, prompts, c, sc, jax.random.key(0))
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=99
                )
            assert out.completion_ids[i].tolist() == ref[0, len(prompt) :].tolist(), (scan_layers, i)
            logits = hf_logits(model, ref.numpy())[0, len(prompt) - 1 : -1]
            logp = jax.nn.log_softmax(logits.astype(np.float64), axis=-1)
            chosen = np.asarray(logp)[np.arange(40), out.completion_ids[i]]
            assert np.abs(out.logprobs[i] - chosen).max() <= 1e-4


def _mxfp4_block(rng, shape_out: tuple[int, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made MXFP4 tensors [*shape_out, width / 32, 16] (every code, both nibbles) and scales near 2^0."""
    blocks = rng.randint(0, 256, (*shape_out, width // 32, 16)).astype(np.uint8)
    blocks.reshape(-1)[:256] = np.arange(256)  # every pair of codes at least once
    scales = rng.randint(124, 131, (*shape_out, width // 32)).astype(np.uint8)
    return blocks, scales


def test_mxfp4_dequantisation_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.RandomState(0)
    blocks, scales = _mxfp4_block(rng, (3, 10), 64)  # [E, out, G, 16], [E, out, G]
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 10, 64) and ours.dtype == np.float32
    assert np.array_equal(ours.swapaxes(-1, -2), ref.numpy())  # transformers' [E, in, out]
    assert set(np.unique(np.abs(ours[0, 0, :32] / 2.0 ** (int(scales[0, 0, 0]) - 127)))) <= {
        0,
        0.5,
        1,
        1.5,
        2,
        3,
        4,
        6,
    }


def test_gpt_oss_mxfp4_checkpoint_converts_dequantised(tmp_path):
    """A GPT-OSS folder whose experts are MXFP4 (``*_blocks``, ``*_scales``, the Hub's layout) converts to the
    weights transformers dequantises from it: the logits of the transformers model holding those weights."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = hf_model("gpt_oss", hidden_size=64, intermediate_size=32)  # whole blocks of 32 inputs
    model.save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "model.safetensors"))
    rng = np.random.RandomState(1)
    dense = {}
    for i in range(3):
        p = f"model.layers.{i}.mlp.experts."
        for proj, out_dim, in_dim in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            del state[p + proj]
            state[p + proj + "_blocks"], state[p + proj + "_scales"] = _mxfp4_block(rng, (8, out_dim), in_dim)
            ref = convert_moe_packed_tensors(
                torch.from_numpy(state[p + proj + "_blocks"]), torch.from_numpy(state[p + proj + "_scales"]),
                dtype=torch.float32,
            )  # fmt: skip
            dense[p + proj] = ref
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = load_hf_config(tmp_path)
    source = SafetensorsSource(tmp_path)
    params = load_params_from_tensors(source.get_tensor, source.has_tensor, cfg)
    with torch.no_grad():
        for name, w in dense.items():
            model.get_parameter(name).copy_(w)
    tokens = np.random.RandomState(3).randint(0, 101, (1, 30))
    assert np.abs(np.asarray(forward(params, tokens, cfg)[0]) - hf_logits(model, tokens)).max() <= 1e-4
    fused = np.asarray(dense["model.layers.0.mlp.experts.gate_up_proj"])  # [E, D, 2F]
    assert np.array_equal(np.asarray(params["layers"]["expert_up"][0]), fused[..., 1::2])
    assert np.abs(fused).max() > 1.0  # the hand-made codes, not the random init's small weights


def test_qwen3_moe_with_dense_layers_is_refused():
    keys = {
        **_BASE,
        **FAMILIES["qwen3_moe"][2],
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
    }
    for extra in (dict(decoder_sparse_step=2), dict(mlp_only_layers=[1])):
        with pytest.raises(ConfigError, match="every one of its 3 layers sparse") as e:
            from_hf_config({**keys, **extra})
        assert "\n" not in str(e.value)


# The public config.json of each registered mixture of experts (its architecture keys).
PUBLIC = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
        use_sliding_window=False, sliding_window=None, max_window_layers=48,
    ),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, swiglu_limit=7.0,
        rope_theta=150000, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999,
        quantization_config={"quant_method": "mxfp4"},
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=None,
        router_aux_loss_coef=0.02,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLIC))
def test_registered_moe_shapes_and_counts_match_transformers_on_meta(name):
    hf = PUBLIC[name]
    cfg = get_model_config(name)
    # Qwen3's config.json leaves the pad id out; the registry's is its tokenizer's (<|endoftext|>).
    pad = {} if "pad_token_id" in hf else dict(pad_token_id=cfg.pad_token_id)
    assert from_hf_config(hf, **pad) == cfg
    keys = {
        k: v for k, v in hf.items() if k not in ("architectures", "quantization_config", "experts_per_token")
    }
    config = transformers.AutoConfig.for_model(**keys)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == expected


def test_megablox_weight_gradient_equals_ragged_dots_transpose():
    """The experts' weight gradient on TPU (megablox's ``tgmm``, run here by Pallas's interpreter) equals
    ragged_dot's own transpose (what CPU and GPU use): an empty group, rows past the groups (other experts'
    pairs), rows padded to the kernel's tile (200 -> 256) and an output width that is no multiple of it."""
    import jax.numpy as jnp

    from grpax.models.moe import weight_grad_tgmm

    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (200, 256), jnp.float32)
    dy = jax.random.normal(k[1], (200, 160), jnp.float32)
    sizes = jnp.array([30, 0, 70, 50, 20], jnp.int32)  # 170 rows in the groups
    w = jnp.zeros((5, 256, 160), jnp.float32)
    (expected,) = jax.vjp(lambda v: jax.lax.ragged_dot(x, v, sizes), w)[1](dy)
    got = weight_grad_tgmm(x, dy, sizes, interpret=True)
    assert got.shape == (5, 256, 160) and not np.any(np.asarray(got[1]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4, rtol=1e-5)
    rows = np.asarray(x[:30]).T @ np.asarray(dy[:30])  # group 0 by hand
    np.testing.assert_allclose(np.asarray(got[0]), rows, atol=1e-4, rtol=1e-5)


def test_grouped_matmul_equals_ragged_dot_values_and_grads():
    """``moe._ragged_matmul`` (ragged_dot with its own VJP, the weights' by tgmm on TPU) computes ragged_dot's
    values and both gradients on CPU."""
    import jax.numpy as jnp

    from grpax.models.moe import _ragged_matmul

    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (24, 16), jnp.float32)
    w = jax.random.normal(k[1], (4, 16, 8), jnp.float32)
    dy = jax.random.normal(k[2], (24, 8), jnp.float32)
    sizes = jnp.array([5, 0, 9, 7], jnp.int32)  # 21 of 24 rows
    ours, pull = jax.vjp(lambda a, b: _ragged_matmul(a, b, sizes), x, w)
    theirs, pull_ref = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    for a, b in zip(pull(dy), pull_ref(dy), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-6)
