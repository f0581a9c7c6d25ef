"""``grpax generate``: sample completions from a checkpoint with the KV-cache rollout engine.

MaxText's decode keys (``max_prefill_predict_length``, ``max_target_length``, ``decode_sampling_*``) select the
prompt budget and the sampling rule; completions are printed and optionally written as JSONL.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import ClassVar

from grpax.config import ConfigError, SamplingKeys, check_engine_keys, field, read_model_config
from grpax.files import check_output, write_text_atomic
from grpax.tasks import EnvironmentConfig

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Sample completions from a grpax checkpoint (load_parameters_path=<base>/0/items or an actor checkpoint) "
    "for prompt=TEXT or prompts_path=FILE.jsonl (a 'prompt' field per line), num_generations per prompt, "
    "batch_size rows per compiled call. decode_sampling_strategy=greedy|weighted|nucleus|topk as in MaxText. "
    "prompt_preset=maxtext|smollm2_demo renders each prompt as train_rl renders a question (the preset a run "
    "trained with; model presets do not set it here). "
    "output_path=FILE.jsonl writes one record per completion (prompt, completion, completion_ids, "
    "finish_reason). environment=calculator (or environment_path=FILE environment=NAME) samples multi-turn "
    "conversations with that environment, as train_rl and evaluate do (records add turns, tool_calls, "
    "tool_errors; completion holds the observations too)."
)

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")


@dataclasses.dataclass(frozen=True)
class GenerateConfig(EnvironmentConfig, SamplingKeys):
    # A model preset's prompt_preset is train_rl's; here a prompt is not a GSM8K question unless asked for.
    PRESET_IGNORES: ClassVar[tuple[str, ...]] = ("prompt_preset",)

    load_parameters_path: str = field("", "checkpoint (<base>/0/items or <run>/checkpoints/actor/<step>/...)")
    model_name: str = field("", "model registry name (optional: checks the checkpoint's shapes)")
    prompt: str = field("", "one prompt text")
    prompts_path: str = field("", "JSONL file with a 'prompt' field per line")
    use_chat_template: bool = field(
        True, "wrap each prompt as a user turn with the tokenizer's chat template"
    )
    prompt_preset: str = field(
        "",
        "render each prompt as a train_rl question with this preset (maxtext | smollm2_demo | smollm2_calculator: system prompt, "
        "template, response prefix), so the trained model is sampled as it was trained; '' = the bare user turn",
    )
    max_prefill_predict_length: int = field(256, "max prompt tokens (longer prompts keep their last tokens)")
    max_target_length: int = field(512, "max prompt + completion tokens")
    max_completion_length: int = field(-1, "new tokens per completion (-1: max_target_length - prefill)")
    decode_sampling_strategy: str = field("greedy", "greedy | weighted | nucleus | topk")
    decode_sampling_temperature: float = field(1.0, "temperature (weighted, nucleus, topk)")
    decode_sampling_top_k: int = field(50, "k of topk")
    decode_sampling_nucleus_p: float = field(0.9, "p of nucleus")
    num_generations: int = field(1, "completions per prompt")
    batch_size: int = field(8, "rows per generate call (prompts x generations are split into batches)")
    seed: int = field(0, "sampling seed")
    output_path: str = field("", "JSONL file for the completions")
    overwrite: bool = field(False, "replace the file at output_path if it exists")


CONFIG = GenerateConfig


def sampling_kwargs(config: GenerateConfig) -> dict:
    """The ``SamplerConfig`` sampling fields for ``decode_sampling_strategy``.

    Raises:
      ConfigError: an unknown strategy.
    """
    strategy = config.decode_sampling_strategy
    temperature = config.decode_sampling_temperature
    if strategy == "greedy":
        return {"greedy": True}
    if strategy == "weighted":
        return {"temperature": temperature}
    if strategy == "nucleus":
        return {"temperature": temperature, "top_p": config.decode_sampling_nucleus_p}
    if strategy == "topk":
        return {"temperature": temperature, "top_k": config.decode_sampling_top_k}
    raise ConfigError(f"decode_sampling_strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")


# SamplerConfig's field names -> this command's keys, for its errors.
_SAMPLER_KEYS = {
    "temperature": "decode_sampling_temperature",
    "top_k": "decode_sampling_top_k",
    "top_p": "decode_sampling_nucleus_p",
    "max_prompt_length": "max_prefill_predict_length",
}


def check_sampling(config: GenerateConfig, completion_length: int, sampling: dict) -> None:
    """Checks the sampling keys before any model is loaded.

    Raises:
      ConfigError: a value ``SamplerConfig`` refuses, named by this command's key.
    """
    from grpax.sampler.keys import sampler_config

    try:
        sampler_config(config.max_prefill_predict_length, completion_length, **sampling)
    except ValueError as e:
        message = str(e).replace("greedy=true", "decode_sampling_strategy=greedy")
        for name, key in _SAMPLER_KEYS.items():
            message = re.sub(rf"\b{re.escape(name)}(?==)", key, message)
        raise ConfigError(message) from None


def read_prompts(config: GenerateConfig) -> list[str]:
    """The prompt texts from ``prompt=`` and/or ``prompts_path=``.

    Raises:
      ConfigError: neither is given, ``prompts_path`` is missing or not UTF-8 JSONL, or a line is not a JSON
        object whose ``prompt`` field holds text (a null, a number or a list of chat messages would be sampled
        as its printed form; names the file and line).
    """
    from grpax.data.datasets import read_jsonl_lines  # noqa: PLC0415 - keeps --help fast

    prompts = [config.prompt] if config.prompt else []
    if config.prompts_path:
        path = Path(config.prompts_path)
        if not path.is_file():
            raise ConfigError(
                f"prompts_path={config.prompts_path}: no such file (a JSONL with a 'prompt' field)"
            )
        try:
            records = read_jsonl_lines(path)
        except ValueError as e:
            raise ConfigError(f"prompts_path: {e}") from None
        for n, record in records:
            if not isinstance(record, dict) or "prompt" not in record:
                raise ConfigError(
                    f"prompts_path {config.prompts_path}:{n} has no 'prompt' field: each line must be a JSON "
                    'object like {"prompt": "..."}'
                )
            text = record["prompt"]
            if not isinstance(text, str) or not text.strip():
                hint = (
                    " (a list of chat messages: put the user turn's text in 'prompt')"
                    if isinstance(text, list)
                    else ""
                )
                raise ConfigError(
                    f"prompts_path {config.prompts_path}:{n} 'prompt' holds {json.dumps(text)[:60]}, not the "
                    f"prompt's text{hint}: fix the line or drop it"
                )
            prompts.append(text)
    if not prompts:
        raise ConfigError("pass prompt=TEXT or prompts_path=FILE.jsonl")
    return prompts


def check_prompt_preset(config: GenerateConfig) -> None:
    """Raises ConfigError for an unknown prompt_preset, or one without the chat template it renders with."""
    from grpax.tasks.prompts import PROMPT_PRESETS

    if config.prompt_preset and config.prompt_preset not in PROMPT_PRESETS:
        raise ConfigError(
            f"prompt_preset={config.prompt_preset!r}: expected one of {', '.join(PROMPT_PRESETS)}, or '' for none"
        )
    if config.prompt_preset and not config.use_chat_template:
        raise ConfigError(
            f"prompt_preset={config.prompt_preset} renders with the chat template (as train_rl does): drop "
            "use_chat_template=false, or prompt_preset"
        )


def render_prompts(config: GenerateConfig, tokenizer, texts: list[str]) -> list[str]:
    """The prompt texts the model continues: train_rl's rendering with prompt_preset, else a bare user turn."""
    from grpax.data.prompts import render_prompt
    from grpax.tasks.prompts import get_prompt_preset

    if config.prompt_preset:
        preset = get_prompt_preset(config.prompt_preset)
        return [render_prompt(tokenizer, t, preset) for t in texts]
    if not config.use_chat_template:
        return list(texts)
    messages = [[{"role": "user", "content": t}] for t in texts]
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]


