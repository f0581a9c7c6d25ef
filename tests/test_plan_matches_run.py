"""The plan compiles the run's program: for every combination of num_iterations, max_staleness, beta and LoRA,
the update ``compile_topology`` / ``check_fit`` lower (``compile_check.build_job``: abstract state and batch) is
the very program the run lowers on the batch its ``Rollout`` builds (issue 40 item 4: with max_staleness > 0 the
rollout adds ``old_logprobs`` and the planner once compiled an update without them)."""

import itertools

import jax
import numpy as np
import pytest

from grpax import sharding
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.plan.compile_check import build_job
from grpax.rl import trainer
from grpax.rl.policy import Policy
from grpax.rl.rollout import Rollout
from grpax.rl.train_config import TrainConfig

TINY = ModelConfig(
    vocab_size=64, hidden_dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    tie_word_embeddings=False, eos_token_ids=(1,),
)  # fmt: skip
P_LEN, C = 8, 8  # the prompts fill the longest prompt bucket; C is below the smallest completion bucket


def _score(rows, out):
    n = len(rows)
    return {"total": np.arange(n, dtype=float) % 3}, np.zeros(n)


def _programs(cfg: TrainConfig) -> tuple[str, str]:
    """(the run's update lowered on its rollout's batch, the planner's lowered on its abstract job)."""
    grpo = cfg.grpo()
    mesh, rollout_mesh = sharding.create_meshes(cfg.mesh())
    params = sharding.shard_params(init_params(TINY, jax.random.key(0)), TINY, mesh)
    policy = Policy(cfg.lora(), params, "", "", cfg.lora_sampler, TINY) if cfg.lora_rank else Policy()
    trainable = policy.init_trainable(params, TINY, mesh, cfg.seed)
    state, train_step = trainer._init_state(cfg, grpo, trainable, TINY, mesh, policy)
    reference = (policy.base if policy.lora else params) if grpo.beta > 0 else None
    sampler_cfg = cfg.sampler_config(TINY.eos_token_ids, 0)
    rollout = Rollout(
        TINY, sampler_cfg, grpo, _score, mesh=mesh, rollout_mesh=rollout_mesh, reference=reference,
        num_micro_batches=cfg.micro_batches,
    )  # fmt: skip
    rollout.update_params(policy.sampler_params(state.params), 0)
    prompts = [{"prompt_ids": list(range(2, 2 + P_LEN))} for _ in range(cfg.batch_size)]
    batch = rollout(prompts, jax.random.key(1)).device()

    job = build_job(cfg, mesh, rollout_mesh, TINY)
    with jax.set_mesh(mesh):
        if policy.lora is None:
            run = train_step.lower(state, batch)
            plan = job.train_step.lower(job.state, job.batch)
        else:  # the base is an argument of the adapters' update (make_train_step's partial)
            run = train_step.func.lower(state, batch, base=train_step.keywords["base"])
            plan = job.train_step.func.lower(job.state, job.batch, base=job.base)
    return run.as_text(), plan.as_text()


@pytest.mark.parametrize(
    "num_iterations,max_staleness,beta,lora_rank",
    list(itertools.product((1, 2), (0, 1), (0.0, 0.04), (0, 4))),
)
def test_the_planner_lowers_the_update_the_run_lowers(num_iterations, max_staleness, beta, lora_rank):
    cfg = TrainConfig(
        model_name="", load_parameters_path="unused", batch_size=2, num_generations=2,
        max_prefill_predict_length=P_LEN, max_target_length=P_LEN + C, num_iterations=num_iterations,
        max_staleness=max_staleness, beta=beta, lora_rank=lora_rank,
    )  # fmt: skip
    run, plan = _programs(cfg)
    assert run == plan
    # The old logprobs reach the program exactly when the run's batch carries them.
    assert cfg.needs_old_logprobs == (num_iterations > 1 or max_staleness > 0)
