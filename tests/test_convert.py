"""HF safetensors -> grpax Orbax -> HF round trips on tiny random Llama models, and conversion errors."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from grpax.checkpoint.convert import to_huggingface, to_native
from grpax.checkpoint.hf import MissingTensorError
from grpax.config import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    rope_theta=500000.0,
    bos_token_id=96,
    eos_token_id=98,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
)
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def save_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over ``w0 .. w94`` plus ChatML specials (ids 95..99), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(95)}
    vocab.update({"<unk>": 95, "<|im_start|>": 96, "<|endoftext|>": 97, "<|im_end|>": 98, "<|eot|>": 99})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def make_hf_model(folder: Path, tie: bool = False, max_shard_size: str | None = None, **overrides):
    """Saves a random tiny ``LlamaForCausalLM`` (safetensors) and tokenizer into ``folder``; returns the model."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**TINY, "tie_word_embeddings": tie, **overrides})
    ).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    save_tiny_tokenizer(folder)
    return model


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def header_dtypes(path: Path) -> set[str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untied")
    model = make_hf_model(folder, tie=False)
    return folder, model


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_round_trip_is_bit_exact(untied, tmp_path, lazy, scan_layers):
    src, _ = untied
    native = to_native(
        "tiny",
        tmp_path / "native",
        hf_model_path=src,
        scan_layers=scan_layers,
        lazy_load_tensors=lazy,
        progress=False,
    )
    assert Path(native["params_path"]) == tmp_path / "native" / "0" / "items"
    assert native["num_params"] == sum(v.size for v in read_tensors(src).values())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {Path(p).name for p in native["tokenizer_files"]}
    to_huggingface(native["params_path"], tmp_path / "hf", weight_dtype="float32", progress=False)
    a, b = read_tensors(src), read_tensors(tmp_path / "hf")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32
        assert np.array_equal(a[name], b[name]), name
    # Q and K carry the rotary layout: compare them on their own so a permutation bug names them.
    for i in range(3):
        for proj in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            assert np.array_equal(a[key], b[key]), key
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (
        cfg["rope_scaling"]["rope_type"] == "llama3"
        and cfg["rope_scaling"]["original_max_position_embeddings"] == 32
    )
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float32"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (96, 98)


def test_native_folder_layout_and_staging_cleanup(untied, tmp_path):
    src, _ = untied
    to_native("tiny", tmp_path / "out", hf_model_path=src, weight_dtype="bfloat16", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"0", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(FileExistsError, match="already holds"):
        to_native("tiny", tmp_path / "out", hf_model_path=src, progress=False)


def test_interrupted_conversion_leaves_nothing(untied, tmp_path, monkeypatch):
    import grpax.checkpoint.convert as convert

    src, _ = untied

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "save_params", boom)
    with pytest.raises(KeyboardInterrupt):
        to_native("tiny", tmp_path / "out", hf_model_path=src, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bf16_export_and_transformers_load(untied, tmp_path):
    src, model = untied
    native = to_native("tiny", tmp_path / "native", hf_model_path=src, progress=False)
    to_huggingface(native["params_path"], tmp_path / "bf16", progress=False)  # default bfloat16
    out = tmp_path / "bf16"
    assert header_dtypes(out / "model.safetensors") == {"BF16"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 96 and gen["eos_token_id"] == [98, 97]  # config eos, tokenizer eos
    ref = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref[k]), k
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "w3 w4"}], tokenize=False) == (
        "<|im_start|>w3 w4<|im_end|>"
    )


def test_float32_export_gives_same_logits(untied, tmp_path):
    src, model = untied
    native = to_native("tiny", tmp_path / "native", hf_model_path=src, scan_layers=False, progress=False)
    to_huggingface(native["params_path"], tmp_path / "hf", weight_dtype="float32", progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.tensor(np.random.RandomState(0).randint(0, 101, (2, 20)))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_sharded_source_and_sharded_export(tmp_path):
    src = tmp_path / "src"
    make_hf_model(src, tie=True, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").exists()
    native = to_native("tiny", tmp_path / "native", hf_model_path=src, progress=False)
    summary = to_huggingface(
        native["params_path"], tmp_path / "hf", weight_dtype="float32", max_shard_size=50_000, progress=False
    )
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == len(summary["safetensors"]) > 2
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in read_tensors(out).values())
    a, b = read_tensors(src), read_tensors(out)
    assert "lm_head.weight" not in b  # tied: only the embedding is stored
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.config.tie_word_embeddings


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="hf_model_path=.*nope"):
        to_native("tiny", tmp_path / "out", hf_model_path=tmp_path / "nope", progress=False)


