"""``grpax serve``: an OpenAI-compatible HTTP server on the rollout engine (``grpax.serve``).

MaxText's keys as ``grpax generate`` takes them (``load_parameters_path``, ``max_prefill_predict_length``,
``max_target_length``), or ``hf_model_path`` (``grpax to_native``'s key) for a Hugging Face folder, plus the
server's: ``host``, ``port``, ``api_key`` (required off localhost), ``served_model_name``,
``allow_update_params``, ``tool_call_parser``, ``max_prefill_prompts``, ``warmup`` and ``warmup_in_background``.
The engine's keys (``max_num_seqs``, ``num_pages``, ``page_size``, ``hbm_utilization_vllm``, ``slot_count_step``,
``sampler_programs``) are ``grpax.config.EngineKeys``', as train_rl, evaluate and generate take them, with 32
decode slots by default and the server's own program set (``grpax.serve.worker.bounded``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from grpax.config import (
    ConfigError,
    EngineKeys,
    SamplingKeys,
    check_engine_keys,
    field,
    new_default,
    read_model_config,
)
from grpax.serve.tools import TOOL_CALL_PARSERS

DESCRIPTION = (
    "Serve a grpax checkpoint (load_parameters_path=<base>/0/items or an actor checkpoint; a LoRA run's step is "
    "served as its base merged with the adapters) or a Hugging Face folder (hf_model_path=, converted in memory) "
    "over HTTP with "
    "OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions (the model's chat template; stream, n, "
    "temperature, top_p, top_k, max_tokens, stop, seed, logprobs/top_logprobs), with vLLM's token-id fields "
    "(prompt as token ids, return_token_ids) and the policy_version of each response. Requests are batched "
    "continuously on the engine (max_num_seqs slots); one over max_prefill_predict_length prompt tokens or the "
    "completion budget is refused with a 400. Binds 127.0.0.1 unless host= is set (then api_key= is required). "
    "allow_update_params=true adds POST /v1/update_params {load_parameters_path, version}. The server runs a small "
    "program set known from its keys: a one-prompt prefill (max_prefill_prompts) per power-of-two prompt bucket, a "
    "decode per slot count (the halvings of max_num_seqs), every sampling rule as data and n as n copies of the "
    "prompt (no shape); warmup=true (the default) compiles the first request's programs before the port opens and "
    "the rest while no request is in flight (warmup_in_background=false: all before), logged a line each, so that "
    "a warm server compiles nothing per request (but top_logprobs' scoring forward: one program per power-of-two "
    "length, at its first request). Requests of any sampling "
    "settings share the running batch. tool_call_parser=hermes|llama3_json returns the model's tool calls as "
    "tool_calls. Needs "
    "pip install 'grpax[serve]'."
)

log = logging.getLogger(__name__)

LOCALHOST = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class ServeConfig(SamplingKeys):
    load_parameters_path: str = field(
        "", "checkpoint (<base>/0/items, <run>/checkpoints/actor/<step>/model_params; a LoRA run's: merged)"
    )
    hf_model_path: str = field(
        "", "a Hugging Face folder (config.json, *.safetensors, tokenizer), converted in memory (instead)"
    )
    model_name: str = field("", "model registry name (optional: checks the checkpoint's shapes)")
    served_model_name: str = field(
        "", "the model id clients send as 'model' ('' = model_name, else the checkpoint's folder name)"
    )
    host: str = field("127.0.0.1", "address to bind (another than localhost needs api_key)")
    port: int = field(8000, "TCP port")
    api_key: str = field(
        "", "clients must send 'Authorization: Bearer <api_key>' ('' = no check, localhost only)"
    )
    max_prefill_predict_length: int = field(512, "max prompt tokens (longer prompts are refused with a 400)")
    max_target_length: int = field(1536, "max prompt + completion tokens")
    max_completion_length: int = field(
        -1, "max new tokens per completion, the largest max_tokens (-1: max_target_length - prefill)"
    )
    # The one engine key whose default is the server's own (EngineKeys' 0, every sequence at once, is no bound
    # for a server's queue); its help and its place in --help are EngineKeys'.
    max_num_seqs: int = new_default(EngineKeys, "max_num_seqs", 32)
    max_prefill_prompts: int = field(
        1,
        "prompts one prefill call takes at most (more enter in further calls of the same step): one prefill "
        "program per prompt bucket and power-of-two count up to it (1: one per bucket; a CPU prefill's time "
        "grows with its prompts, docs/benchmarks.md)",
    )
    allow_update_params: bool = field(False, "enable POST /v1/update_params (swap in another checkpoint)")
    tool_call_parser: str = field(
        "",
        "read the model's tool calls into OpenAI's tool_calls for chat requests that send tools (vLLM's "
        "--tool-call-parser): hermes (Qwen2.5/Qwen3/Hermes <tool_call> JSON) | llama3_json (Llama 3.1/3.2) | '' = off",
    )
    warmup: bool = field(
        True, "compile every program of the server's set (logged a line each) before serving it"
    )
    warmup_in_background: bool = field(
        True,
        "open the port once the first request's programs are compiled and compile the rest while no request is "
        "in flight (a request may wait for one compile); false: every program before the port opens",
    )


CONFIG = ServeConfig


def model_id(config: ServeConfig) -> str:
    """The name clients send as ``model``."""
    if config.served_model_name:
        return config.served_model_name
    if config.model_name:
        return config.model_name
    path = Path(config.load_parameters_path or config.hf_model_path)
    parts = [p for p in path.parts if p not in ("0", "items", "model_params")]
    return parts[-1] if parts else str(path)


def _check_keys(config: ServeConfig) -> None:
    """The keys checked before anything loads (ConfigError naming the key)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"grpax serve needs fastapi and uvicorn ({e.name} is missing): pip install 'grpax[serve]'"
        ) from None
    if bool(config.load_parameters_path) == bool(config.hf_model_path):
        raise ConfigError(
            "pass one of load_parameters_path=<base>/0/items (see grpax to_native) or hf_model_path=<folder with "
            "config.json, *.safetensors and the tokenizer>"
        )
    if config.host not in LOCALHOST and not config.api_key:
        raise ConfigError(
            f"host={config.host} exposes the server beyond this machine: pass api_key=<secret> (clients send it "
            "as a Bearer token) or host=127.0.0.1"
        )
    if not 0 <= config.port < 65536:
        raise ConfigError(f"port={config.port}: expected 0..65535")
    if config.max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs={config.max_num_seqs} must be >= 1")
    if config.sampler_programs == "fixed":
        raise ConfigError(
            "sampler_programs=fixed: grpax serve runs its own bounded program set (adaptive: a fixed set would "
            "prefill max_num_seqs prompts for a request of one); pass auto or adaptive"
        )
    if config.max_prefill_prompts < 1:
        raise ConfigError(
            f"max_prefill_prompts={config.max_prefill_prompts} must be >= 1 (1: one prefill program per bucket)"
        )
    if config.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"tool_call_parser={config.tool_call_parser!r}: expected one of "
            f"{', '.join(p for p in TOOL_CALL_PARSERS if p)}, or '' (off)"
        )


