"""DAPO's data-side tools (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

Dynamic sampling (section 3.2): a group whose G rewards are all equal has zero advantages and carries no
signal, so ``filter_zero_std_groups`` drops it and samples more prompts until the batch holds ``batch_size``
groups with signal (at most ``dynamic_sampling_max_batches`` prompt batches per step). Soft overlong
punishment (section 3.4, eq. 13): a completion of |y| tokens, with L_max = max_completion_length and
L_cache = ``overlong_buffer_length``, gets

    R_length(y) = 0                              if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                = -1                             if |y| > L_max

times ``overlong_penalty_factor``, added to its reward. Pure numpy; the trainer calls these per step.
"""

from __future__ import annotations

import numpy as np

from grpax.sampler.requests import GenerateOutput


def overlong_penalty(
    lengths, max_completion_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> np.ndarray:
    """DAPO's soft overlong punishment (eq. 13) times ``penalty_factor``, in points.

    Args:
      lengths: int [B] completion lengths in tokens (the stop token included).
      max_completion_length: L_max, in tokens.
      buffer_length: L_cache, in tokens (0 < L_cache <= L_max); the punishment ramps over the last L_cache.
      penalty_factor: scale of the punishment (1.0 = the paper's).

    Returns:
      float64 [B], in [-penalty_factor, 0].

    Example:
      >>> overlong_penalty([10, 12, 14, 16, 17], max_completion_length=16, buffer_length=4, penalty_factor=0.5)
      array([ 0.  ,  0.  , -0.25, -0.5 , -0.5 ])

      L_max - L_cache = 12: 10 and 12 tokens are free, 14 is half-way down the ramp (-2/4 * 0.5), 16 at its
      end, 17 over the limit.
    """
    y = np.asarray(lengths, np.float64)
    free = max_completion_length - buffer_length
    ramp = (free - y) / buffer_length
    r = np.where(y <= free, 0.0, np.where(y <= max_completion_length, ramp, -1.0))
    return r * penalty_factor


def zero_std_groups(rewards, num_generations: int) -> np.ndarray:
    """Groups whose valid rewards are all equal (or that have fewer than 2 valid ones): no GRPO signal.

    Args:
      rewards: float [P * G] total rewards, grouped contiguously; NaN = abstained.
      num_generations: G.

    Returns:
      bool [P]: True for a group without signal.

    Example:
      >>> zero_std_groups([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0], 2)
      array([ True, False,  True])
    """
    grouped = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    valid = ~np.isnan(grouped)
    lo = np.where(valid, grouped, np.inf).min(axis=1)
    hi = np.where(valid, grouped, -np.inf).max(axis=1)
    return (valid.sum(axis=1) < 2) | (lo == hi)


def pick_groups(zero_std: np.ndarray, num_groups: int) -> tuple[np.ndarray, int]:
    """The groups of a step's batch: the first ``num_groups`` with signal, then (if short) zero-std ones.

    Args:
      zero_std: bool [R] over the groups of every rollout of the step, in sampling order.
      num_groups: groups per batch (``batch_size``).

    Returns:
      ``(indices [num_groups], filled)``: group indices into the R groups, and how many of them are zero-std
      groups taken because the step ran out of sampling rounds (their advantages are 0).

    Example:
      >>> pick_groups(np.array([True, False, True, False, False]), 2)
      (array([1, 3]), 0)
      >>> pick_groups(np.array([True, False, True]), 2)
      (array([1, 0]), 1)
    """
    signal = np.flatnonzero(~zero_std)[:num_groups]
    filled = num_groups - signal.size
    return np.concatenate([signal, np.flatnonzero(zero_std)[:filled]]), filled


def _left_pad(a: np.ndarray, width: int, value: int) -> np.ndarray:
    """``a`` [rows, n, ...] padded on the left of its axis 1 to ``width`` with ``value``."""
    return np.pad(a, [(0, 0), (width - a.shape[1], 0)] + [(0, 0)] * (a.ndim - 2), constant_values=value)


def take_groups(
    outs: list[GenerateOutput], groups: np.ndarray, num_generations: int, pad_token_id: int
) -> GenerateOutput:
    """The groups ``groups`` (indices over the groups of all ``outs``, in order) as one rollout.

    Prompts of different rollouts are left-padded with ``pad_token_id`` (mask 0) to the widest, so the update
    sees one batch; completions share the sampler's fixed width C.
    """
    width = max(o.prompt_ids.shape[1] for o in outs)
    groups = np.asarray(groups)
    prompt_ids = np.concatenate([_left_pad(np.asarray(o.prompt_ids), width, pad_token_id) for o in outs])
    prompt_mask = np.concatenate([_left_pad(np.asarray(o.prompt_mask), width, 0) for o in outs])
    prompt_indices = np.concatenate([np.asarray(o.prompt_indices) for o in outs])
    rows = (groups[:, None] * num_generations + np.arange(num_generations)).reshape(-1)
    cat = {
        name: np.concatenate([np.asarray(getattr(o, name)) for o in outs])
        for name in ("completion_ids", "completion_mask", "logprobs", "lengths")
    }
    finish = [r for o in outs for r in o.finish_reason]
    routed = {}
    if outs[0].routed_experts is not None:  # a mixture of experts' recorded routing, rows taken alike
        routed = dict(
            routed_experts=np.concatenate([o.routed_experts for o in outs])[rows],
            prompt_routed_experts=np.concatenate(
                [_left_pad(o.prompt_routed_experts, width, 0) for o in outs]
            )[groups],
        )
    if all(o.policy_versions is not None for o in outs):  # each token's params version (a kept engine's)
        routed["policy_versions"] = np.concatenate([o.policy_versions for o in outs])[rows]
    return GenerateOutput(
        prompt_ids=prompt_ids[groups],
        prompt_mask=prompt_mask[groups],
        completion_ids=cat["completion_ids"][rows],
        completion_mask=cat["completion_mask"][rows],
        logprobs=cat["logprobs"][rows],
        lengths=cat["lengths"][rows],
        finish_reason=[finish[i] for i in rows],
        prompt_indices=prompt_indices[groups],
        decode_row_steps=sum(o.decode_row_steps for o in outs),  # the decode work of every round
        **routed,
    )
