"""The record between rollout and update: its one check, its micro-batch split, and its abstract shapes equal
to what a real ``Rollout`` builds (what ``compile_topology`` compiles against)."""

import jax
import numpy as np
import pytest

from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.batch import Batch, completion_bucket
from grpax.rl.config import GRPOConfig
from grpax.rl.rollout import Rollout
from grpax.sampler.keys import SamplerConfig

P, G, Lp, C = 2, 3, 4, 5


def _batch(**overrides) -> Batch:
    rng = np.random.default_rng(0)
    fields = dict(
        prompt_ids=np.arange(P * Lp, dtype=np.int32).reshape(P, Lp),
        prompt_mask=np.ones((P, Lp), np.int32),
        completion_ids=rng.integers(0, 9, (P * G, C)).astype(np.int32),
        completion_mask=np.ones((P * G, C), np.int32),
        advantages=rng.normal(size=P * G).astype(np.float32),
        rollout_logprobs=np.zeros((P * G, C), np.float32),
        truncated=np.zeros(P * G, bool),
    )
    return Batch(**{**fields, **overrides})


def test_check_names_what_is_missing_or_misshapen():
    _batch().check(beta=0.0, mask_truncated_completions=True)
    with pytest.raises(ValueError, match="beta=0.04 needs the batch's ref_logprobs"):
        _batch().check(beta=0.04, mask_truncated_completions=False)
    with pytest.raises(ValueError, match="mask_truncated_completions=True needs"):
        _batch(truncated=None).check(beta=0.0, mask_truncated_completions=True)
    with pytest.raises(ValueError, match="one prompt row per group"):
        _batch(prompt_ids=np.zeros((4, Lp), np.int32), prompt_mask=np.zeros((4, Lp), np.int32)).check(
            0.0, False
        )
    with pytest.raises(ValueError, match=r"ref_logprobs is \(6, 4\), not \[6, 5\]"):
        _batch(ref_logprobs=np.zeros((P * G, C - 1), np.float32)).check(0.0, False)
    with pytest.raises(ValueError, match="no 'advantages'"):
        _batch(advantages=None).check(0.0, False)


def test_split_keeps_whole_groups_and_repeats_prompts_for_sub_groups():
    batch = _batch()
    two = batch.split(2)  # one prompt per micro-batch
    assert two.prompt_ids.shape == (2, 1, Lp) and two.completion_ids.shape == (2, G, C)
    np.testing.assert_array_equal(two.prompt_ids[1, 0], batch.prompt_ids[1])
    np.testing.assert_array_equal(two.completion_ids[1], batch.completion_ids[G:])
    assert two.ref_logprobs is None and two.host is None
    b = _batch(
        completion_ids=np.zeros((P * 4, C), np.int32),
        completion_mask=np.zeros((P * 4, C), np.int32),
        advantages=np.zeros(P * 4, np.float32),
        rollout_logprobs=None,
        truncated=None,
    )
    four = b.split(4)  # G = 4 cut in two sub-groups: each prompt row repeated twice
    assert four.prompt_ids.shape == (4, 1, Lp)
    np.testing.assert_array_equal(four.prompt_ids[:, 0], np.repeat(b.prompt_ids, 2, axis=0))
    with pytest.raises(ValueError, match="num_micro_batches=4 blocks of whole prompt groups"):
        batch.split(4)


def test_abstract_batch_is_the_rollouts_batch():
    cfg = ModelConfig(
        vocab_size=16, hidden_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    grpo = GRPOConfig(num_generations=G, beta=0.04, num_iterations=2)
    sc = SamplerConfig(max_prompt_length=8, max_completion_length=C, pad_token_id=0)

    def score(rows, out):
        return {"total": np.arange(len(rows), dtype=float)}, np.zeros(len(rows))

    params = init_params(cfg, jax.random.key(0))
    rollout = Rollout(cfg, sc, grpo, score, reference=params)
    rollout.update_params(params, 7)
    real = rollout([{"prompt_ids": [1, 2, 3]}, {"prompt_ids": [4, 5, 6, 7, 8]}], jax.random.key(1))
    assert real.host.policy_version == 7 and real.host.rewards["total"].shape == (P * G,)
    abstract = Batch.abstract(P, G, 8, C, with_ref=True, with_old=True)
    shape = lambda b: jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), b.device())  # noqa: E731
    assert shape(real) == shape(abstract)


