"""The keys of MaxText's RL trainer (``maxtext/configs/post_train/rl.yml`` and its run scripts) that grpax has
no counterpart for, so that a MaxText command line runs here unchanged or stops at once with the fix.

Three kinds, each with the reason (``Foreign``):

* settings of the stack MaxText drives that grpax does not use (vLLM, Pathways, Tunix's metrics): accepted with
  any value and ignored with an INFO note;
* settings grpax has with other keys: accepted where the value is what grpax does anyway (MaxText's default or
  the neutral value), refused otherwise with a one-line error naming grpax's key;
* nothing is silently dropped: every key here is either a no-op in grpax or refused.

MaxText keys grpax does honour are its own fields (``max_num_seqs``, ``hbm_utilization_vllm``, the reward values
``reward_*`` / ``penalty_*``, ...) or aliases (``TrainConfig.ALIASES``).
"""

from __future__ import annotations

from grpax.config import Foreign

_VLLM = "a setting of vLLM, which grpax does not run (its own engine samples)"
_PATHWAYS = (
    "Pathways' placement of trainer and sampler; grpax's sampler shares the trainer's devices or takes the "
    "first rollout_devices=M of them (the trainer the rest)"
)
_SAMPLER_DEVICES = Foreign(
    _PATHWAYS,
    ("1", "1.0"),
    "grpax's sampler shares all devices with the trainer (the default) or takes rollout_devices=M of its own: "
    "pass rollout_devices=<devices for the sampler> instead",
)
_TAGS = Foreign(
    "the GSM8K tags of MaxText's prompt and rewards, which grpax's prompt_preset=maxtext and rewards use",
    (),
    "grpax's built-in GSM8K prompt and rewards use <reasoning>/<answer>; for other tags write your own prompt "
    "(prompt_template_path=) and rewards (reward_functions_path=)",
)

_KERNELS = (
    "a choice among MaxText's kernels, which grpax does not have: its MoE runs its own grouped matmul "
    "(grpax/models/moe.py) and its attention is the attention key's"
)
_CONVERTER = "a check of MaxText's converter to vLLM, which grpax does not run (to_huggingface exports)"
_FALSE = ("false", "0", "no", "off")

_FUSED = (
    "remat_policy=custom's name of a fused projection MaxText builds with fused_mlp / fused_qkv (off for its "
    "Llama, Qwen and Gemma); grpax's projections are separate"
)

