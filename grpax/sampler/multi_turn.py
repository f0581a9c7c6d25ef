"""Multi-turn sampling: a model that calls tools (or plays an environment) between its turns.

Each trajectory has its own environment (``grpax.tasks.environment``): ``reset`` gives its first messages,
rendered by the chat template (with the environment's tools where it declares them) into the prompt. The
trajectories run on the rollout engine's public API (``grpax.sampler.engine.Engine``): submitted as pausing
sequences, each pauses at the end of a turn (a stop token, a token that may end one of the environment's stop
strings: ``pause_table``, whose text the host checks, or the turn's token budget) with its KV pages kept; on the
host its turn text goes to its environment's ``step``, whose observation is tokenized (``render_observation``)
and handed back with ``Engine.resume``, which feeds it through the decode into the sequence's own pages (mask 0,
logprob 0) before it samples on. The cache is never rebuilt: continuing a trajectory costs its observation's
tokens, not a new prefill of the conversation, and the logprobs of the model tokens are those of one forward
over the final sequence. Trajectories finish at different turns, and a paused one leaves its decode slot to the
others; the batch goes on until every trajectory is done or out of budget (``max_turns``, ``max_turn_tokens``
per turn, T = ``max_completion_length`` for the whole trajectory after the prompt).

A trajectory's output is ``GenerateOutput``'s fields (``completion_ids`` the whole trajectory after the prompt,
model and observation tokens; ``completion_mask`` 1 only at the model's tokens) with per-trajectory counts; the
trainer's ``grpax.rl.multi_turn.MultiTurnRollout`` scores it into the single-turn ``Batch``, and ``grpax
evaluate`` and ``grpax generate`` sample it here without the trainer. Metrics per trajectory:
``multi_turn/turns``, ``multi_turn/tool_calls`` (observations given), ``multi_turn/tool_errors`` (observations
starting with ``error``), ``multi_turn/observation_tokens`` and ``multi_turn/truncated_{turn,trajectory,max_turns}``. This follows the multi-turn GRPO of TRL's environments,
verl / SkyRL-gym tool environments and unsloth (environment tokens masked out of the loss).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from grpax.data.prompts import PromptPreset, build_messages
from grpax.errors import ConfigError
from grpax.models.registry import ModelConfig
from grpax.sampler import decode as reasons
from grpax.sampler.engine import Engine
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.requests import prepare_prompts
from grpax.sharding import mesh_context
from grpax.tasks.environment import (
    CheckedEnvironment,
    MultiTurnConfig,
    chat_observation,
    check_tools_rendered,
)


class MultiTurnOutput(NamedTuple):
    """``grpax.sampler.requests.GenerateOutput``'s fields (completion = the whole trajectory after the prompt,
    completion_mask = its model tokens) and, per row [B]: ``texts`` (the trajectory's text, observations
    included), ``turns``, ``tool_calls``, ``tool_errors``, ``observation_tokens``, ``env_rewards`` (points) and
    ``truncation`` ("" or "turn", "trajectory", "max_turns": which budget ended it)."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: list[str]
    prompt_indices: np.ndarray
    decode_row_steps: int  # GenerateOutput's
    texts: list[str]
    turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    observation_tokens: np.ndarray
    env_rewards: np.ndarray
    truncation: list[str]
    routed_experts: np.ndarray | None = None  # GenerateOutput's: None, multi-turn records no routing
    prompt_routed_experts: np.ndarray | None = None
    policy_versions: np.ndarray | None = None  # GenerateOutput's: each token's version, -1 if masked

    def metrics(self) -> dict[str, float]:
        """Means per trajectory of the turn counts, the fraction that called a tool at least once
        (``tool_use_rate``) and the fraction ended by each budget."""
        out = {
            "multi_turn/turns": float(self.turns.mean()),
            "multi_turn/tool_calls": float(self.tool_calls.mean()),
            "multi_turn/tool_use_rate": float(np.mean(self.tool_calls > 0)),
            "multi_turn/tool_errors": float(self.tool_errors.mean()),
            "multi_turn/observation_tokens": float(self.observation_tokens.mean()),
        }
        for budget in ("turn", "trajectory", "max_turns"):
            out[f"multi_turn/truncated_{budget}"] = float(np.mean([t == budget for t in self.truncation]))
        return out


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens added (the template or the environment wrote them)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