def load_checkpoint(path: str, model_cfg, hf: bool = False):
    """``(params, cfg, tokenizer)`` of what the server serves: a native checkpoint (``load_model``); a LoRA run's
    step (``.../actor/<step>/model_params`` holding adapters only) as its base merged with the adapters, in the
    base's dtype (``grpax.checkpoint.peft.load_lora_step``: the base checked against the run's fingerprint), in
    ``model_cfg``'s layer layout; or (``hf``) a Hugging Face folder read into ``model_cfg``'s layout and
    ``weight_dtype`` (``grpax.checkpoint.hf.load_params_from_tensors``, what ``grpax to_native`` writes).

    Raises:
      ConfigError: the LoRA base is missing or changed; FileNotFoundError: a missing folder, tensor file or
        tokenizer (names it); MissingTensorError: a weight absent from the safetensors.
    """
    from grpax.checkpoint.orbax import find_model_folder, load_model, restore_params
    from grpax.checkpoint.peft import load_lora_step
    from grpax.checkpoint.train_state import lora_meta
    from grpax.data.tokenizer import load_tokenizer
    from grpax.models.params import convert_layout

    folder = Path(path).absolute()
    if hf:
        from grpax.checkpoint.convert import SafetensorsSource
        from grpax.checkpoint.hf import load_params_from_tensors

        if not folder.is_dir():
            raise FileNotFoundError(
                f"hf_model_path={folder} is not a folder: pass the folder holding config.json"
            )
        source = SafetensorsSource(folder, lazy=True)
        params = load_params_from_tensors(
            source.get_tensor,
            source.has_tensor,
            model_cfg,
            dtype=model_cfg.weight_dtype,
            tensor_shape=source.tensor_shape,
        )
        return params, model_cfg, load_tokenizer(folder)
    meta = lora_meta(folder)
    if meta is None:
        return load_model(path, model_cfg)
    params, _ = load_lora_step(folder, restore_params(folder), meta)  # (merged, the base merged into)
    model_folder = find_model_folder(folder)
    return convert_layout(params, model_cfg, model_cfg.scan_layers), model_cfg, load_tokenizer(model_folder)


