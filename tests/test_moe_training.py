"""GRPO trains a tiny mixture of experts: the toy task of tests/test_learning.py learned with and without routing
replay, and LoRA on a mixture of experts (adapters on the attention, or on the attention and every expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_learning import TOY_MODEL, V, toy_rows, toy_scorer, toy_task

from grpax.models import lora as lora_lib
from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.sampler.keys import SamplerConfig

# The toy model of tests/test_learning.py with its MLP made 4 experts, 2 per token (Qwen3-MoE's block).
TOY_MOE = TOY_MODEL.replace(
    family="qwen3_moe",
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_mlp_dim=32,
    norm_topk_prob=True,
)


@pytest.mark.slow
@pytest.mark.parametrize("router_replay", ["none", "replay"])
def test_grpo_raises_reward_of_a_mixture_of_experts_on_toy_task(tmp_path, router_replay):
    """50 steps of count-on (the dense toy test's task and keys): from about 1/16 to above 0.6; with replay the
    update's pi_old is the sampler's (mismatch under 1e-4 nats) and its router disagreement is reported."""
    task, num_steps = toy_task(tmp_path), 50
    grpo = GRPOConfig(
        num_generations=8, beta=0.0, learning_rate=1e-2, warmup_ratio=0.0, lr_schedule="constant",
        max_grad_norm=1.0, weight_decay=0.0, temperature=1.0, router_replay=router_replay,
    )  # fmt: skip
    optimizer, schedule = optimizer_from_config(grpo, num_steps)
    params = init_params(TOY_MOE, jax.random.key(0))
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    update = make_update(make_train_step(TOY_MOE, grpo, optimizer, 1, schedule), grpo.num_iterations)
    sampler_cfg = SamplerConfig(
        max_prompt_length=8, max_completion_length=4, temperature=1.0, pad_token_id=0,
        record_routes=router_replay != "none",
    )  # fmt: skip
    rollout = Rollout(TOY_MOE, sampler_cfg, grpo, toy_scorer(task))
    rng = np.random.default_rng(0)
    curve, mismatch = [], []
    for step in range(num_steps):
        prompts = [rng.integers(1, V, size=rng.integers(3, 8)).tolist() for _ in range(8)]
        rollout.update_params(state.params, step)
        batch = rollout(toy_rows(prompts), jax.random.key(step))
        state, metrics = update(state, batch)
        assert not metrics["nonfinite"]
        assert ("router/disagreement_mean" in metrics) == (router_replay != "none")
        curve.append(float(np.mean(batch.host.rewards["total"])))
        mismatch.append(float(metrics["mismatch/logprob_diff_max"]))
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    print(f"toy MoE reward ({router_replay}): first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.25
    assert last > 0.6, curve
    if router_replay == "replay":
        assert max(mismatch) <= 1e-4, mismatch


@pytest.mark.parametrize(
    "modules", [("q_proj", "v_proj"), lora_lib.ALL_MODULES], ids=["attention", "experts"]
)
def test_lora_on_a_mixture_of_experts(modules):
    """Adapters start as the base (B = 0); an update trains the adapters only, the experts' when targeted
    ([L, E, D, r] and [L, E, r, F] per projection); the adapted forward equals the merged weights'."""
    cfg = TOY_MOE.replace(num_layers=2)
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0, target_modules=modules)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, V)
    assert np.array_equal(
        np.asarray(forward(lora_lib.apply(base, adapters, lora), tokens, cfg)[0]),
        np.asarray(forward(base, tokens, cfg)[0]),
    )
    experts = modules == lora_lib.ALL_MODULES
    assert ("expert_gate" in adapters["layers"]) == experts and "w_gate" not in adapters["layers"]
    if experts:
        assert adapters["layers"]["expert_gate"]["a"].shape == (2, 4, 32, 4)
        assert adapters["layers"]["expert_down"]["b"].shape == (2, 4, 4, 32)
    grpo = GRPOConfig(num_generations=2, beta=0.0, temperature=1.0, max_grad_norm=0.0)
    optimizer = optax.sgd(0.5)
    step = make_train_step(cfg, grpo, optimizer, num_micro_batches=1, lora=lora, base=base)
    batch = {
        "prompt_ids": np.array([[3, 4, 5], [6, 7, 8]], np.int32),
        "prompt_mask": np.ones((2, 3), np.int32),
        "completion_ids": np.asarray(jax.random.randint(jax.random.key(3), (4, 5), 0, V), np.int32),
        "completion_mask": np.ones((4, 5), np.int32),
        "advantages": np.array([1.0, -1.0, -1.0, 1.0], np.float32),
    }
    start = jax.tree.map(np.array, adapters)  # the step donates its state
    state = TrainState(params=adapters, opt_state=optimizer.init(adapters), step=jnp.zeros((), jnp.int32))
    state, metrics = step(state, batch)
    assert not bool(metrics["nonfinite"])
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), state.params, start)
    assert all(m["b"] for m in moved["layers"].values()), moved  # every adapter's B left 0
    adapted = lora_lib.apply(base, state.params, lora)
    merged = lora_lib.merge(base, state.params, lora)
    np.testing.assert_allclose(
        np.asarray(forward(adapted, tokens, cfg)[0]),
        np.asarray(forward(merged, tokens, cfg)[0]),
        atol=1e-5,
        rtol=0,
    )
    assert not np.array_equal(
        np.asarray(forward(merged, tokens, cfg)[0]), np.asarray(forward(base, tokens, cfg)[0])
    )
