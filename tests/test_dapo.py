"""DAPO's data-side tools: dynamic sampling drops exactly the zero-std groups and refills the batch, and the
soft overlong punishment (eq. 13) at the edges of its ramp; both inside a ``Rollout`` and its update on a tiny
model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.config import ConfigError
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.dapo import overlong_penalty, pick_groups, take_groups, zero_std_groups
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.rl.trainer import step_metrics
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.requests import GenerateOutput

G = 2
C = 6  # max_completion_length


def test_overlong_penalty_at_the_edges():
    # L_max = 6, L_cache = 4: free up to 2 tokens, then -(|y| - 2) / 4 points, -1 past 6; times the factor 0.5
    lengths = [0, 2, 3, 5, 6, 7]
    expected = [0.0, 0.0, -0.125, -0.375, -0.5, -0.5]
    np.testing.assert_array_equal(overlong_penalty(lengths, 6, 4, 0.5), expected)
    # L_cache = L_max: the ramp starts at 0 tokens; 1 token costs 1/6
    assert overlong_penalty([1], 6, 6)[0] == pytest.approx(-1 / 6)


def test_zero_std_groups_and_pick():
    nan = float("nan")
    flags = zero_std_groups([1, 1, 0, 2, nan, 3, nan, nan, 5, 5.0000001], G)
    assert flags.tolist() == [True, False, True, True, False]  # one valid value, or none, is no signal
    groups, filled = pick_groups(np.array([True, False, True, False, True, True, False]), 3)
    assert groups.tolist() == [1, 3, 6] and filled == 0
    groups, filled = pick_groups(np.array([True, False, True]), 3)
    assert groups.tolist() == [1, 0, 2] and filled == 2


def test_dynamic_sampling_needs_a_second_batch():
    with pytest.raises(ConfigError, match="dynamic_sampling_max_batches=1: expected >= 2 with filter_zero"):
        GRPOConfig(filter_zero_std_groups=True, dynamic_sampling_max_batches=1)


def _setup(**grpo_keys):
    cfg = ModelConfig(
        vocab_size=16,
        hidden_dim=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
        tie_word_embeddings=False,
    )
    grpo = GRPOConfig(num_generations=G, beta=0.0, learning_rate=1e-3, warmup_ratio=0.0, **grpo_keys)
    optimizer, schedule = optimizer_from_config(grpo, 4)
    params = init_params(cfg, jax.random.key(0))
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    sampler_cfg = SamplerConfig(max_prompt_length=8, max_completion_length=C, temperature=1.0, pad_token_id=0)
    return cfg, grpo, state, make_train_step(cfg, grpo, optimizer, 1, schedule), sampler_cfg


def _score(rows, out):
    """A prompt starting with an even token gets 1.0 for each completion (zero std); an odd one 0, 1 (signal)."""
    first = np.asarray([row["prompt_ids"][0] for row in rows])
    varied = np.tile(np.arange(G, dtype=np.float64), len(rows) // G)
    scores = {"total": np.where(first % 2 == 0, 1.0, varied), "first": first.astype(np.float64)}
    return scores, scores["total"] > 0


def _rows(prompts):
    return [{"prompt_ids": p} for p in prompts]


def _run(prompts, key, extra=None, **keys):
    """One rollout of ``prompts`` (more batches from ``extra``) and its update: (batch, metrics)."""
    cfg, grpo, state, train_step, sampler_cfg = _setup(**keys)
    rollout = Rollout(cfg, sampler_cfg, grpo, _score)
    rollout.update_params(state.params, 0)
    batch = rollout(_rows(prompts), key, extra_rows=extra)
    _, update_metrics = make_update(train_step, grpo.num_iterations)(state, batch)
    return batch, step_metrics(batch, update_metrics, {"time/train_s": 1.0, "time/step_s": 1.0})


def _step(batches, max_batches, **keys):
    queue = [_rows(b) for b in batches[1:]]
    extra = iter(queue)
    batch, metrics = _run(
        batches[0],
        jax.random.key(1),
        extra,
        filter_zero_std_groups=True,
        dynamic_sampling_max_batches=max_batches,
    )
    return (batch, metrics), [[row["prompt_ids"] for row in b] for b in extra]


def _prompt_rows(batch):
    return [
        ids[mask.astype(bool)].tolist()
        for ids, mask in zip(np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask), strict=True)
    ]


def test_dynamic_sampling_drops_exactly_the_zero_std_groups_and_refills():
    # 4 prompts per batch: 2 zero-std groups (even first token) in the first, 1 in the second.
    first = [[2, 5], [3, 4, 4], [4, 1], [5]]
    second = [[7, 1, 1, 1], [6, 2], [9, 9], [11]]
    (batch, metrics), left = _step([first, second, [[13]] * 4], max_batches=3)
    assert left == [[[13]] * 4]  # the batch was full after two: the third was never sampled
    # The kept groups, in sampling order: the odd prompts of batch 1, then the first two odd ones of batch 2
    assert _prompt_rows(batch) == [[3, 4, 4], [5], [7, 1, 1, 1], [9, 9]]
    scores = batch.host.rewards
    assert scores["first"].tolist() == [3, 3, 5, 5, 7, 7, 9, 9] and scores["total"].tolist() == [0, 1] * 4
    assert batch.host.correct.tolist() == [0, 1] * 4  # correctness travels with its rows
    assert metrics["zero_std_fraction"] == 0.5  # of the first batch, logged every step
    assert metrics["dynamic_sampling/batches"] == 2
    assert metrics["dynamic_sampling/dropped_groups"] == 3
    assert metrics["dynamic_sampling/filled_groups"] == 0
    assert metrics["advantages/abs_max"] > 0 and not metrics["nonfinite"]


def test_dynamic_sampling_cap_fills_with_zero_std_groups():
    first = [[2], [3], [4], [6]]  # 1 group with signal
    second = [[8], [10], [5], [12]]  # 1 more
    (batch, metrics), _ = _step([first, second], max_batches=2)
    assert _prompt_rows(batch) == [[3], [5], [2], [4]]  # 2 with signal, then the first zero-std ones
    assert metrics["dynamic_sampling/filled_groups"] == 2 and metrics["dynamic_sampling/dropped_groups"] == 4


def test_overlong_penalty_is_added_to_the_rewards_of_a_rollout():
    batch, metrics = _run(
        [[1, 2], [3]], jax.random.key(2), overlong_buffer_length=4, overlong_penalty_factor=2.0
    )
    scores = batch.host.rewards
    lengths = np.asarray(batch.completion_mask).sum(axis=1)
    expected = np.where(lengths <= 2, 0.0, -(lengths - 2) / 4 * 2.0)  # no stop tokens: |y| <= L_max = 6
    np.testing.assert_allclose(scores["overlong"], expected)
    np.testing.assert_allclose(scores["total"], np.array([0.0, 1.0, 0.0, 1.0]) + expected)
    assert metrics["rewards/overlong/mean"] == pytest.approx(expected.mean())


def test_taken_groups_keep_each_tokens_policy_version():
    # A kept engine's rounds record each token's params version; pi_old is computed per version from them, so the
    # groups taken from several rounds keep their rows' versions (dropped, pi_old fell back to one version).
    def out(first_version, n):
        rows = 2 * G
        versions = np.full((rows, C), first_version, np.int32)
        versions[:, n:] = -1
        return GenerateOutput(
            prompt_ids=np.ones((2, 3), np.int32), prompt_mask=np.ones((2, 3), np.int32),
            completion_ids=np.ones((rows, C), np.int32), completion_mask=(versions >= 0).astype(np.int32),
            logprobs=np.zeros((rows, C), np.float32), lengths=np.full((rows,), n, np.int32),
            finish_reason=["stop"] * rows, prompt_indices=np.arange(2, dtype=np.int32), policy_versions=versions,
        )  # fmt: skip

    taken = take_groups([out(3, 2), out(4, 5)], np.array([1, 2]), G, 0)
    assert taken.policy_versions[:, 0].tolist() == [3, 3, 4, 4]
    assert (taken.policy_versions[:G, 2:] == -1).all() and (taken.policy_versions[G:, :5] == 4).all()