def _engine_keys(config: ServeConfig, length: int) -> dict:
    """The engine's ``SamplerConfig`` fields of the server's keys (``EngineKeys``' and ``max_prefill_prompts``)
    for completions of ``length`` tokens, checked by ``check_engine_keys`` as every command's, then by
    ``SamplerConfig`` (ConfigError naming the key)."""
    from grpax.cli.generate import context_keys
    from grpax.sampler.keys import sampler_config

    check_engine_keys(config, config.max_prefill_predict_length + length, context_keys(config))
    keys = {**config.engine_keys(), "max_prefill_prompts": config.max_prefill_prompts}
    try:
        sampler_config(config.max_prefill_predict_length, length, **keys)
    except ValueError as e:
        message = str(e).replace("max_prompt_length", "max_prefill_predict_length")
        raise ConfigError(message.replace("hbm_utilization=", "hbm_utilization_vllm=")) from None
    return keys


def run(config: ServeConfig) -> int:
    _check_keys(config)
    import jax
    import uvicorn

    from grpax import distributed
    from grpax.cli.generate import completion_length, context_length_keys
    from grpax.data.tokenizer import stop_token_ids
    from grpax.models.registry import check_matches
    from grpax.sampler.keys import sampler_config
    from grpax.sampler.paging import check_memory_fraction
    from grpax.serve.app import Server, build_app
    from grpax.serve.worker import EngineWorker

    length = completion_length(config)
    total = config.max_prefill_predict_length + length
    engine_keys = _engine_keys(config, length)
    path, hf = config.hf_model_path or config.load_parameters_path, bool(config.hf_model_path)
    model_cfg, _ = read_model_config(path, config, total, context_length_keys(config, total))
    if model_cfg is None and hf:
        raise ConfigError(f"hf_model_path={path} holds no config.json: pass a Hugging Face model folder")
    distributed.maybe_initialize(config.skip_jax_distributed_system)
    check_memory_fraction(config.hbm_utilization_vllm)
    params, model_cfg, tokenizer = load_checkpoint(path, model_cfg, hf)
    if config.model_name:
        check_matches(model_cfg, config.model_name, path)
    sampler_cfg = sampler_config(
        config.max_prefill_predict_length,
        length,
        stop_token_ids(tokenizer, model_cfg),
        model_cfg.pad_token_id,
        **engine_keys,
    )
    worker = EngineWorker(jax.device_put(params), model_cfg, sampler_cfg)
    if config.warmup:
        worker.warmup(background=config.warmup_in_background)

    def load_params(path: str):  # native checkpoints and LoRA steps
        return jax.device_put(load_checkpoint(path, model_cfg)[0])

    server = Server(
        worker,
        tokenizer,
        model_id(config),
        api_key=config.api_key,
        load_params=load_params if config.allow_update_params else None,
        tool_call_parser=config.tool_call_parser,
    )
    worker.start()
    try:
        uvicorn.run(build_app(server), host=config.host, port=config.port, log_level="info")
    finally:
        worker.stop()
    return 0
