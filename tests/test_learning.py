"""GRPO must raise the mean reward of a tiny model on a toy task that needs no download.

Task: count on from the prompt. After a prompt of random tokens, each completion token should be the previous
token plus one (mod V): prompt ``[.., 7]`` -> completion ``8 9 10 11``. The reward is the fraction of tokens that
follow this rule, so a random policy scores about 1/V and a learned one 1.0; the right first token depends on
the prompt.
"""

import jax
import jax.numpy as jnp
import numpy as np

from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import optimizer_from_config
from grpax.rl.train_step import TrainState, make_train_step
from grpax.rl.trainer import grpo_step
from grpax.sampler.engine import SamplerConfig

V = 16


def toy_rewards(prompts, out, G):
    completions = np.asarray(out.completion_ids)
    last = np.asarray([p[-1] for p in prompts for _ in range(G)])
    previous = np.concatenate([last[:, None], completions[:, :-1]], axis=1)
    return {"total": (completions == (previous + 1) % V).mean(axis=1)}


def test_grpo_raises_reward_on_toy_task():
    cfg = ModelConfig(
        vocab_size=V,
        hidden_dim=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
        tie_word_embeddings=False,
    )
    num_steps = 50
    grpo = GRPOConfig(
        num_generations=8,
        beta=0.0,
        learning_rate=1e-2,
        warmup_ratio=0.0,
        lr_schedule="constant",
        max_grad_norm=1.0,
        weight_decay=0.0,
        temperature=1.0,
    )
    optimizer, schedule = optimizer_from_config(grpo, num_steps)
    params = init_params(cfg, jax.random.key(0))
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    train_step = make_train_step(cfg, grpo, optimizer, 1, schedule)
    sampler_cfg = SamplerConfig(max_prompt_length=8, max_completion_length=4, temperature=1.0, pad_token_id=0)
    rng = np.random.default_rng(0)
    curve = []
    for step in range(num_steps):
        prompts = [rng.integers(1, V, size=rng.integers(3, 8)).tolist() for _ in range(8)]
        state, out, scores, metrics = grpo_step(
            state,
            None,
            prompts,
            lambda out, prompts=prompts: toy_rewards(prompts, out, grpo.num_generations),
            model_cfg=cfg,
            sampler_cfg=sampler_cfg,
            grpo=grpo,
            train_step=train_step,
            num_micro_batches=1,
            key=jax.random.key(step),
        )
        assert not metrics["nonfinite"]
        curve.append(metrics["rewards/total/mean"])
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    print(f"toy reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.25  # a random policy: about 1/16
    assert last > 0.6, curve