def completion_length(config: GenerateConfig) -> int:
    """New tokens per row: ``max_completion_length``, or (-1) max_target_length - max_prefill_predict_length.

    Raises:
      ConfigError: 0 new tokens asked for, or none left after the prompt budget.
    """
    if config.max_completion_length == 0:
        raise ConfigError(
            "max_completion_length=0: expected >= 1 new tokens (or -1: max_target_length - prefill)"
        )
    length = config.max_completion_length
    if length < 0:
        length = config.max_target_length - config.max_prefill_predict_length
    if length < 1:
        raise ConfigError(
            f"max_target_length={config.max_target_length} leaves no completion tokens after "
            f"max_prefill_predict_length={config.max_prefill_predict_length}"
        )
    return length


def context_keys(config: GenerateConfig) -> str:
    """The keys that set a sequence's longest length (prompt + completion), as an error names them (generate's
    and serve's)."""
    if config.max_completion_length > 0:
        return "max_prefill_predict_length + max_completion_length"
    return "max_target_length"


def context_length_keys(config: GenerateConfig, total: int) -> str:
    """``context_keys`` with the length they set (``total`` tokens), as the context check's error names it."""
    if config.max_completion_length > 0:
        return f"{context_keys(config)} = {total}"
    return f"max_target_length={config.max_target_length}"


