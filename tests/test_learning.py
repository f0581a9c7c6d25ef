"""GRPO must raise the mean reward of a tiny model on a toy task that needs no download.

Task: count on from the prompt. After a prompt of random tokens, each completion token should be the previous
token plus one (mod V): prompt ``[.., 7]`` -> completion ``8 9 10 11``. The reward is the fraction of tokens that
follow this rule, so a random policy scores about 1/V and a learned one 1.0; the right first token depends on
the prompt.

The task runs through the task seam as a user's task (``task=custom``): its reward function lives in a file
written here, reads the prompt's last token from a dataset column by keyword, and scores completion texts.
"""

import jax
import jax.numpy as jnp
import numpy as np

from grpax.data.prompts import PromptPreset
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.rl.trainer import step_metrics
from grpax.sampler.keys import SamplerConfig
from grpax.tasks.custom import CustomTask
from grpax.tasks.user import load_reward_functions

V = 16


REWARD_FILE = """
def count_on(prompts, completions, last_token, **kwargs):
    scores = []
    for text, last in zip(completions, last_token):
        tokens = [int(t) for t in text.split()]
        previous = [last] + tokens[:-1]
        scores.append(sum(t == (p + 1) % 16 for t, p in zip(tokens, previous)) / len(tokens))
    return scores
"""


# The toy model: one layer, untied head, V = 16 (the toy learning tests of other files reuse it).
TOY_MODEL = ModelConfig(
    vocab_size=V,
    hidden_dim=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    tie_word_embeddings=False,
)


def toy_task(tmp_path):
    path = tmp_path / "toy_rewards.py"
    path.write_text(REWARD_FILE)
    return CustomTask(PromptPreset(system_prompt=""), load_reward_functions(str(path), ["count_on"]))


def toy_rows(prompts):
    return [
        {"prompt_ids": p, "question": " ".join(map(str, p)), "gold": "", "columns": {"last_token": p[-1]}}
        for p in prompts
    ]


def toy_scorer(task):
    """The rollout's scorer: completions as token-id texts (the toy model has no tokenizer)."""

    def score(rows, out):
        texts = [" ".join(map(str, ids)) for ids in np.asarray(out.completion_ids)]
        scores = task.score(rows, texts)
        return scores, np.asarray(scores["total"]) == 1.0

    return score


def test_grpo_raises_reward_on_toy_task(tmp_path):
    task = toy_task(tmp_path)
    cfg = TOY_MODEL
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
    update = make_update(make_train_step(cfg, grpo, optimizer, 1, schedule), grpo.num_iterations)
    sampler_cfg = SamplerConfig(max_prompt_length=8, max_completion_length=4, temperature=1.0, pad_token_id=0)
    rollout = Rollout(cfg, sampler_cfg, grpo, toy_scorer(task))
    rng = np.random.default_rng(0)
    curve = []
    for step in range(num_steps):
        prompts = [rng.integers(1, V, size=rng.integers(3, 8)).tolist() for _ in range(8)]
        rollout.update_params(state.params, step)
        batch = rollout(toy_rows(prompts), jax.random.key(step))
        state, update_metrics = update(state, batch)
        metrics = step_metrics(batch, update_metrics, {"time/train_s": 1.0, "time/step_s": 1.0})
        assert not metrics["nonfinite"] and batch.host.policy_version == step
        assert metrics["rewards/count_on/mean"] == metrics["rewards/total/mean"]  # one function, weight 1
        curve.append(metrics["rewards/total/mean"])
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    print(f"toy reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.25  # a random policy: about 1/16
    assert last > 0.6, curve