@functools.cache
def _token_texts(tokenizer: Any, vocab_size: int) -> tuple[str, ...]:
    return tuple(tokenizer.decode([i]) for i in range(vocab_size))


def pause_table(tokenizer: Any, vocab_size: int, stop_strings: Sequence[str]) -> np.ndarray:
    """bool [V]: the tokens that can end a stop string (after each the host checks the turn's text): those
    with a prefix of their text that ends as a stop string does, over the shorter of the two (``"or>"``, ``">"``
    and ``"><"`` can end ``"</calculator>"``: a tokenizer may merge the closing ``>`` with what follows, as
    SmolLM2's ``"><"`` in ``</calculator><result>``; ``"ing>"`` cannot)."""
    return _pause_table(tokenizer, vocab_size, tuple(s for s in stop_strings if s))


@functools.cache
def _pause_table(tokenizer: Any, vocab_size: int, stops: tuple[str, ...]) -> np.ndarray:
    table = np.zeros(vocab_size, bool)
    if stops:
        for i, text in enumerate(_token_texts(tokenizer, vocab_size)):
            table[i] = any(
                text[:k][-min(k, len(s)) :] == s[-min(k, len(s)) :]
                for s in stops
                for k in range(1, len(text) + 1)
            )
    return table


def stop_string_end(text: str, last_token_text: str, stop_strings: Sequence[str]) -> int | None:
    """The end (a character index into ``text``) of the first stop string that ends inside the turn's last token
    (whose text is ``last_token_text``), or None: the turn ends there, and what the token wrote after it
    (``text[end:]``, e.g. the ``"<"`` of ``"><"``) is the overshoot.

    Example:
      >>> stop_string_end("x <calculator>2*3</calculator><", "><", ["</calculator>"])
      30
    """
    start = len(text) - len(last_token_text)
    ends = [
        i + len(s)
        for s in stop_strings
        if s
        for i in [text.find(s, max(0, start - len(s) + 1))]
        if i >= 0 and i + len(s) > start
    ]
    return min(ends) if ends else None


def render_prompt(tokenizer: Any, env: Any, row: dict, preset: PromptPreset) -> str:
    """The prompt text of one trajectory: ``env.reset`` (given the task's messages) through the chat
    template, with the environment's tools where it declares them, then the preset's response prefix.

    Raises:
      ConfigError: the environment declares tools that the chat template ignores (``check_tools_rendered``).
    """
    messages = build_messages(row["question"], preset.system_prompt, preset.user_template)
    messages = env.reset({**row, "messages": messages}) or messages
    tools = list(getattr(env, "tools", ()) or ()) or None
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    if tools:
        check_tools_rendered(tokenizer, messages, text, tools, isinstance(env, CheckedEnvironment))
    return text + preset.response_prefix


def prompt_renderer(
    tokenizer: Any, env_factory: Callable[[], Any], preset: PromptPreset
) -> Callable[[dict], str]:
    """``row -> prompt text`` as a trajectory of ``row`` starts (``render_prompt`` with a fresh environment):
    what ``prepare_rows`` measures against ``max_prefill_predict_length``, the environment's instructions
    included."""
    return lambda row: render_prompt(tokenizer, env_factory(), row, preset)


