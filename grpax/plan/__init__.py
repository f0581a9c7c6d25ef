"""Capacity planning: whether a GRPO job fits its devices, and what a step costs, before any weight is read.

``compile_check`` builds the run's arrays abstractly and compiles the run's own programs (the trainer's
``make_run_update``, ``token_logprobs``, the sampler's prefill and decode) for a TPU slice (``topology``) or the
devices at hand; ``memory_estimate`` sizes the same job by formula for NVIDIA targets; ``memory_plan`` chooses the
auto keys (``remat_policy``, ``reference_memory``) from them and checks the choice before a run; ``fit_report``
prints the per-chip table and the keys to change; ``step_cost`` counts a step's FLOPs and bytes against the
chip's peaks; ``collectives`` counts the compiled programs' chip-to-chip traffic. The wing reads the trainer's
public functions and one predicate per feature (e.g. ``GRPOConfig.needs_old_logprobs``); nothing of the trainer
imports it: ``grpax train_rl`` passes ``memory_plan.fit_before_run`` to ``grpax.rl.trainer.train``.
"""