def test_corrupt_safetensors(tmp_path):
    src = tmp_path / "src"
    make_hf_model(src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file"):
        to_native("tiny", tmp_path / "out", hf_model_path=src, progress=False)
    assert not (tmp_path / "out").exists()


def test_config_mismatch_names_model(untied, tmp_path):
    src, _ = untied
    with pytest.raises(
        ConfigError, match="does not match model_name=smollm2-135m .*vocab_size: 101 vs 49152"
    ):
        to_native("smollm2-135m", tmp_path / "out", hf_model_path=src, progress=False)


def _drop_tensor(src: Path, dst: Path, name: str) -> None:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in read_tensors(src).items() if k != name}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(untied, tmp_path):
    src, _ = untied
    _drop_tensor(src, tmp_path / "src", "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.weight"):
        to_native("tiny", tmp_path / "out", hf_model_path=tmp_path / "src", progress=False)


def test_untied_model_without_lm_head(untied, tmp_path):
    src, _ = untied
    _drop_tensor(src, tmp_path / "src", "lm_head.weight")
    with pytest.raises(MissingTensorError, match="lm_head.weight.*tie_word_embeddings=false"):
        to_native(
            "tiny", tmp_path / "out", hf_model_path=tmp_path / "src", lazy_load_tensors=False, progress=False
        )


def test_export_of_untied_checkpoint_without_lm_head(untied, tmp_path):
    from grpax.checkpoint.orbax import restore_params, save_params

    src, _ = untied
    native = to_native("tiny", tmp_path / "native", hf_model_path=src, progress=False)
    params = restore_params(native["params_path"])
    del params["lm_head"]
    save_params(params, tmp_path / "native" / "1" / "items")
    with pytest.raises(MissingTensorError, match="'lm_head' is missing.*tie_word_embeddings=false"):
        to_huggingface(tmp_path / "native" / "1" / "items", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_offline_hub_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty cache
    start = time.monotonic()
    with pytest.raises(ConfigError, match="hf_model_path"):
        to_native("smollm2-135m", tmp_path / "out", progress=False)
    assert time.monotonic() - start < 5


def test_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="hf_model_path"):
        to_native("smollm2-135m", tmp_path / "out", progress=False)
    assert time.monotonic() - start < 5


def test_multimodal_not_supported(untied, tmp_path):
    src, _ = untied
    with pytest.raises(ConfigError, match="use_multimodal=true is not supported"):
        to_native("tiny", tmp_path / "out", hf_model_path=src, use_multimodal=True, progress=False)


def test_bad_weight_dtype(untied, tmp_path):
    src, _ = untied
    with pytest.raises(ConfigError, match="weight_dtype='int8'"):
        to_native("tiny", tmp_path / "out", hf_model_path=src, weight_dtype="int8", progress=False)


def test_pread_reader_matches_safetensors(tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    from grpax.checkpoint.safetensors_io import SafetensorsFile

    rng = np.random.RandomState(0)
    tensors = {
        "a": rng.randn(3, 5).astype(np.float32),
        "b": rng.randn(7).astype(ml_dtypes.bfloat16),
        "c": np.arange(6, dtype=np.int64).reshape(2, 3),
        "d": np.zeros((0, 4), np.float16),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"format": "pt"} and sorted(f.keys()) == ["a", "b", "c", "d"]
    with safe_open(str(tmp_path / "x.safetensors"), "np") as ref:
        for name in tensors:
            got = f.get_tensor(name)
            assert got.dtype == ref.get_tensor(name).dtype and np.array_equal(got, ref.get_tensor(name)), name
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match="short.safetensors is not a valid safetensors file .*truncated"):
        SafetensorsFile(tmp_path / "short.safetensors")


