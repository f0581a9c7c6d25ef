"""Requests and sequences: what a caller submits to the engine, the host state of each completion, and the rows
it gets back.

A ``Request`` is a batch of prompts submitted together (``Engine.submit``), G completions each; each completion
is a ``Sequence`` that moves through the states "queued" (its prompt not yet prefilled), "ready" (prefilled,
waiting for a decode slot), "running", "paused" (a multi-turn segment ended; its pages kept) and "done".
``Request.output`` lays the rows out as a ``GenerateOutput`` (TRL's field names); ``prepare_prompts`` applies
the truncation policy before a submit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import numpy as np

from grpax.sampler import decode
from grpax.sampler.keys import SamplerConfig, SamplingRule

logger = logging.getLogger(__name__)


class GenerateOutput(NamedTuple):
    """Rollouts of one ``generate`` call: N prompts, G = B / N completions each; completion row i answers prompt
    row i // G, which is ``prompts[prompt_indices[i // G]]``.

    Attributes:
      prompt_ids: int32 [N, P] left-padded prompts (pad_token_id on the left), one row per prompt.
      prompt_mask: int32 [N, P], 1 for real prompt tokens.
      completion_ids: int32 [B, C]; pad_token_id after the end.
      completion_mask: int32 [B, C], 1 for every generated token up to and including the first stop token.
      logprobs: float32 [B, C], each sampled token's log-probability under the distribution it was drawn from
        (logits / temperature, then top-k and top-p, renormalised: the behaviour policy; greedy: the
        unfiltered softmax at temperature 1); 0 where masked.
      lengths: int32 [B] completion lengths in tokens (= completion_mask.sum(1)).
      finish_reason: "stop" (a stop token was emitted) or "length" (C tokens without one), per row.
      prompt_indices: int32 [N] index of each prompt row in the input list (differs only with truncation
        "drop").
      decode_row_steps: slots x decode steps the model ran for these rows (0 where not counted); 1 -
        (sum(lengths - 1) / it) is the fraction of decode work spent on idle slots.
      policy_versions: int32 [B, C] the params version that sampled each token (``Engine.update_params``), -1
        where masked; None where not recorded.
      routed_experts: with ``record_routes`` (a mixture of experts), int8/16 [B, C, L, k]: the experts each
        completion token was routed to in each layer when the decode fed it back (0s for the last token, never
        fed, and past a row's end); else None.
      prompt_routed_experts: likewise int8/16 [N, P, L, k] of the prompt tokens (left-padded like prompt_ids).
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: list[str]
    prompt_indices: np.ndarray
    decode_row_steps: int = 0
    policy_versions: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion in the engine: its prompt, pages and tokens so far (host state).

    ``state`` is "queued" (its prompt not yet prefilled), "ready" (prefilled, waiting for a slot), "running",
    "paused" (its segment ended; pages kept until ``Engine.resume`` or ``Engine.finish``) or "done".
    """

    request: Request
    index: int  # its row in the request: the row id of its noise
    prompt: list[int]
    state: str = "queued"
    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model: list[bool] = dataclasses.field(default_factory=list)  # sampled (True) or forced (an observation)
    versions: list[int] = dataclasses.field(default_factory=list)
    # a mixture of experts' recorded routing: int [L, k] of each token fed so far (tokens[: len(routes)])
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)
    reason: int = decode.RUNNING  # why its last segment ended
    forced: list[int] = dataclasses.field(default_factory=list)
    forced_pos: int = 0
    turn_end: int = 0
    order: int = 0  # admission order (preemption takes the newest)
    kv_epoch: int = 0  # the engine's params swap whose weights computed its keys and values

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def finish_reason(self) -> str:
        return "length" if self.reason == decode.LENGTH else "stop"

    def record(self, token: int, logprob: float, model: bool, version: int) -> None:
        """Appends a token: sampled by params ``version`` (``model``) or forced (an observation: logprob 0)."""
        self.tokens.append(token)
        self.logprobs.append(logprob if model else 0.0)
        self.model.append(model)
        self.versions.append(version)

    def first_reason(self, stop_table: np.ndarray, pause_table: np.ndarray) -> int:
        """``decode.segment_end`` of its first token (sampled by the prefill; ``stop_table``, ``pause_table``
        bool [V])."""
        token, n = self.tokens[-1], self.n
        if stop_table[token]:
            return decode.STOP
        if self.request.pauses and pause_table[token]:
            return decode.PAUSE
        if n >= self.request.limit:
            return decode.LENGTH
        if n >= self.turn_end:
            return decode.TURN
        return decode.RUNNING

    def reset(self) -> None:
        """Back to its prompt (a preempted sequence, restarted later)."""
        self.tokens, self.logprobs, self.model, self.versions, self.routes = [], [], [], [], []
        self.pages, self.forced, self.forced_pos, self.reason = [], [], 0, decode.RUNNING
        self.state = "queued"


class Request:
    """A batch of prompts submitted together (``Engine.submit``); its sequences are its rows, G per prompt, each
    at most ``limit`` new tokens, sampled by ``rule``."""

    def __init__(
        self,
        prompts,
        key_data,
        key_impl,
        num_generations,
        pauses,
        turn_budget,
        limit: int,
        rule: SamplingRule,
        route_shape=None,
    ):
        self.prompts, self.key_data, self.key_impl = prompts, key_data, key_impl
        self.num_generations, self.pauses, self.turn_budget = num_generations, pauses, turn_budget
        self.limit, self.rule = limit, rule
        G = num_generations
        self.sequences = [Sequence(self, i, prompts[i // G]) for i in range(len(prompts) * G)]
        self.row_steps = 0
        # (L, k, dtype) of a mixture of experts' recorded routing, else None; each prompt's routes [length, L, k]
        self.route_shape = route_shape
        self.prompt_routes: dict[int, np.ndarray] = {}
        # each prompt's index in the caller's list (``prepare_prompts``' indices; default 0..N-1): the output's
        self.prompt_indices = list(range(len(prompts)))

    @property
    def done(self) -> bool:
        return all(s.state == "done" for s in self.sequences)

    def output(self, pad_token_id: int, bucket: int = 0, width: int = 0) -> GenerateOutput:
        """The rows in order as a ``GenerateOutput`` (prompts left-padded to ``bucket`` tokens, default the
        longest; completions to ``width``, default the length limit)."""
        N, B = len(self.prompts), len(self.sequences)
        bucket, width = bucket or max(map(len, self.prompts)), width or self.limit
        left = np.full((N, bucket), pad_token_id, np.int32)
        prompt_mask = np.zeros((N, bucket), np.int32)
        for i, p in enumerate(self.prompts):
            left[i, bucket - len(p) :], prompt_mask[i, bucket - len(p) :] = p, 1
        ids = np.full((B, width), pad_token_id, np.int32)
        mask = np.zeros((B, width), np.int32)
        logprobs = np.zeros((B, width), np.float32)
        versions = np.full((B, width), -1, np.int32)
        for b, s in enumerate(self.sequences):
            n = s.n
            ids[b, :n], mask[b, :n], logprobs[b, :n] = s.tokens, s.model, s.logprobs
            versions[b, :n] = s.versions
        versions[mask == 0] = -1
        routed = {}
        if self.route_shape is not None:  # prompts' routes left-padded like prompt_ids
            L, k, dtype = self.route_shape
            prompt_routes = np.zeros((N, bucket, L, k), dtype)
            for i, p in enumerate(self.prompts):
                prompt_routes[i, bucket - len(p) :] = self.prompt_routes[i]
            routes = np.zeros((B, width, L, k), dtype)
            for b, s in enumerate(self.sequences):
                if s.routes:
                    routes[b, : len(s.routes)] = np.stack(s.routes)
            routed = dict(routed_experts=routes, prompt_routed_experts=prompt_routes)
        return GenerateOutput(
            prompt_ids=left,
            prompt_mask=prompt_mask,
            completion_ids=ids,
            completion_mask=mask,
            logprobs=np.where(mask == 1, logprobs, 0.0).astype(np.float32),
            lengths=mask.sum(axis=1).astype(np.int32),
            finish_reason=[s.finish_reason for s in self.sequences],
            prompt_indices=np.array(self.prompt_indices, np.int32),
            decode_row_steps=self.row_steps,
            policy_versions=versions,
            **routed,
        )


def prepare_prompts(
    prompts: list[list[int]], sampler_cfg: SamplerConfig
) -> tuple[list[list[int]], list[int]]:
    """Applies the truncation policy; returns (kept prompts, their indices in ``prompts``): the first step of
    every sampler consumer (prepare -> ``Engine.submit`` with ``prompt_indices`` -> ``Engine.collect``).

    Raises:
      ValueError: if a prompt is empty, or no prompt is left (all longer than max_prompt_length, truncation
        "drop").
    """
    sc = sampler_cfg
    kept, indices, num_long = [], [], 0
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) > sc.max_prompt_length:
            num_long += 1
            if sc.truncation == "drop":
                continue
            prompt = prompt[-sc.max_prompt_length :]
        kept.append(list(prompt))
        indices.append(i)
    if num_long:
        action = "dropped" if sc.truncation == "drop" else "left-truncated (kept their last tokens)"
        logger.warning(
            "%d of %d prompts are longer than max_prompt_length=%d (key max_prefill_predict_length) and were %s",
            num_long,
            len(prompts),
            sc.max_prompt_length,
            action,
        )
    if not kept:
        raise ValueError(
            "no prompt left to generate from (all longer than max_prompt_length, truncation=drop)"
        )
    return kept, indices


def request_settings(
    sampler_cfg: SamplerConfig,
    num_slots: int,
    prompts: list[list[int]],
    num_generations: int,
    max_completion_length: int | None,
    default_rule: SamplingRule,
    sampling: dict,
) -> tuple[int, SamplingRule]:
    """A request's length limit and sampling rule (``Engine.submit``'s arguments), checked: each unset (None)
    value is the engine's (``sampler_cfg``'s; ``sampling``: temperature, top_k, top_p, greedy).

    Raises:
      ValueError: an empty prompt or one longer than max_prompt_length; num_generations above ``num_slots``; a
        length limit or sampling value out of range (one line naming the argument).
    """
    sc = sampler_cfg
    if not 1 <= num_generations <= num_slots:
        raise ValueError(
            f"num_generations={num_generations}: expected 1..{num_slots} (the engine's decode slots, "
            "max_num_seqs: a prompt's completions start together)"
        )
    for i, p in enumerate(prompts):
        if not 0 < len(p) <= sc.max_prompt_length:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens: expected 1..max_prompt_length={sc.max_prompt_length} "
                "(prepare_prompts truncates)"
            )
    limit = sc.max_completion_length if max_completion_length is None else max_completion_length
    integer = isinstance(limit, int | np.integer) and not isinstance(limit, bool)
    if not integer or not 1 <= limit <= sc.max_completion_length:
        raise ValueError(
            f"max_completion_length={limit!r}: expected an integer in 1..{sc.max_completion_length} tokens "
            "(the engine's max_completion_length; build the engine with a larger one for longer rows)"
        )
    rule = default_rule
    given = {name: value for name, value in sampling.items() if value is not None}
    if given:  # the SamplerConfig's checks (one line each), on the engine's values with these replaced
        rule = SamplingRule.of(dataclasses.replace(sc, **given))
    return int(limit), rule