def _check_keys(config: GenerateConfig, length: int, sampling: dict) -> None:
    """The keys checked before anything is read (ConfigError naming the key)."""
    if not config.load_parameters_path:
        raise ConfigError("pass load_parameters_path=<base>/0/items (see grpax to_native)")
    for key in ("num_generations", "batch_size"):
        if getattr(config, key) < 1:
            raise ConfigError(f"{key}={getattr(config, key)} must be >= 1")
    check_sampling(config, length, sampling)
    check_engine_keys(
        config,
        config.max_prefill_predict_length + length,
        context_keys(config),
        (("num_generations", config.num_generations),),
    )
    check_prompt_preset(config)
    if config.environment:
        from grpax.tasks import validate_environment_keys

        validate_environment_keys(config)
        if not config.use_chat_template:
            raise ConfigError(
                f"environment={config.environment!r} renders prompts and tool turns with the chat template: drop "
                "use_chat_template=false"
            )
    if config.output_path:
        check_output("output_path", config.output_path, config.overwrite)


def run(config: GenerateConfig) -> int:
    import jax

    from grpax import distributed, prng
    from grpax.checkpoint.orbax import load_model
    from grpax.data.tokenizer import stop_token_ids
    from grpax.models.registry import check_matches
    from grpax.sampler.keys import sampler_config
    from grpax.sampler.paging import check_memory_fraction

    length = completion_length(config) if config.load_parameters_path else 0
    sampling = sampling_kwargs(config)
    _check_keys(config, length, sampling)
    texts = read_prompts(config)
    total = config.max_prefill_predict_length + length
    # The checkpoint's config.json, read once: the context check here, the load below.
    model_cfg, _ = read_model_config(
        config.load_parameters_path, config, total, context_length_keys(config, total)
    )
    distributed.maybe_initialize(config.skip_jax_distributed_system)
    check_memory_fraction(config.hbm_utilization_vllm)
    params, model_cfg, tokenizer = load_model(config.load_parameters_path, model_cfg)
    if config.model_name:
        check_matches(model_cfg, config.model_name, config.load_parameters_path)
    # The keys and the checkpoint are checked: the command's first log line (after the devices',
    # grpax.cli.main.announce), before the sampling.
    log.info(
        "%d prompts x %d completions of up to %d tokens from %s",
        len(texts), config.num_generations, length, config.load_parameters_path,
    )  # fmt: skip
    params = jax.device_put(params)
    stops = stop_token_ids(tokenizer, model_cfg)
    sampler_cfg = sampler_config(
        config.max_prefill_predict_length,
        length,
        stops,
        model_cfg.pad_token_id,
        **sampling,
        **config.engine_keys(),
    )
    key = prng.key(config.seed)
    generate_rows = _generate_with_environment if config.environment else _generate_single_turn
    records, record_prompts = generate_rows(config, params, model_cfg, tokenizer, sampler_cfg, texts, key)
    return _report(config, records, record_prompts)


