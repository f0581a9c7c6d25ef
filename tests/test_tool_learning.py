"""GRPO must teach a tiny model to use a tool when the right answer is only reachable through it.

Each row hides a secret letter (a column only the environment and the reward read; the prompt is random
letters). Turns are one token long (``max_turn_tokens=1``). The model's first token may call the tool, ``?``
(the environment's stop string): the observation is the secret, and the model's next token is its answer, 1
point when it is the secret. An answer without looking the secret up (a first token that is a letter) is not
accepted: the answer is only reachable through the tool. A random policy calls the tool in about 1/8 of its
trajectories and then copies the observation about 1/8 of the time (reward ~1/64); GRPO must raise both the
tool-use rate and the reward above 0.6, through the multi-turn rollout (observations fed into the KV cache, out
of the loss) and the usual update.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.data.prompts import PromptPreset
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.multi_turn import MultiTurnRollout
from grpax.rl.optim import optimizer_from_config
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.sampler.keys import SamplerConfig
from grpax.tasks.environment import MultiTurnConfig

LETTERS = "?abcdef"  # ids 1..7; 0 = EOS; "?" calls the tool
SECRETS = "abcdef"


class LetterTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [LETTERS.index(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(LETTERS[i - 1] if i else ("" if skip_special_tokens else "$") for i in ids)

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(r, skip_special_tokens) for r in rows]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        return messages[-1]["content"]  # the prompt letters alone


class SecretTool:
    """The tool answers "?" with the row's secret; a turn without a call ends the trajectory."""

    stop_strings = ("?",)

    def reset(self, row):
        self.secret = row["columns"]["secret"]
        return None

    def step(self, text):
        if text.endswith("?"):
            return self.secret, 0.0, False
        return None, 0.0, True


class SecretTask:
    """The reward: 1 point when the answer (the token after the tool's observation) is the secret."""

    preset = PromptPreset(system_prompt="")

    def score(self, rows, completions):
        points = []
        for row, text in zip(rows, completions, strict=True):
            points.append(float(text.startswith("?") and text[2:3] == row["columns"]["secret"]))
        return {"secret": points, "total": list(points)}

    def step_correct(self, rows, completions, scores):
        return [bool(p > 0) for p in scores["secret"]]


@pytest.mark.slow  # about 60 s on 2 busy CPU cores
def test_grpo_learns_to_call_the_tool():
    cfg = ModelConfig(
        vocab_size=len(LETTERS) + 1,
        hidden_dim=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
        tie_word_embeddings=False,
    )
    num_steps = 60
    grpo = GRPOConfig(
        num_generations=8,
        beta=0.0,
        learning_rate=5e-3,  # 1e-2 learned too (tool use 0.88 by step 35), then collapsed to no calls
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
    sampler_cfg = SamplerConfig(
        max_prompt_length=8, max_completion_length=4, temperature=1.0, stop_token_ids=(0,), pad_token_id=0
    )
    turns = MultiTurnConfig(max_turns=2, max_turn_tokens=1, max_observation_tokens=1)
    rollout = MultiTurnRollout(cfg, sampler_cfg, grpo, SecretTask(), LetterTokenizer(), SecretTool, turns)
    rng = np.random.default_rng(0)
    tool_use, reward = [], []
    for step in range(num_steps):
        rows = [
            {
                "question": "".join(rng.choice(list(SECRETS), size=rng.integers(3, 8))),
                "gold": "",
                "columns": {"secret": str(rng.choice(list(SECRETS)))},
            }
            for _ in range(8)
        ]
        rollout.update_params(state.params, step)
        batch = rollout(rows, jax.random.key(step))
        state, metrics = update(state, batch)
        assert not metrics["nonfinite"]
        extra = batch.host.extra
        tool_use.append(extra["multi_turn/tool_use_rate"])
        reward.append(float(np.nanmean(batch.host.rewards["total"])))
    first = np.mean(tool_use[:3]), np.mean(reward[:3])  # the policy before it has learned (3 steps)
    last = np.mean(tool_use[-5:]), np.mean(reward[-5:])
    print(f"tool use {first[0]:.3f} -> {last[0]:.3f}, reward {first[1]:.3f} -> {last[1]:.3f}")
    assert first[0] < 0.25 and first[1] < 0.25
    assert last[0] > 0.6 and last[1] > 0.6, (tool_use, reward)
