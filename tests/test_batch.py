"""The record between rollout and update: its one check, its micro-batch split, and its abstract shapes equal
to what a real ``Rollout`` builds (what ``compile_topology`` compiles against)."""

import jax
import numpy as np
import pytest

from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.batch import Batch
from grpax.rl.config import GRPOConfig
from grpax.rl.rollout import Rollout
from grpax.sampler.engine import SamplerConfig

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
