"""``grpax to_huggingface``: grpax Orbax checkpoint -> Hugging Face folder (config, tokenizer, safetensors).

The output loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` unchanged
(and with vLLM / llama.cpp's converter). MaxText keys.
"""

from __future__ import annotations

import dataclasses
import sys

from grpax.config import HOST_HARDWARE_HELP, field

DESCRIPTION = (
    "Exports the grpax checkpoint at load_parameters_path (<base>/0/items of a conversion, or "
    "<run>/checkpoints/actor/<step>/model_params of a training run) to a Hugging Face folder at "
    "base_output_directory: config.json, generation_config.json, tokenizer files with the chat "
    "template, and safetensors in weight_dtype (sharded with an index above max_shard_size)."
)


@dataclasses.dataclass(frozen=True)
class CONFIG:
    model_name: str = field("", "registered model name; when given the checkpoint's config must match it")
    load_parameters_path: str = field(
        "", "the Orbax params folder to export (<base>/0/items or .../model_params)"
    )
    base_output_directory: str = field("", "output folder for the Hugging Face files")
    weight_dtype: str = field("bfloat16", "safetensors dtype: bfloat16 | float32 | float16")
    lora_export: str = field(
        "merged",
        "a LoRA run's step: merged (the base with the adapters merged in; QLoRA: the dequantised base with them) "
        "| peft (a PEFT adapter folder: adapter_config.json + adapter_model.safetensors, for "
        "peft.PeftModel.from_pretrained and vllm --enable-lora)",
    )
    base_parameters_path: str = field(
        "",
        "the base a training step was trained from: a LoRA step's (default: the path its checkpoint records; "
        "pass where it is now if it moved) and the weights a full fine-tune's export is compared with, to say "
        "how much of the update survives weight_dtype (default: the run's load_parameters_path; holds a second "
        "copy of the weights in host memory); none = no comparison",
    )
    base_model_name_or_path: str = field(
        "",
        "lora_export=peft: the Hugging Face base named in adapter_config.json (default: the Hub repository or "
        "folder the base was converted from, as grpax to_native recorded it)",
    )
    max_shard_size: int = field(2 * 1024**3, "bytes per safetensors shard; more shards write an index")
    scan_layers: bool = field(True, "accepted for MaxText compatibility; the stored layout is read as it is")
    use_multimodal: bool = field(False, "multimodal models are not supported; must be false")
    hardware: str = field("cpu", HOST_HARDWARE_HELP)
    skip_jax_distributed_system: bool = field(True, "do not call jax.distributed.initialize() on multi-host")


def run(config: CONFIG) -> int:
    from grpax.config import ConfigError

    if config.use_multimodal:
        raise ConfigError("use_multimodal=true is not supported: grpax exports text-only causal LMs")
    for key in ("load_parameters_path", "base_output_directory"):
        if not getattr(config, key):
            raise ConfigError(f"{key} is required")
    from grpax import distributed

    distributed.maybe_initialize(config.skip_jax_distributed_system)
    from grpax.checkpoint.convert import to_huggingface

    summary = to_huggingface(
        load_parameters_path=config.load_parameters_path,
        base_output_directory=config.base_output_directory,
        model_name=config.model_name or None,
        weight_dtype=config.weight_dtype,
        max_shard_size=config.max_shard_size,
        lora_export=config.lora_export,
        base_parameters_path=config.base_parameters_path,
        base_model_name_or_path=config.base_model_name_or_path,
    )
    print(f"exported {config.load_parameters_path}")
    if "peft_files" in summary:
        lora, out = summary["lora"], summary["output_dir"]
        print(f"  folder       {out}  (PEFT LoRA adapters, {summary['num_params']:,} parameters)")
        print(f"  files        {', '.join(summary['peft_files'])}")
        print(f"  trained on   {lora['base_path']} (r={lora['rank']}, lora_alpha={lora['alpha']})")
        if summary["hf_base"]:
            print(f"  HF base      {summary['hf_base']} ({summary['hf_base_note']})")
            print(
                "  load with    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                f"{summary['hf_base']!r}), {out!r})"
            )
        else:
            print(f"  HF base      none recorded: {summary['hf_base_note']}")
        return 0
    print(
        f"  folder       {summary['output_dir']}  ({summary['num_params']:,} parameters, {summary['weight_dtype']})"
    )
    print(f"  safetensors  {', '.join(summary['safetensors'])}")
    print(f"  config       {summary['config_path']} (+ generation_config.json)")
    print(
        f"  tokenizer    {', '.join(summary['tokenizer_files']) or 'none (no tokenizer next to config.json)'}"
    )
    report = summary["rounding"]
    if report is not None:
        print(f"  training     {report.line()}")
    elif summary["rounding_note"]:
        print(f"  training     {summary['rounding_note']}")
    if report is not None and report.lost:
        print(f"grpax to_huggingface: warning: {report.warning()}", file=sys.stderr)
    return 0