def test_completion_bucket_is_the_longest_rounded_up_to_a_power_of_two_bucket():
    assert [completion_bucket(n, 768) for n in (0, 1, 64, 65, 128, 129, 200, 300, 513, 700, 768)] == [
        64, 64, 64, 128, 128, 256, 256, 512, 768, 768, 768,
    ]  # fmt: skip
    assert [completion_bucket(n, 256) for n in (10, 100, 200, 256)] == [64, 128, 256, 256]
    assert completion_bucket(5, 40) == 40 and completion_bucket(30, 40, minimum=8) == 32
    assert completion_bucket(3, 768, minimum=0) == 768  # trimming off
    # few shapes: every length of a C = 768 run lands in one of 5 buckets
    assert {completion_bucket(n, 768) for n in range(769)} == {64, 128, 256, 512, 768}


def test_trim_completions_cuts_only_padding():
    mask = np.zeros((P * G, C), np.int32)
    mask[:, :3] = 1
    batch = _batch(completion_mask=mask, ref_logprobs=np.ones((P * G, C), np.float32))
    trimmed = batch.trim_completions(3)
    for name in ("completion_ids", "completion_mask", "rollout_logprobs", "ref_logprobs"):
        np.testing.assert_array_equal(getattr(trimmed, name), getattr(batch, name)[:, :3])
    assert trimmed.old_logprobs is None and trimmed.prompt_ids is batch.prompt_ids
    with pytest.raises(AssertionError, match="would cut completion tokens"):
        batch.trim_completions(2)


def test_split_spreads_fewer_prompts_than_shards():
    """2 prompts x G = 4 over 4 devices: each prompt row twice, each copy answered by 2 of its completions."""
    b = _batch(
        completion_ids=np.arange(P * 4 * C, dtype=np.int32).reshape(P * 4, C),
        completion_mask=np.ones((P * 4, C), np.int32),
        advantages=np.zeros(P * 4, np.float32),
        rollout_logprobs=None,
        truncated=None,
    )
    spread = b.split(1, prompt_shards=4)
    np.testing.assert_array_equal(spread.prompt_ids[0], np.repeat(b.prompt_ids, 2, axis=0))
    np.testing.assert_array_equal(spread.completion_ids[0], b.completion_ids)
    assert b.split(2, prompt_shards=2).prompt_ids.shape == (2, 2, Lp)  # 1 prompt x 2 copies per micro-batch
    assert b.split(1, prompt_shards=8).prompt_ids.shape == (1, 8, Lp)  # G / 4 = 1 completion per copy
    assert _batch().split(1, prompt_shards=4).prompt_ids.shape == (1, P, Lp)  # G = 3: cannot spread


def test_rollout_trims_the_completion_axis_to_the_longest_bucket():
    """Rows that stop early: the batch's completion axis is the longest completion's bucket, not C."""
    cfg = ModelConfig(
        vocab_size=16, hidden_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64
    )
    grpo = GRPOConfig(num_generations=G, beta=0.04)
    sc = SamplerConfig(
        max_prompt_length=8, max_completion_length=40, pad_token_id=0, stop_token_ids=(1, 2, 3, 4)
    )
    params = init_params(cfg, jax.random.key(0))
    score = lambda rows, out: ({"total": np.arange(len(rows), dtype=float)}, np.zeros(len(rows)))  # noqa: E731
    rows = [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [8, 9, 10, 11, 12]}]
    batches = {}
    for bucket in (4, 0):
        rollout = Rollout(cfg, sc, grpo, score, reference=params, min_completion_bucket=bucket)
        rollout.update_params(params, 0)
        batches[bucket] = rollout(rows, jax.random.key(1))
    full, trimmed = batches[0], batches[4]
    longest = int(full.host.completion_lengths.max())
    assert full.completion_ids.shape[1] == 40 and longest < 32  # the rows stopped early
    assert trimmed.completion_ids.shape[1] == completion_bucket(longest, 40, 4) < 40
    width = trimmed.completion_ids.shape[1]
    for name in ("completion_ids", "completion_mask", "rollout_logprobs", "ref_logprobs"):
        np.testing.assert_allclose(
            np.asarray(getattr(trimmed, name)), np.asarray(getattr(full, name))[:, :width]
        )
    assert not np.asarray(full.completion_mask)[:, width:].any()


def test_counted_length_is_the_last_counted_column_not_the_count():
    from grpax.rl.batch import counted_length

    # A multi-turn row: model tokens, an observation (0s), more model tokens; a short single-turn row.
    mask = np.asarray([[1, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]], np.int32)
    assert counted_length(mask) == 5  # the count of 1s (3) would cut the row's last turn
    assert counted_length(np.zeros((2, 4), np.int32)) == 0
    assert counted_length(np.ones((1, 4), np.int32)) == 4