def _generate_single_turn(
    config, params, model_cfg, tokenizer, sampler_cfg, texts, key
) -> tuple[list[dict], list[int]]:
    """``num_generations`` completions of every prompt in blocks of ``batch_size`` rows (each block's key folded
    from ``key`` by its first row), as records, and the prompt index of each."""
    from tqdm import tqdm

    from grpax import prng
    from grpax.sampler.engine import generate

    token_ids = [
        tokenizer.encode(t, add_special_tokens=False) for t in render_prompts(config, tokenizer, texts)
    ]
    rows = [i for i in range(len(texts)) for _ in range(config.num_generations)]
    records, record_prompts = [], []
    for start in tqdm(range(0, len(rows), config.batch_size), desc="generate", unit="batch"):
        batch = rows[start : start + config.batch_size]
        out = generate(
            params, [token_ids[i] for i in batch], model_cfg, sampler_cfg, prng.fold_in(key, start)
        )
        for r, row_index in enumerate(out.prompt_indices):
            i = batch[int(row_index)]
            record_prompts.append(i)
            ids = out.completion_ids[r, : out.lengths[r]].tolist()
            records.append(
                {
                    "prompt": texts[i],
                    "completion": tokenizer.decode(ids, skip_special_tokens=True),
                    "completion_ids": ids,
                    "finish_reason": out.finish_reason[r],
                }
            )
    return records, record_prompts


def _generate_with_environment(
    config, params, model_cfg, tokenizer, sampler_cfg, texts, key
) -> tuple[list[dict], list[int]]:
    """Multi-turn records of every prompt with ``environment`` (``grpax.sampler.multi_turn``) in blocks of
    ``batch_size`` rows, and the prompt index of each."""
    import types

    from grpax import prng
    from grpax.data.prompts import PromptPreset
    from grpax.sampler.multi_turn import trajectory_sampler
    from grpax.tasks import environment_factory, multi_turn_config
    from grpax.tasks.prompts import get_prompt_preset

    preset = (
        get_prompt_preset(config.prompt_preset) if config.prompt_preset else PromptPreset(system_prompt="")
    )
    task = types.SimpleNamespace(preset=preset)  # what the sampler reads of a task: its prompt
    factory, turn_cfg, G = environment_factory(config), multi_turn_config(config), config.num_generations
    sample = trajectory_sampler(task, tokenizer, factory, model_cfg, sampler_cfg, turn_cfg)
    records, record_prompts = [], []
    per_call = max(1, config.batch_size // G)
    for start in range(0, len(texts), per_call):
        rows = [{"question": t, "gold": "", "columns": {}} for t in texts[start : start + per_call]]
        out = sample(params, rows, prng.fold_in(key, start), G)
        for r in range(len(out.texts)):
            i = start + int(out.prompt_indices[r // G])
            record_prompts.append(i)
            ids = out.completion_ids[r][: int(out.lengths[r] + out.observation_tokens[r])].tolist()
            records.append(
                {
                    "prompt": texts[i],
                    "completion": out.texts[r],
                    "completion_ids": ids,
                    "finish_reason": out.finish_reason[r],
                    "turns": int(out.turns[r]),
                    "tool_calls": int(out.tool_calls[r]),
                    "tool_errors": int(out.tool_errors[r]),
                }
            )
    return records, record_prompts


def _report(config: GenerateConfig, records: list[dict], record_prompts: list[int]) -> int:
    """Prints the completions and writes them to output_path."""
    for i, record in zip(record_prompts, records, strict=True):
        print(f"=== prompt {i} ({record['finish_reason']}, {len(record['completion_ids'])} tokens)")
        print(f"{record['prompt']}\n--- completion\n{record['completion']}\n")
    if config.output_path:
        path = Path(config.output_path)
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        log.info("wrote %d completions to %s", len(records), path)
    return 0