@pytest.mark.parametrize("zarr3, ocdbt", [(True, True), (False, False)])
def test_lazy_conversion_streams_leaf_by_leaf(untied, tmp_path, monkeypatch, zarr3, ocdbt):
    """The lazy write reads each stacked leaf's tensors together, frees it before the next (STREAM_BYTES=0: one
    leaf at a time), and restores bit-exact."""
    import weakref

    import jax
    import orbax.checkpoint as ocp

    import grpax.checkpoint.convert as convert
    import grpax.checkpoint.orbax as orbax_lib
    from grpax.checkpoint.orbax import LazyArray, restore_params

    monkeypatch.setattr(orbax_lib, "STREAM_BYTES", 0)

    src, _ = untied
    reads: list[str] = []
    original_get = convert.SafetensorsSource.get_tensor
    monkeypatch.setattr(
        convert.SafetensorsSource,
        "get_tensor",
        lambda self, name: reads.append(name) or original_get(self, name),
    )
    live, peak, built = [0], [0], []
    original_lazy = convert.lazy_params

    def counting_lazy_params(*args, **kwargs):
        def wrap(leaf: LazyArray) -> LazyArray:
            def build():
                out = leaf.build()
                live[0] += 1
                peak[0] = max(peak[0], live[0])
                built.append(out.shape)
                weakref.finalize(out, lambda: live.__setitem__(0, live[0] - 1))
                return out

            return LazyArray(leaf.shape, leaf.dtype, build)

        return jax.tree.map(wrap, original_lazy(*args, **kwargs))

    monkeypatch.setattr(convert, "lazy_params", counting_lazy_params)
    kwargs = dict(
        hf_model_path=src, weight_dtype="bfloat16", use_zarr3=zarr3, use_ocdbt=ocdbt, progress=False
    )
    lazy = to_native("tiny", tmp_path / "lazy", **kwargs)
    assert lazy["bytes_read"] == sum(v.nbytes for v in read_tensors(src).values())
    assert len(built) == 3 + 9 and (3, 48, 6, 12) in built  # embed, final_norm, lm_head + 9 stacked [L, ...]
    assert peak[0] == 1 and live[0] == 0
    # Reads are grouped by output leaf: the three layers of q_proj back to back.
    q = [i for i, name in enumerate(reads) if "q_proj" in name]
    assert q == list(range(q[0], q[0] + 3))
    eager = to_native("tiny", tmp_path / "eager", lazy_load_tensors=False, **kwargs)
    a = restore_params(lazy["params_path"])
    b = ocp.PyTreeCheckpointer().restore(eager["params_path"])
    assert sorted(a) == sorted(b) == ["embed", "final_norm", "layers", "lm_head"]
    pairs = [(a[k], b[k]) for k in ("embed", "final_norm", "lm_head")]
    pairs += [(a["layers"][k], b["layers"][k]) for k in b["layers"]]
    assert len(pairs) == 12 and sorted(a["layers"]) == sorted(b["layers"])
    for x, y in pairs:
        assert x.dtype == y.dtype == np.dtype("bfloat16") and np.array_equal(x, y)


def test_lazy_conversion_checks_shapes_before_writing(untied, tmp_path):
    src, _ = untied
    (tmp_path / "src").mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / "src" / f.name).write_bytes(f.read_bytes())
    tensors = read_tensors(src)
    tensors["model.layers.2.mlp.down_proj.weight"] = tensors["model.layers.2.mlp.down_proj.weight"][:, :40]
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model.layers.2.mlp.down_proj.weight.*\(48, 40\), expected .*\(80, 48\)"
    ):
        to_native("tiny", tmp_path / "out", hf_model_path=tmp_path / "src", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("max_shard_size", [None, 20_000], ids=["one-file", "sharded"])
def test_exported_weights_get_an_ordinary_files_mode(untied, tmp_path, umask, max_shard_size):
    """model.safetensors was written 0600 while every other file got 0644 (the umask's mode)."""
    import os

    src, _ = untied
    native = to_native("tiny", tmp_path / "native", hf_model_path=src, progress=False)
    old = os.umask(umask)
    try:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        to_huggingface(native["params_path"], tmp_path / "hf", progress=False, **kwargs)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    written = {name: mode for name, mode in modes.items() if "safetensors" in name or name == "config.json"}
    assert len(written) >= 2 and set(written.values()) == {0o666 & ~umask}, modes
    if umask == 0o022:  # the tokenizer files are copied with their source's mode (0644 here)
        assert set(modes.values()) == {0o644}, modes
