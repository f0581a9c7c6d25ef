"""``grpax train_rl``: GRPO on a task (GSM8K by default: the main job). Thin wrapper over ``grpax.rl.trainer.train``."""

from __future__ import annotations

from grpax.plan import memory_plan
from grpax.rl.results import format_before_after
from grpax.rl.resume import RESUME_FIXED_KEYS, RunPaths
from grpax.rl.train_config import TrainConfig, validate
from grpax.rl.trainer import train

CONFIG = TrainConfig
DESCRIPTION = (
    "GRPO training: sample num_generations completions per prompt with the KV-cache sampler, score them with "
    "the task's reward functions (task=gsm8k by default, math, or custom: your data and reward_functions_path), "
    "update the policy with the clipped GRPO objective and a KL penalty to the frozen "
    "reference; evaluate before and after (num_test_batches=0: no evaluation), with 95% intervals and a paired "
    "sign test of the change; checkpoint the actor under "
    "<base_output_directory>/<run_name>/checkpoints/actor/<step>/model_params. Running again with the same "
    f"run_name resumes from the latest checkpoint (a changed {', '.join(RESUME_FIXED_KEYS)} is refused; other "
    "changes are logged in config_changes.jsonl); one job at a time per run folder (run.lock), and a folder that "
    "is not a grpax run is never written; export_hf=FOLDER "
    "also exports the actor in Hugging Face format. MaxText aliases: grpo_beta, grpo_epsilon, adam_b1, adam_b2, "
    "gradient_clipping_threshold, data_shuffle_seed, rl.<key>. compile_topology=v6e-8 (any TPU slice; the tpu "
    "extra) compiles the whole job for that slice without a TPU or the weights, prints each chip's memory and "
    "whether it fits, and trains nothing."
)

INTERRUPT_HINT = "; the checkpoints saved so far are kept: the same command resumes from the last one"


def interrupt_hint(config: TrainConfig) -> str:
    """What an interrupted run left: its saved steps to resume from, or none (the folder removed or kept)."""
    paths = RunPaths.of(config)
    actor = paths.checkpoints / "actor"
    steps = sorted(int(p.name) for p in actor.iterdir() if p.name.isdigit()) if actor.is_dir() else []
    if steps:
        return f"; the checkpoints saved so far are kept (last: step {steps[-1]}): the same command resumes from it"
    if paths.run_dir.exists():
        return f"; no checkpoint had been saved yet: the same command starts {paths.run_dir} afresh"
    return f"; no checkpoint had been saved yet, and {paths.run_dir} was removed"


def run(config: TrainConfig) -> int:
    if config.compile_topology:  # compile the job for a TPU slice (NVIDIA: an estimate), train nothing
        validate(config)
        return memory_plan.compile_topology(config)
    try:
        results = train(config, fit=memory_plan.fit_before_run)
    except KeyboardInterrupt as e:  # said by grpax.cli.main after "interrupted (SIGINT)"
        e.hint = interrupt_hint(config)
        raise
    print("\n" + format_before_after(results["before"], results["after"], results.get("paired")))
    print(f"\nrun folder:        {results['run_dir']}")
    print(f"actor checkpoint:  {results['actor_path'] or 'none (enable_checkpointing=false)'}")
    print(
        f"metrics:           {results['run_dir']}/metrics.jsonl (TensorBoard: {results['run_dir']}/tensorboard)"
    )
    if results.get("hf_path"):
        print(f"Hugging Face:      {results['hf_path']}")
    elif results["actor_path"]:
        print(
            f"export with:       grpax to_huggingface model_name={config.model_name} "
            f"load_parameters_path={results['actor_path']} base_output_directory=<folder>"
        )
    return 0
