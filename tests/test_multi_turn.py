"""Multi-turn rollouts (grpax.rl.multi_turn): observation tokens fed into the same KV cache, out of the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.multi_turn import MultiTurnConfig, encode, generate_multi_turn
from grpax.rl.train_step import compute_logprobs
from grpax.sampler.engine import SamplerConfig

ALPHABET = "0123456789+-*/()<>=abcdefghijklmnopqrstuvwxyz .,:;!?\n#@$&[]"  # ids 1..60; 0 = EOS
CFG = ModelConfig(
    vocab_size=len(ALPHABET) + 1,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    rope_theta=10000.0,
)


class CharTokenizer:
    """One token per character of ``ALPHABET``; id 0 is EOS (a special token)."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ALPHABET.index(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(ALPHABET[i - 1] if i else ("" if skip_special_tokens else "$") for i in ids)

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(r, skip_special_tokens) for r in rows]


class CountEnv:
    """Answers each turn ending in a vowel with "#k@" until its k-th turn, then ends (0.5 points per turn)."""

    stop_strings = ("a", "e", "i", "o", "u")

    def __init__(self, k):
        self.k, self.turns, self.seen = k, 0, []

    def reset(self, row):
        return None

    def step(self, text):
        self.turns += 1
        self.seen.append(text)
        if self.turns >= self.k:
            return None, 0.5, True
        return f"#{self.turns}@", 0.5, False


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)


PROMPTS = [[5, 9, 11, 3, 7, 21, 30], [1, 2], [40, 41, 42, 43, 44]]
G, T = 2, 48


def _run(params, ks, **turn):
    envs = [CountEnv(k) for k in ks]
    sc = SamplerConfig(max_prompt_length=16, max_completion_length=T, stop_token_ids=(0,), pad_token_id=0)
    out = generate_multi_turn(
        params, PROMPTS, envs, CharTokenizer(), CFG, sc, MultiTurnConfig(**turn), jax.random.key(3), G
    )
    return out, envs


def test_logprobs_equal_one_forward_over_the_final_sequence(params):
    """Cache continuation is exact: the sampler's logprob of every model token equals the trainer's over the
    final sequence (prompt, turns and observations in one forward), and observation tokens have mask 0."""
    out, envs = _run(params, [3, 2, 1, 3, 2, 3])
    assert out.completion_ids.shape == (6, T)
    ref = np.asarray(
        compute_logprobs(
            params,
            {
                "prompt_ids": jnp.asarray(out.prompt_ids),
                "prompt_mask": jnp.asarray(out.prompt_mask),
                "completion_ids": jnp.asarray(out.completion_ids),
                "completion_mask": jnp.asarray(out.completion_mask),
            },
            CFG,
            1.0,
        )
    )
    # float32 rounding of the cached decode against the full forward: the single-turn sampler on this model
    # and key differs by up to 1.6e-4 too (peaked logits, params x 15); the continuation adds nothing more.
    np.testing.assert_allclose(out.logprobs, ref, atol=2e-4)
    assert np.abs(out.logprobs - ref)[out.completion_mask == 1].mean() < 1e-5
    assert out.observation_tokens.sum() > 0 and (out.completion_mask.sum() > 0)
    tok = CharTokenizer()
    for b in range(6):
        text = out.texts[b]
        ids, mask = out.completion_ids[b], out.completion_mask[b]
        # every observation is in the sequence where it was fed, with mask 0; every other token has mask 1
        for j in range(1, out.turns[b]):
            obs = encode(tok, f"#{j}@")
            starts = [s for s in range(T - 2) if ids[s : s + 3].tolist() == obs]
            assert len(starts) == 1 and mask[starts[0] : starts[0] + 3].tolist() == [0, 0, 0]
            assert f"#{j}@" in text
        assert int(mask.sum()) + int(out.observation_tokens[b]) <= T
        assert out.observation_tokens[b] == 3 * (out.turns[b] - 1)
        np.testing.assert_array_equal(out.logprobs[b][mask == 0], 0.0)
        assert np.all(out.logprobs[b][mask == 1] < 0)


def test_rows_finish_at_different_turns(params):
    ks = [1, 2, 3, 3, 2, 1]
    out, envs = _run(params, ks)
    finished = [b for b in range(6) if not out.truncation[b]]
    assert len(finished) >= 4, out.truncation
    for b in finished:
        assert out.turns[b] == ks[b] == envs[b].turns
        assert out.finish_reason[b] == "stop"
        assert out.tool_calls[b] == ks[b] - 1
    assert len({int(out.turns[b]) for b in finished}) == 3  # 1, 2 and 3 turns in one batch
    np.testing.assert_allclose(out.env_rewards, [0.5 * e.turns for e in envs])
    # each turn the environment saw is the model's text between observations, ending in a stop string
    for b in finished:
        for turn in envs[b].seen:
            assert turn[-1] in "aeiou" or turn == envs[b].seen[-1]


def test_budgets_truncate(params):
    out, _ = _run(params, [9] * 6, max_turns=2)
    assert set(out.truncation) <= {"max_turns", "turn", "trajectory"}
    assert "max_turns" in out.truncation
    assert all(t <= 2 for t in out.turns)
    assert [f == "length" for f in out.finish_reason] == [bool(t) for t in out.truncation]
    out, _ = _run(params, [9] * 6, max_turn_tokens=2)
    for b in range(6):
        if out.truncation[b] == "turn":
            last_turn = out.completion_mask[b][: out.completion_mask[b].nonzero()[0].max() + 1]
            assert last_turn[-2:].tolist() == [1, 1]