MAXTEXT_RL_KEYS: dict[str, Foreign] = {
    "mlpwi": Foreign(_FUSED, ("remat",), "name them mlpwi_0 and mlpwi_1 (the gate and up projections)"),
    "qkv_proj": Foreign(_FUSED, ("remat",), "name them query_proj, key_proj and value_proj"),
    "async_scheduling": Foreign(_VLLM),
    "enable_dp_attention": Foreign(_VLLM + "; rollout_data_parallelism splits the rollout's rows"),
    "kv_cache_buffer": Foreign(_VLLM + "; the KV pool: num_pages or hbm_utilization_vllm"),
    "swap_space_vllm_gb": Foreign(_VLLM + "; a short KV pool preempts and recomputes"),
    "max_num_batched_tokens": Foreign(_VLLM + "; the engine prefills whole prompts between decode calls"),
    "vllm_hf_overrides": Foreign(_VLLM),
    "vllm_additional_config": Foreign(_VLLM),
    "rollout_micro_batch_size": Foreign(
        "Tunix's prompts per rollout call; grpax's engine batches continuously in max_num_seqs decode slots"
    ),
    "enable_tunix_perf_metrics": Foreign("Tunix's metrics; grpax writes its timings (time/*) to TensorBoard"),
    "eval_corr_lst": Foreign(
        "Tunix's evaluation debug lists; grpax writes every answer to the run's eval/<tag>/results.jsonl"
    ),
    "eval_make_lst": Foreign(
        "Tunix's evaluation debug lists; grpax writes every answer to the run's eval/<tag>/results.jsonl"
    ),
    "debug.rl": Foreign(
        "MaxText's RL debug logging; grpax's is debug=true (its DEBUG messages; GRPAX_DEBUG=1 keeps tracebacks)"
    ),
    "rl": Foreign(
        "MaxText's RL debug logging (debug: {rl: ...}); grpax's is debug=true (its DEBUG messages)"
    ),
    "rollout_enable_single_controller": Foreign(
        _PATHWAYS, ("false", "0", "no", "off"), "grpax runs one controller per host (jax.distributed)"
    ),
    "num_trainer_slices": Foreign(
        _PATHWAYS, ("-1",), "pass rollout_devices=M to give the sampler its own devices"
    ),
    "num_samplers_slices": Foreign(
        _PATHWAYS, ("-1",), "pass rollout_devices=M to give the sampler its own devices"
    ),
    "rollout_subslice_shape": Foreign(
        _PATHWAYS, ("",), "pass rollout_devices=M and the rollout_*_parallelism keys"
    ),
    "trainer_devices_fraction": _SAMPLER_DEVICES,
    "sampler_devices_fraction": _SAMPLER_DEVICES,
    "num_epoch": Foreign(
        "MaxText's passes over the data",
        ("1",),
        "grpax trains num_batches steps (the data repeats): pass num_batches",
    ),
    "train_fraction": Foreign(
        "MaxText's share of the train split used for training",
        ("1", "1.0"),
        "grpax trains on train_split and evaluates on eval_split: choose the splits (or pass a dataset file)",
    ),
    "test_batch_start_index": Foreign(
        "MaxText's first evaluation batch", ("0",), "grpax evaluates from the split's first question"
    ),
    "loss_algo": Foreign(
        "MaxText's loss: grpo (grpax's default) or gspo-token",
        ("grpo",),
        "for GSPO pass importance_sampling_level=sequence loss_agg_mode=sequence-mean-token-mean",
    ),
    "stop_strings": Foreign(
        "MaxText's stop strings of the rollout",
        ("", "none", "null"),
        "grpax's rollouts end at the tokenizer's end-of-turn tokens; an environment's stop strings end a tool "
        "call (environment=)",
    ),
    "reasoning_start_token": Foreign(_TAGS.why, ("<reasoning>",), _TAGS.fix),
    "reasoning_end_token": Foreign(_TAGS.why, ("</reasoning>",), _TAGS.fix),
    "solution_start_token": Foreign(_TAGS.why, ("<answer>",), _TAGS.fix),
    "solution_end_token": Foreign(_TAGS.why, ("</answer>",), _TAGS.fix),
    "chat_template_path": Foreign(
        "MaxText's GSM8K prompt (gsm8k_rl.json), which grpax's prompt_preset=maxtext renders",
        ("*gsm8k_rl.json",),
        "for another prompt pass prompt_template_path= (YAML/JSON with system_prompt, user_template)",
    ),
    "data_template_path": Foreign(
        "MaxText's GSM8K prompt (gsm8k_rl.json), which grpax's prompt_preset=maxtext renders",
        ("*gsm8k_rl.json",),
        "for another prompt pass prompt_template_path= (YAML/JSON with system_prompt, user_template)",
    ),
    "dataset_processor_path": Foreign(
        "MaxText's own process_data for a dataset's columns",
        ("",),
        "grpax reads a dataset's prompt and answer columns by name: pass prompt_field= and answer_field= (task=math "
        "or task=custom for other data, reward_functions_path= for its rewards)",
    ),
    "reasoning_start_token_in_prompt": Foreign(
        "MaxText's prompt ending in the reasoning tag",
        _FALSE,
        "pass prompt_template_path= with response_prefix: '<reasoning>' (the prompt ends with the tag and the format "
        "check reads it as the completion's start)",
    ),
    "use_agentic_rollout": Foreign(
        "Tunix's asynchronous agentic learner",
        _FALSE,
        "grpax overlaps rollouts with the update by max_staleness=1 (rl.off_policy_steps) and runs tool-using "
        "rollouts with environment=",
    ),
    "max_concurrency": Foreign(
        "Tunix's agentic rollout's requests in flight (use_agentic_rollout); grpax's engine samples max_num_seqs "
        "sequences at once"
    ),
    "reshard_chunk_size": Foreign(
        "Tunix's chunking of the weights it reshards into vLLM, which grpax does not run"
    ),
    "math_verify_timeout": Foreign(
        "MaxText's time limit of a batch's math-verify process pool; grpax's task=math checks each answer with "
        "math-verify's own limits (a check past them counts as wrong)"
    ),
    "math_verify_num_procs": Foreign(
        "MaxText's math-verify worker processes; grpax's task=math checks answers in the reward call"
    ),
    "vllm_load_format": Foreign(_CONVERTER),
    "debug_converter": Foreign(
        _CONVERTER, _FALSE, "export with grpax to_huggingface and load the folder in vLLM"
    ),
    "gcs_debug_path": Foreign(_CONVERTER),
    **{
        key: Foreign(_KERNELS)
        for key in (
            "megablox",
            "sparse_matmul",
            "use_custom_sort_vjp",
            "use_tokamax_splash",
            "sa_use_fused_bwd_kernel",
            "sa_block_q",
            "sa_block_kv",
            "sa_block_kv_compute",
            "sa_block_q_dkv",
            "sa_block_kv_dkv",
            "sa_block_kv_dkv_compute",
            "sa_block_q_dq",
            "sa_block_kv_dq",
            "use_iota_embed",
        )
    },  # fmt: skip
    "grad_dtype": Foreign(
        "MaxText's gradient dtype; grpax's gradients take the params' dtype (weight_dtype)"
    ),
    "base_emb_dim": Foreign(
        "MaxText's model width; grpax reads the model's dims from the checkpoint's config.json"
    ),
    "vocab_size": Foreign(
        "MaxText's vocabulary size; grpax reads the model's dims from the checkpoint's config.json"
    ),
    "hf_name": Foreign(
        "MaxText's pre-training input pipeline's dataset config; its RL trainer's is hf_subset"
    ),
    "logical_axis_rules": Foreign(
        "MaxText's logical-to-mesh axis rules; grpax shards by its own (grpax/models/sharding_rules.py) over the "
        "mesh keys (ici_*_parallelism, rollout_*_parallelism)"
    ),
}
