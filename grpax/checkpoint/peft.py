"""LoRA training checkpoints on export: the merged model, or a PEFT adapter folder.

A LoRA run's ``actor/<step>/model_params`` holds only the adapters (``grpax.models.lora``); its ``train_meta``
names the base (``lora.base_path``) and fingerprints it (``grpax.checkpoint.digests.fingerprint``). ``load_lora_step``
reads both and refuses other base weights; ``save_peft`` writes what ``peft.PeftModel.from_pretrained(base,
folder)`` and vLLM's ``--enable-lora`` read: ``adapter_config.json`` and ``adapter_model.safetensors`` with
``base_model.model.model.layers.<i>.<module>.lora_{A,B}.weight`` tensors, A [r, in] and B [out, r] (PEFT's
``x @ A.T @ B.T * scale``, the transposes of grpax's A [in, r] and B [r, out]).

``adapter_config.json``'s ``base_model_name_or_path`` names the Hugging Face form of the base (``hf_base``): the
Hub repository or the folder ``grpax to_native`` converted it from, which ``to_native`` records in the base's
``config.json`` (``CONVERTED_FROM``). A base converted from a GGUF file has none: its Hugging Face form is its own
export (``grpax to_huggingface load_parameters_path=<base>``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from grpax.checkpoint import digests
from grpax.checkpoint.hf import hf_layer_name
from grpax.checkpoint.orbax import find_model_folder, restore_params
from grpax.errors import ConfigError
from grpax.models import lora as lora_lib
from grpax.models.params import cast_params, convert_layout, unstack_layers
from grpax.models.registry import ModelConfig

# The key of a converted base's config.json that records its source: {"hub": repo}, {"hf_model_path": folder}
# or {"gguf": file} (``grpax.checkpoint.convert.to_native``).
CONVERTED_FROM = "grpax_converted_from"


def hf_base(base_path: Path) -> tuple[str, str]:
    """``(base_model_name_or_path, how)``: the Hugging Face model the adapters of the base at ``base_path`` (a
    grpax ``<base>/0/items``) load on, as its conversion recorded it, and how to load them; the name is "" when
    no Hugging Face form of the base exists (a GGUF source, or a base converted before grpax recorded it)."""

    export = (
        f"export the base first (grpax to_huggingface load_parameters_path={base_path} "
        "base_output_directory=BASE_HF weight_dtype=float32) and load the adapters on BASE_HF (or export "
        "them with base_model_name_or_path=BASE_HF to name it in adapter_config.json)"
    )
    try:
        source = json.loads((find_model_folder(base_path) / "config.json").read_text()).get(CONVERTED_FROM)
    except (FileNotFoundError, ValueError):
        source = None
    if not isinstance(source, dict):
        return "", f"the base {base_path} records no Hugging Face source: {export}"
    if source.get("hub"):
        return source["hub"], "the Hub repository the base was converted from"
    if source.get("hf_model_path"):
        folder = source["hf_model_path"]
        there = "" if Path(folder).is_dir() else f" (not there now: move it back, or {export})"
        return folder, f"the Hugging Face folder the base was converted from{there}"
    return "", f"the base {base_path} was converted from the GGUF file {source.get('gguf')}: {export}"


def lora_config(meta: dict) -> lora_lib.LoraConfig:
    return lora_lib.LoraConfig(meta["rank"], meta["alpha"], tuple(meta["target_modules"]), meta["use_rslora"])


def load_lora_step(
    params_path: Path, adapters: Any, meta: dict, base_path: Path | None = None
) -> tuple[Any, Any]:
    """The merged params of a LoRA step: its base (``base_path``, by default ``meta["base_path"]``, checked
    against the fingerprint) plus ``scale * A @ B``, as numpy arrays in the base's dtype and the adapters'
    layout; and the base itself as it was merged into (what the export's rounding is measured against).

    A QLoRA step (``meta["base_quantization"]`` int8 or nf4) merges into the base quantised as it trained: the
    dequantised base plus the adapters, the model whose logits the run's sampler drew from; the base returned
    is then the dequantised one.

    Raises:
      ConfigError: the base is missing or holds other weights than the run trained on (one line).
    """
    import jax

    recorded = Path(meta["base_path"])
    base_path = Path(base_path) if base_path is not None else recorded
    if not base_path.exists():
        if base_path != recorded:
            raise ConfigError(
                f"base_parameters_path={str(base_path)!r} does not exist: pass the base's folder"
            )
        raise ConfigError(
            f"{params_path} holds LoRA adapters of the base {base_path}, which does not exist: put the base "
            "back there, or pass base_parameters_path=<where it is now> to export the merged model "
            "(lora_export=peft needs no base)"
        )
    base = cast_params(restore_params(base_path), meta["base_dtype"])
    quantization = meta.get("base_quantization", "")
    if digests.fingerprint(base, quantization) != meta["base_fingerprint"]:
        raise ConfigError(
            f"{params_path} holds LoRA adapters trained on other weights than those now at {base_path} "
            f"(fingerprint {digests.fingerprint(base, quantization)}, trained on {meta['base_fingerprint']} at "
            f"{recorded}): restore the base it was trained on, or pass base_parameters_path=<that base>"
        )
    stacked = isinstance(adapters["layers"], dict)
    num_layers = len(adapters["layers"]) if not stacked else jax.tree.leaves(adapters)[0].shape[0]
    cfg_stub = _LayerCount(num_layers)
    base = convert_layout(base, cfg_stub, scan_layers=stacked)  # type: ignore[arg-type]
    if quantization:
        base = lora_lib.quantize_base(base, quantization)
    lora = lora_config(meta)
    merged = lora_lib.merge(base, adapters, lora)
    if quantization:  # the dequantised base: merged with adapters that add nothing
        base = lora_lib.merge(base, jax.tree.map(np.zeros_like, adapters), lora)
    return jax.tree.map(np.asarray, merged), jax.tree.map(np.asarray, base)


class _LayerCount:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers


def save_peft(
    adapters: Any, cfg: ModelConfig, meta: dict, folder: Path, base_model_name_or_path: str = ""
) -> list[str]:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (float32) into ``folder``.

    Args:
      adapters: the adapters tree (stacked or listed layers; numpy or jax leaves).
      cfg: the base model's config (its family's module names).
      meta: the checkpoint's ``lora`` record (rank, alpha, target_modules, use_rslora).
      folder: created; must hold no adapter files yet.
      base_model_name_or_path: the Hugging Face base, recorded in the config (``hf_base``;
        ``peft.AutoPeftModelForCausalLM`` loads it; ``PeftModel.from_pretrained`` and vLLM take the base given).

    Returns:
      The file names written.
    """
    layers = adapters["layers"]
    if isinstance(layers, dict):
        import jax

        layers = unstack_layers(jax.tree.map(np.asarray, layers), jax.tree.leaves(layers)[0].shape[0])
    tensors = {}
    for i, layer in enumerate(layers):
        for name, ad in layer.items():
            a, b = np.asarray(ad["a"], np.float32), np.asarray(ad["b"], np.float32)
            r = a.shape[-1]
            prefix = "base_model.model." + hf_layer_name(i, name, cfg).removesuffix(".weight")
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)  # [r, in]
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)  # [out, r]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": meta["rank"],
        "lora_alpha": meta["alpha"],
        "use_rslora": meta["use_rslora"],
        "target_modules": list(meta["target_modules"]),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_dora": False,
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if (folder / name).exists():
            raise ConfigError(
                f"{folder / name} already exists; the export never overwrites: choose another folder"
            )
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    from safetensors.numpy import save_file

    weights = folder / "adapter_model.safetensors"
    mode = (folder / "adapter_config.json").stat().st_mode & 0o777  # an ordinary new file's (0666 less umask)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(mode)  # safetensors writes 0600
    return ["adapter_config.json", "adapter_model.safetensors"]
