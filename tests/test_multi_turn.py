"""Multi-turn rollouts (grpax.sampler.multi_turn's sampling, grpax.rl.multi_turn's scoring): observation tokens fed into the same KV cache, out of the loss."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.backends.cpu import build
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import make_lr_schedule, make_optimizer
from grpax.rl.train_step import TrainState, compute_logprobs, make_train_step
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.multi_turn import (
    MultiTurnConfig,
    encode,
    generate_multi_turn,
    pause_table,
    stop_string_end,
)
from grpax.tasks.environment import ToolEnvironment

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
        return [ALPHABET.index(c if c in ALPHABET else "?") + 1 for c in text.lower()]

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


def _run(params, ks, backend="auto", **turn):
    envs = [CountEnv(k) for k in ks]
    sc = SamplerConfig(
        max_prompt_length=16, max_completion_length=T, stop_token_ids=(0,), pad_token_id=0, backend=backend
    )
    out = generate_multi_turn(
        params, PROMPTS, envs, CharTokenizer(), CFG, sc, MultiTurnConfig(**turn), jax.random.key(3), G
    )
    return out, envs


# The CPU backend's kernels (where they build and JAX runs on CPU) and XLA's ops (accelerators) alike.
CPU_BACKEND = jax.default_backend() == "cpu" and build.available()
BACKENDS = [pytest.param("cpu", marks=pytest.mark.skipif(not CPU_BACKEND, reason="no CPU backend")), "xla"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_equal_one_forward_over_the_final_sequence(params, backend):
    """Cache continuation is exact: the sampler's logprob of every model token equals the trainer's over the
    final sequence (prompt, turns and observations in one forward), and observation tokens have mask 0."""
    out, envs = _run(params, [3, 2, 1, 3, 2, 3], backend)
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


@functools.cache
def _train_step():
    grpo = GRPOConfig(beta=0.04, temperature=1.0, max_grad_norm=0.0, weight_decay=0.0, num_generations=G)
    schedule = make_lr_schedule(1e-2, 10, schedule="constant")
    optimizer = make_optimizer(schedule, 10, weight_decay=0.0)
    return optimizer, make_train_step(CFG, grpo, optimizer, num_micro_batches=1, lr_schedule=schedule)


def _step(params, batch):
    optimizer, step = _train_step()
    copy = jax.tree.map(jnp.copy, params)
    state = TrainState(params=copy, opt_state=optimizer.init(copy), step=jnp.zeros((), jnp.int32))
    state, metrics = step(state, batch)
    return jax.tree.map(np.asarray, state.params), metrics


def test_observation_tokens_are_out_of_the_loss_and_the_kl(params):
    """Observation tokens have mask 0 and no gradient: what the batch holds at them (reference, old and
    sampler logprobs) does not change the step, and a step whose only tokens are observations changes nothing."""
    out, _ = _run(params, [3, 2, 3, 3, 2, 3])
    obs = (out.completion_mask == 0) & (np.arange(T)[None] < (out.observation_tokens + out.lengths)[:, None])
    assert obs.sum() > 0
    batch = {
        "prompt_ids": out.prompt_ids,
        "prompt_mask": out.prompt_mask,
        "completion_ids": out.completion_ids,
        "completion_mask": out.completion_mask,
        "advantages": np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], np.float32),
        "rollout_logprobs": out.logprobs,
        "truncated": np.array([bool(t) for t in out.truncation]),
    }
    batch["ref_logprobs"] = (out.logprobs - 0.1 * out.completion_mask).astype(np.float32)
    batch["old_logprobs"] = out.logprobs
    moved, metrics = _step(params, batch)
    assert float(metrics["kl"]) > 0
    changed = {k: np.where(obs, -50.0, v).astype(np.float32) for k, v in batch.items() if "logprobs" in k}
    moved_again, _ = _step(params, {**batch, **changed})
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(moved_again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(
        np.abs(a - np.asarray(p)).max() > 0
        for a, p in zip(jax.tree.leaves(moved), jax.tree.leaves(params), strict=True)
    )
    # rewards only on observation tokens: the model tokens masked, the advantages large
    only_obs = {
        **batch,
        "completion_mask": np.zeros_like(out.completion_mask),
        "advantages": batch["advantages"] * 9,
    }
    still, metrics = _step(params, only_obs)
    assert float(metrics["loss"]) == 0.0
    for a, p in zip(jax.tree.leaves(still), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(p))


class FlakyTools(ToolEnvironment):
    """Every turn ending in a vowel calls a tool that raises (odd turns) or hangs (even turns)."""

    stop_strings = ("a", "e", "i", "o", "u")

    def __init__(self):
        def boom(arg):
            raise ValueError("no")

        def hang(arg):
            time.sleep(2)

        super().__init__({"boom": boom, "hang": hang}, timeout_s=0.05)
        self.stop_strings = FlakyTools.stop_strings

    def parse(self, text):
        return ("boom" if self.calls % 2 == 0 else "hang"), text

    def step(self, text):
        out = super().step(text)
        self.observations = [*getattr(self, "observations", []), out[0]]
        return out


def test_tools_that_raise_or_hang_are_error_observations_in_the_rollout(params):
    envs = [FlakyTools() for _ in range(6)]
    sc = SamplerConfig(max_prompt_length=16, max_completion_length=T, stop_token_ids=(0,), pad_token_id=0)
    turn_cfg = MultiTurnConfig(max_turns=3, max_observation_tokens=20)  # observations cut to 20 tokens
    out = generate_multi_turn(params, PROMPTS, envs, CharTokenizer(), CFG, sc, turn_cfg, jax.random.key(3), G)
    assert out.tool_calls.sum() > 0
    np.testing.assert_array_equal(out.tool_errors, out.tool_calls)
    seen = {o for env in envs for o in env.observations}
    assert seen == {
        "<result>error: boom raised ValueError: no</result>\n",
        "<result>error: hang did not return within 0.05 s</result>\n",
    }
    assert sum("<result>error: boom " in t for t in out.texts) >= 3  # what was fed: the first 20 tokens
    assert set(out.observation_tokens.tolist()) <= {0, 20, 40}


class ChatTokenizer(CharTokenizer):
    """A chat template of one line per message, ``<role initial>:<content>`` ended by ``$`` (the EOS's text)."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
        text = "".join(f"{m['role'][0]}:{m['content']}$\n" for m in messages)
        return text + ("a:" if add_generation_prompt else "")


class ChatEnv(CountEnv):
    """Answers every turn (ended by EOS) with the tool result "12" until its k-th turn."""

    stop_strings = ()

    def step(self, text):
        observation, points, done = super().step(text)
        return (None if done else "12"), points, done


def test_chat_format_feeds_the_templates_tool_turn_after_the_eos(params):
    """tool_format=chat: a turn ends at the EOS; what follows it is the template's tool message and the next
    generation prompt ("\\nt:12$\\na:": the newline the template writes after its end-of-turn, the tool turn,
    the assistant's opening), all with mask 0."""
    envs = [ChatEnv(3) for _ in range(6)]
    sc = SamplerConfig(max_prompt_length=16, max_completion_length=T, stop_token_ids=(0,), pad_token_id=0)
    tok = ChatTokenizer()
    turn_cfg = MultiTurnConfig(tool_format="chat")
    out = generate_multi_turn(params, PROMPTS, envs, tok, CFG, sc, turn_cfg, jax.random.key(3), G)
    observation = encode(tok, "\nt:12$\na:")
    assert out.tool_calls.sum() >= 1  # turns end at the EOS only: rare for this random model
    for b in range(6):
        ids, mask = out.completion_ids[b].tolist(), out.completion_mask[b].tolist()
        eos = [i for i in range(T) if ids[i] == 0 and mask[i] == 1]
        fed = [
            i + 1
            for i in eos
            if i + 1 + len(observation) <= T and ids[i + 1 : i + 1 + len(observation)] == observation
        ]
        assert len(fed) == out.tool_calls[b]
        for i in fed:
            assert mask[i : i + len(observation)] == [0] * len(observation)
        assert out.observation_tokens[b] == len(observation) * out.tool_calls[b]


def test_pause_table_holds_the_tokens_that_can_end_a_stop_string():
    class Vocab:
        # SmolLM2 writes "</calculator><result>" as "</", "calcul", "ator", "><", ...: the stop string ends
        # inside "><" (so does "r>." or "ator>\n"); "ing>" and "x>" end another word.
        texts = ["", ">", "r>", "or>", "ing>", "x", "ulator>", "</calculator>", "><", "r>.", "ator>\n", "x>"]

        def decode(self, ids):
            return self.texts[ids[0]]

    table = pause_table(Vocab(), 12, ["</calculator>"])
    assert table.tolist() == [False, True, True, True, False, False, True, True, True, True, True, False]
    assert not pause_table(Vocab(), 12, []).any()


@pytest.mark.parametrize(
    "text, last, end",
    [
        ("x <calculator>2*3</calculator>", ">", 30),
        ("x <calculator>2*3</calculator><", "><", 30),  # the stop ends inside the last token
        ("x <calculator>2*3</calculator>.\n", ">.\n", 30),
        ("x <calculator>2*3</calc", "calc", None),  # not yet
        ("</calculator> and more>", "more>", None),  # an earlier stop string is not this token's
    ],
)
def test_stop_string_end(text, last, end):
    assert stop_string_end(text, last, ["</calculator>"]) == end


class MergingTokenizer(CharTokenizer):
    """CharTokenizer plus three merged tokens after it: "<f>", "</" and "><" (a tag's ">" merged with the next
    tag's "<", as SmolLM2 writes "</calculator><result>")."""

    MERGED = {"<f>": len(ALPHABET) + 1, "</": len(ALPHABET) + 2, "><": len(ALPHABET) + 3}

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            merged = next((m for m in self.MERGED if text.startswith(m, i)), None)
            ids.append(self.MERGED[merged] if merged else super().encode(text[i])[0])
            i += len(merged) if merged else 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        names = {v: k for k, v in self.MERGED.items()}
        return "".join(
            names.get(i) or super(MergingTokenizer, self).decode([i], skip_special_tokens) for i in ids
        )


def bigram_params(cfg, successors):
    """Params of a model whose greedy next token is ``successors[token]`` (EOS for the others): one-hot
    embeddings, the layers' output projections zero (the residual stream stays the embedding), a head that
    maps each token to its successor."""
    p = init_params(cfg, jax.random.key(0))
    layers = {
        **p["layers"],
        "wo": jnp.zeros_like(p["layers"]["wo"]),
        "w_down": jnp.zeros_like(p["layers"]["w_down"]),
    }
    head = np.zeros((cfg.hidden_dim, cfg.vocab_size), np.float32)
    for token, successor in successors.items():
        head[token, successor] = 10.0
    embed = jnp.eye(cfg.vocab_size, cfg.hidden_dim, dtype=jnp.float32)
    return {
        **p,
        "embed": embed,
        "final_norm": jnp.ones_like(p["final_norm"]),
        "layers": layers,
        "lm_head": jnp.asarray(head),
    }


def test_a_stop_string_that_ends_inside_a_token_ends_the_turn():
    """The model writes "<f>2</f><" (its last token "><" ends the stop string "</f>" and begins the next tag):
    the tool is called with "2", and the observation's "<" that the token already wrote is not fed twice.
    Before, "><" did not pause the row: no call, and the model's next token (EOS) ended the trajectory."""
    tok = MergingTokenizer()
    script = tok.encode("q<f>2</f><")  # the prompt "q", then the model's 5 tokens
    cfg = dataclasses.replace(CFG, vocab_size=len(ALPHABET) + 4, hidden_dim=64)
    params = bigram_params(cfg, dict(zip(script[:-1], script[1:], strict=True)))  # "\n" -> EOS (0)
    seen = []
    env = ToolEnvironment({"f": lambda arg: seen.append(arg) or f"{arg}!"}, timeout_s=0.0)
    sc = SamplerConfig(
        max_prompt_length=8, max_completion_length=32, stop_token_ids=(0,), pad_token_id=0, greedy=True
    )
    out = generate_multi_turn(params, [script[:1]], [env], tok, cfg, sc, MultiTurnConfig(), jax.random.key(0))
    assert out.texts == ["<f>2</f><result>2!</result>\n"] and seen == ["2"]
    assert (out.tool_calls.tolist(), out.turns.tolist(), out.truncation) == ([1], [2], [""])
    fed = tok.encode("result>2!</result>\n")
    n = 5 + len(fed) + 1  # model tokens, the observation, EOS
    assert out.completion_ids[0, :n].tolist() == [*script[1:], *fed, 0]
    assert out.completion_mask[0, :n].tolist() == [1] * 5 + [0] * len(fed) + [1]


def test_the_fixed_program_set_keeps_a_multi_turn_rollouts_full_widths(params, monkeypatch):
    """With the fixed program set (the accelerators' default) a multi-turn rollout samples the adaptive ladders'
    tokens, pads its prompts to max_prompt_length as the engine's programs do, and its batch keeps the full
    completion width: the update compiles once, as for a single-turn rollout (not once per prompt bucket and
    completion length)."""
    from grpax.rl import multi_turn

    sc = SamplerConfig(
        max_prompt_length=100, max_completion_length=T, stop_token_ids=(0,), pad_token_id=0, backend="xla"
    )
    outs = {}
    for programs in ("adaptive", "fixed"):
        envs = [CountEnv(k) for k in [1, 2, 1, 2, 1, 1]]
        outs[programs] = generate_multi_turn(
            params, PROMPTS, envs, CharTokenizer(), CFG, dataclasses.replace(sc, programs=programs),
            MultiTurnConfig(), jax.random.key(3), G,
        )  # fmt: skip
    np.testing.assert_array_equal(outs["fixed"].completion_ids, outs["adaptive"].completion_ids)
    assert outs["adaptive"].prompt_ids.shape[1] == 64 and outs["fixed"].prompt_ids.shape[1] == 100

    def sampler(task, tokenizer, env_factory, cfg, sampler_cfg, turn_cfg, mesh):
        def sample(params, rows, key, num_generations):
            envs = [CountEnv(1) for _ in rows for _ in range(num_generations)]
            prompts = [row["prompt_ids"] for row in rows]
            return generate_multi_turn(params, prompts, envs, tokenizer, cfg, sampler_cfg, turn_cfg, key, G)

        return sample

    def score(task, rows, out):
        return {"total": np.arange(len(rows), dtype=np.float64)}, np.zeros(len(rows))

    monkeypatch.setattr(multi_turn, "trajectory_sampler", sampler)
    monkeypatch.setattr(multi_turn, "score_trajectories", score)
    grpo = GRPOConfig(num_generations=G, beta=0.0)
    rollout = multi_turn.MultiTurnRollout(
        CFG,
        dataclasses.replace(sc, programs="fixed"),
        grpo,
        None,
        CharTokenizer(),
        CountEnv,
        MultiTurnConfig(),
    )
    rollout.update_params(params, 0)
    batch = rollout([{"prompt_ids": p} for p in PROMPTS], jax.random.key(1))
    assert int(batch.host.completion_lengths.max()) < T  # every row stopped early
    assert batch.completion_ids.shape == (len(PROMPTS) * G, T) and batch.prompt_ids.shape[1] == 100
