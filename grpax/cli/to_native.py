"""``grpax to_native``: Hugging Face checkpoint (local folder, Hub, or GGUF) -> grpax Orbax checkpoint.

The keys are MaxText's ``to_maxtext`` keys, so ``load_parameters_path=<base_output_directory>/0/items`` then
works for every other command.
"""

from __future__ import annotations

import dataclasses

from grpax.config import HOST_HARDWARE_HELP, field

DESCRIPTION = (
    "Converts a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3 causal LMs, or the text "
    "model of Gemma3ForConditionalGeneration) to a grpax Orbax checkpoint at "
    "<base_output_directory>/0/items, with config.json and the tokenizer at <base_output_directory>/. "
    "The source is hf_model_path (a local folder with config.json and *.safetensors), else gguf_path, "
    "else the Hub repository of model_name (needs network; hf_access_token for gated models). A local source "
    "is converted with its own config; a registered model_name, when given, is checked against it."
)


@dataclasses.dataclass(frozen=True)
class CONFIG:
    model_name: str = field(
        "", "registered model name: the Hub source without a local one; a local source must match it"
    )
    base_output_directory: str = field("", "output root: receives config.json, tokenizer files and 0/items")
    hf_model_path: str = field("", "local folder with config.json and *.safetensors (else Hub / gguf_path)")
    hf_access_token: str = field("", "Hugging Face token for gated Hub repositories")
    gguf_path: str = field(
        "", "a Llama, Qwen2 or Qwen3 GGUF file to convert instead (dequantised to weight_dtype)"
    )
    scan_layers: bool = field(True, "store layers stacked [L, ...] (scanned) or as a per-layer list")
    lazy_load_tensors: bool = field(True, "stream one tensor at a time (low memory); false reads whole files")
    weight_dtype: str = field("float32", "stored parameter dtype: float32 | bfloat16 | float16")
    checkpoint_storage_use_zarr3: bool = field(True, "Orbax zarr v3 array format")
    checkpoint_storage_use_ocdbt: bool = field(True, "Orbax OCDBT key-value store (fewer files)")
    use_multimodal: bool = field(False, "multimodal models are not supported; must be false")
    hardware: str = field("cpu", HOST_HARDWARE_HELP)
    skip_jax_distributed_system: bool = field(True, "do not call jax.distributed.initialize() on multi-host")


def run(config: CONFIG) -> int:
    from grpax.config import ConfigError

    if not config.base_output_directory:
        raise ConfigError(
            "base_output_directory is required (e.g. base_output_directory=checkpoints/smollm2)"
        )
    from grpax import distributed

    distributed.maybe_initialize(config.skip_jax_distributed_system)
    from grpax.checkpoint.convert import to_native

    summary = to_native(
        model_name=config.model_name,
        base_output_directory=config.base_output_directory,
        hf_model_path=config.hf_model_path or None,
        hf_access_token=config.hf_access_token or None,
        gguf_path=config.gguf_path or None,
        scan_layers=config.scan_layers,
        lazy_load_tensors=config.lazy_load_tensors,
        weight_dtype=config.weight_dtype,
        use_zarr3=config.checkpoint_storage_use_zarr3,
        use_ocdbt=config.checkpoint_storage_use_ocdbt,
        use_multimodal=config.use_multimodal,
    )
    print(f"converted {summary['source']}")
    print(
        f"  params     {summary['params_path']}  ({summary['num_params']:,} parameters, {summary['weight_dtype']}, "
        f"scan_layers={summary['scan_layers']})"
    )
    print(f"  config     {summary['config_path']}")
    print(f"  tokenizer  {', '.join(summary['tokenizer_files']) or 'none found in the source'}")
    print(f"next: load_parameters_path={summary['params_path']}")
    return 0