def generate_multi_turn(
    params: Any,
    prompts: list[list[int]],
    envs: list[Any],
    tokenizer: Any,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    turn_cfg: MultiTurnConfig,
    key: jax.Array,
    num_generations: int = 1,
) -> MultiTurnOutput:
    """G trajectories of each prompt, each with its own environment, in one KV cache.

    Args:
      params: model params.
      prompts: N token-id lists (each rendered from its environment's ``reset``).
      envs: N * G environments, reset; trajectory i talks to ``envs[i]`` and answers prompt i // G.
      tokenizer: decodes turns and encodes observations (``decode``, ``encode``; ``apply_chat_template`` with
        ``tool_format="chat"``).
      cfg: model config.
      sampler_cfg: sampling settings; T = ``max_completion_length`` tokens per trajectory after the prompt,
        ``stop_token_ids`` end a turn.
      turn_cfg: the turn budgets and the tool format.
      key: PRNG key.
      num_generations: G.

    Raises:
      ValueError: an empty prompt, or none left after truncation "drop".
      EnvironmentFileError: a user environment's ``step`` raised or answered in another shape.
    """
    sc, G = sampler_cfg, num_generations
    kept, indices = prepare_prompts(prompts, sc)
    envs = [envs[i * G + g] for i in indices for g in range(G)]
    B, T, F = len(kept) * G, sc.max_completion_length, turn_cfg.max_observation_tokens
    stop_strings = sorted({s for env in envs for s in (getattr(env, "stop_strings", ()) or ())})
    # a stop token that is also a pause token ends its row: stops win (decode.segment_end)
    engine = Engine(
        params, cfg, sc, num_slots=B, pause_table=pause_table(tokenizer, cfg.vocab_size, stop_strings),
        max_forced_tokens=F,
    )  # fmt: skip
    trajectories = _Trajectories(engine, envs, tokenizer, turn_cfg, stop_strings, T)
    request = engine.submit(
        kept, key, G, pauses=True, turn_budget=trajectories.turn_budget, prompt_indices=indices
    )
    while not request.done:
        paused = engine.run(request)
        assert paused or request.done, "a pausing request stopped without a paused sequence"
        for seq in paused:
            trajectories.paused(seq)
    truncation = trajectories.truncation
    for seq in request.sequences:  # the length limit ends a sequence without a pause
        if seq.reason == reasons.LENGTH and not truncation[seq.index]:
            truncation[seq.index] = "trajectory"
    out = engine.collect(request)._replace(finish_reason=["length" if t else "stop" for t in truncation])
    return MultiTurnOutput(
        **out._asdict(),  # GenerateOutput's fields (no routing: check_router_replay refuses it here)
        texts=tokenizer.batch_decode([seq.tokens for seq in request.sequences], skip_special_tokens=True),
        turns=trajectories.turns,
        tool_calls=trajectories.calls,
        tool_errors=trajectories.errors,
        observation_tokens=trajectories.obs_tokens,
        env_rewards=trajectories.rewards,
        truncation=truncation,
    )


class _Trajectories:
    """The host's side of ``generate_multi_turn``'s B trajectories: each one's environment, its counts (turns,
    tool calls and errors, observation tokens, the environment's reward points) and what ends, resumes or answers
    a sequence the engine paused (a stop token, a stop string, the turn's budget)."""

    def __init__(self, engine, envs, tokenizer, turn_cfg: MultiTurnConfig, stop_strings: list[str], T: int):
        self.engine, self.envs, self.tokenizer, self.turn_cfg = engine, envs, tokenizer, turn_cfg
        self.stop_strings, self.T, B = stop_strings, T, len(envs)
        self.turn_budget = turn_cfg.max_turn_tokens or T
        self.turns, self.calls, self.errors, self.obs_tokens = (np.zeros(B, np.int64) for _ in range(4))
        self.turns[:] = 1
        self.rewards = np.zeros(B, np.float64)
        self.turn_start = np.zeros(B, np.int64)
        self.truncation = [""] * B

    def _end(self, seq, truncation: str = "") -> None:
        self.engine.finish(seq)
        if truncation:
            self.truncation[seq.index] = truncation

    def paused(self, seq) -> None:
        """Ends, resumes or answers (``_answer``) a sequence the engine paused."""
        b, r, n = seq.index, seq.reason, seq.n
        turn = seq.tokens[self.turn_start[b] : n]
        overshoot, stop_token = "", turn[-1] if r == reasons.STOP else None
        if r == reasons.PAUSE:
            text = self.tokenizer.decode(turn)
            end = stop_string_end(text, self.tokenizer.decode(turn[-1:]), self.stop_strings)
            if end is None:  # not a stop string after all
                if n >= self.T:
                    self._end(seq, "trajectory")
                elif n >= seq.turn_end:
                    self._end(seq, "turn")
                else:
                    self.engine.resume(seq)  # decode on in the same turn
                return
            text, overshoot = text[:end], text[end:]
        elif r == reasons.TURN:
            self._end(seq, "turn")
            return
        else:
            text = self.tokenizer.decode(turn[:-1] if stop_token is not None else turn)
        self._answer(seq, text, stop_token, overshoot)

    def _answer(self, seq, text: str, stop_token: int | None, overshoot: str) -> None:
        """Steps the sequence's environment with its turn's ``text``; ends the trajectory, or resumes it with the
        observation's tokens."""
        b, n, F = seq.index, seq.n, self.turn_cfg.max_observation_tokens
        observation, points, finished = self.envs[b].step(text)
        self.rewards[b] += points
        if finished or observation is None:
            self._end(seq)
            return
        if self.turns[b] >= self.turn_cfg.max_turns:
            self._end(seq, "max_turns")
            return
        rendered = render_observation(self.tokenizer, self.envs[b], observation, stop_token, self.turn_cfg)
        if overshoot and rendered.startswith(overshoot):  # the model's last token began the observation
            rendered = rendered[len(overshoot) :]
        tokens = encode(self.tokenizer, rendered)[:F]
        if n + len(tokens) >= self.T:  # no room for a model token after it
            self._end(seq, "trajectory")
            return
        self.calls[b] += 1
        self.errors[b] += observation.lstrip().startswith(("error", "<result>error"))
        self.obs_tokens[b] += len(tokens)
        self.turns[b] += 1
        self.turn_start[b] = n + len(tokens)
        self.engine.resume(seq, tokens, self.turn_budget)


def render_observation(
    tokenizer: Any, env: Any, observation: str, stop_token: int | None, turn_cfg: MultiTurnConfig
) -> str:
    """The text fed after a turn: the observation itself (tag format), or with ``tool_format="chat"`` the
    template's tool message between the turn's end and the next assistant turn (``chat_observation``)."""
    if turn_cfg.tool_format != "chat":
        return observation
    stop_text = tokenizer.decode([stop_token]) if stop_token is not None else ""
    return chat_observation(tokenizer, observation, stop_text, tuple(getattr(env, "tools", ()) or ()))


def trajectory_sampler(
    task: Any,
    tokenizer: Any,
    env_factory: Callable[[], Any],
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    turn_cfg: MultiTurnConfig,
    mesh: Any = None,
) -> Callable[..., MultiTurnOutput]:
    """``(params, rows, key, num_generations) -> MultiTurnOutput``: G trajectories of each row with fresh
    environments (``env_factory``), prompts rendered from each ``reset`` with ``task``'s preset. The trainer's
    rollout (``grpax.rl.multi_turn``), ``grpax generate`` and ``grpax.eval.evaluate.evaluate``
    (``trajectories=``) sample with it, so that ``grpax evaluate`` and the trainer's evaluations run the same
    environment as training.

    The returned function raises ConfigError: an environment's ``reset`` gives the G trajectories of one row
    different prompts (a group shares its prompt).
    """

    def sample(params: Any, rows: list[dict], key: jax.Array, num_generations: int) -> MultiTurnOutput:
        G = num_generations
        envs = [env_factory() for _ in rows for _ in range(G)]
        prompts = []
        for i, row in enumerate(rows):
            texts = {render_prompt(tokenizer, envs[i * G + g], row, task.preset) for g in range(G)}
            if len(texts) > 1:
                raise ConfigError(
                    f"the environment's reset(row) gave the {G} trajectories of row {i + 1} different prompts: a "
                    "GRPO group shares its prompt, so reset must return the same messages for the same row"
                )
            prompts.append(encode(tokenizer, texts.pop()))
        with mesh_context(mesh):
            return generate_multi_turn(params, prompts, envs, tokenizer, cfg, sampler_cfg, turn_cfg, key, G)

    return sample
