"""The record between rollout and update: ``Batch`` (device arrays, a pytree) and its host side ``RolloutInfo``.

A ``grpax.rl.rollout.Rollout`` produces one ``Batch`` per step; ``grpax.rl.train_step.make_update`` consumes it.
P prompts, each answered by G = ``num_generations`` completions, rows grouped contiguously (completion row r
answers prompt r // G). Shapes and dtypes:

  prompt_ids        int32   [P, Lp]  left-padded prompts, one row per prompt (the update runs each prompt once)
  prompt_mask       int32   [P, Lp]  1 = real prompt token
  completion_ids    int32   [B, C]   B = P * G; pad_token_id after the end; C = the longest completion's bucket
                                     (``completion_bucket``), at most the sampler's max_completion_length
  completion_mask   int32   [B, C]   1 = generated token up to and including the first stop token; a multi-turn
                                     trajectory (``grpax.rl.multi_turn``) has 1 at the model's tokens only: its
                                     observation tokens (0) are attended but out of the loss and the KL
  advantages        float32 [B]      group-relative (``grpax.rl.advantages``)
  rollout_logprobs  float32 [B, C]   the sampler's (behaviour policy) logprobs, or None
  truncated         bool    [B]      the row hit C tokens without a stop token, or None
  ref_logprobs      float32 [B, C]   the frozen reference's, or None (required when beta > 0)
  old_logprobs      float32 [B, C]   the trainer's own of the sampling params (num_iterations > 1), or None:
                                     on-policy the ratio is exp(logp - stop_gradient(logp)) = 1
  teacher_logprobs  float32 [B, C]   a distillation teacher's (``distillation_coef`` > 0, ``grpax.rl.distill``),
                                     or None
  routed_experts    int8/16 [B, C, L, k]   a mixture of experts' routing as the sampler ran it
                                     (``router_replay``): the k experts of completion token t (as an input) in each
                                     of the L layers; the last token, never fed back, holds 0s; or None
  prompt_routed_experts int8/16 [P, Lp, L, k]  the same of the prompt tokens (the sampler's prefill), or None

``host`` (not a pytree leaf: ``device()`` drops it before the batch enters ``jit``) holds what only the host
reads: rewards per function, correctness, finish reasons, the policy version that sampled and timings.
The field names are TRL's / Tunix's (``TrainExample``) where they exist.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# One row per prompt; every other array field has one row per completion.
PROMPT_FIELDS = ("prompt_ids", "prompt_mask", "prompt_routed_experts")
# The inputs of a logprob pass (the routes: where it replays the sampler's routing).
TOKEN_FIELDS = (*PROMPT_FIELDS, "completion_ids", "completion_mask", "routed_experts")
ROUTE_FIELDS = ("prompt_routed_experts", "routed_experts")
# The fields with a completion axis [B, C].
COMPLETION_FIELDS = (
    "completion_ids", "completion_mask", "rollout_logprobs", "ref_logprobs", "old_logprobs", "routed_experts",
    "teacher_logprobs",
)  # fmt: skip
# The shortest completion bucket (tokens): the update and the reference pass run on the batch's longest
# completion rounded up to this times a power of two (``completion_bucket``).
MIN_COMPLETION_BUCKET = 64


def counted_length(completion_mask: Any) -> int:
    """Columns up to the last counted token of any row of ``completion_mask`` [B, C] (0 when none): what trimming
    may keep at least. Not the count of 1s: a multi-turn row has 0s at its observations before later 1s."""
    mask = np.asarray(completion_mask) != 0
    C = mask.shape[1]
    ends = np.where(mask.any(axis=1), C - np.argmax(mask[:, ::-1], axis=1), 0)
    return int(ends.max(initial=0))


def completion_bucket(longest: int, max_length: int, minimum: int = MIN_COMPLETION_BUCKET) -> int:
    """The completion length (tokens) the update and the reference pass run on: ``longest`` rounded up.

    The buckets are ``minimum`` x 2^k, capped at ``max_length``: at most 1 + log2(max_length / minimum)
    shapes, so the update is compiled a few times, never once per batch; rows longer than the bucket's half
    waste at most half of it (GSM8K-like batches at C = 256 mostly stop within 128 or 256 tokens).

    Args:
      longest: the batch's longest completion in tokens (stop token included), 0..max_length.
      max_length: C, the sampler's ``max_completion_length``.
      minimum: the smallest bucket; 0 turns trimming off (``max_length``).

    Returns:
      The bucket, in [min(minimum, max_length), max_length].

    Example:
      >>> [completion_bucket(n, 768) for n in (0, 64, 65, 200, 300, 700)]
      [64, 64, 128, 256, 512, 768]
    """
    if minimum <= 0:
        return max_length
    bucket = minimum
    while bucket < longest:
        bucket *= 2
    return min(bucket, max_length)


@dataclasses.dataclass
class RolloutInfo:
    """The host side of a ``Batch``: numpy arrays of B = P * G rows and plain numbers.

    Attributes:
      rewards: {reward function name: float64 [B]}, ``"total"`` included (NaN = the function abstained).
      correct: float [B], 1.0 where the task called the completion correct.
      finish_reason: "stop" or "length" per row.
      advantages: float32 [B], the batch's (a host copy).
      completion_lengths: int [B] completion tokens per row.
      prompt_tokens: real prompt tokens, each prompt counted once per completion (what the sampler attends to).
      policy_version: the version of the params that sampled (``Rollout.update_params``).
      timings: seconds: ``time/rollout_s``, ``time/reshard_s``, ``time/rewards_s``, ``time/reference_s``.
      extra: more scalar metrics of the rollout (``zero_std_fraction``, ``dynamic_sampling/*``).
    """

    rewards: dict[str, np.ndarray]
    correct: np.ndarray
    finish_reason: list[str]
    advantages: np.ndarray
    completion_lengths: np.ndarray
    prompt_tokens: int
    policy_version: int = 0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, float] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        """Host metrics: ``rewards/<name>/{mean,std}`` (over the non-abstaining rows), ``accuracy``,
        ``advantages/*``, ``completion_length/*``, ``truncated_fraction``, the timings and ``extra``."""
        metrics: dict[str, Any] = {}
        for name, values in self.rewards.items():
            finite = values[np.isfinite(values)]
            metrics[f"rewards/{name}/mean"] = float(finite.mean()) if finite.size else math.nan
            metrics[f"rewards/{name}/std"] = float(finite.std()) if finite.size else math.nan
        lengths, advantages = self.completion_lengths, self.advantages
        metrics.update(
            {
                "accuracy": float(np.mean(self.correct)),
                "advantages/mean": float(np.mean(advantages)),
                "advantages/std": float(np.std(advantages)),
                "advantages/abs_max": float(np.max(np.abs(advantages))),
                "completion_length/mean": float(lengths.mean()),
                "completion_length/max": float(lengths.max()),
                "truncated_fraction": float(np.mean([r == "length" for r in self.finish_reason])),
                "policy_version": float(self.policy_version),
                **self.timings,
                **self.extra,
            }
        )
        return metrics


@flax.struct.dataclass
class Batch:
    """One step's rollout, ready for the update (shapes in the module docstring)."""

    prompt_ids: Any
    prompt_mask: Any
    completion_ids: Any
    completion_mask: Any
    advantages: Any = None
    rollout_logprobs: Any = None
    truncated: Any = None
    ref_logprobs: Any = None
    old_logprobs: Any = None
    routed_experts: Any = None
    prompt_routed_experts: Any = None
    teacher_logprobs: Any = None
    host: RolloutInfo | None = flax.struct.field(pytree_node=False, default=None)

    @staticmethod
    def of(batch: Batch | dict) -> Batch:
        """``batch`` itself, or a ``Batch`` of a dict of its fields (tests and tools build dicts).

        Raises:
          TypeError: a key that is not a field.
        """
        return batch if isinstance(batch, Batch) else Batch(**batch)

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def num_generations(self) -> int:
        return int(self.completion_ids.shape[0]) // max(self.num_prompts, 1)

    def device(self) -> Batch:
        """The arrays only (``host`` dropped): what ``jit`` sees, so a new step does not trace again."""
        return self.replace(host=None)

    def tokens(self, routes: bool = False) -> Batch:
        """Only the token fields (the others None): the input of a logprob pass; with ``routes``, the sampler's
        routing too (a pass that replays it)."""
        kept = {name: getattr(self, name) for name in ROUTE_FIELDS} if routes else {}
        return Batch(
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            advantages=None,
            **kept,
        )

    def check(
        self,
        beta: float,
        mask_truncated_completions: bool,
        rollout_correction: bool = False,
        distillation: bool = False,
    ) -> None:
        """The one structural check of the update's input.

        Raises:
          ValueError: a missing field, rows that are not P * G, or shapes that disagree.
        """
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
            if getattr(self, name) is None:
                raise ValueError(f"the train batch has no '{name}'")
        if beta > 0 and self.ref_logprobs is None:
            raise ValueError(f"beta={beta} needs the batch's ref_logprobs (from the frozen reference model)")
        if distillation and self.teacher_logprobs is None:
            raise ValueError(
                "distillation_coef > 0 needs the batch's teacher_logprobs (from the teacher model)"
            )
        if mask_truncated_completions and self.truncated is None:
            raise ValueError("mask_truncated_completions=True needs the batch's truncated bool [B]")
        if rollout_correction and self.rollout_logprobs is None:
            raise ValueError(
                "vllm_importance_sampling_correction=true needs the batch's rollout_logprobs (the sampler's)"
            )
        P, B = self.prompt_ids.shape[0], self.completion_ids.shape[0]
        if P == 0 or B % P or self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"the train batch has {P} prompt rows {tuple(self.prompt_mask.shape)} for {B} completions: "
                "it needs one prompt row per group of num_generations completions"
            )
        C = self.completion_ids.shape[1]
        for name in (
            "completion_mask",
            "rollout_logprobs",
            "ref_logprobs",
            "old_logprobs",
            "teacher_logprobs",
        ):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (B, C):
                raise ValueError(f"the train batch's {name} is {tuple(x.shape)}, not [{B}, {C}]")
        for name in ("advantages", "truncated"):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (B,):
                raise ValueError(f"the train batch's {name} is {tuple(x.shape)}, not [{B}]")
        for name, rows in (
            ("routed_experts", (B, C)),
            ("prompt_routed_experts", tuple(self.prompt_ids.shape)),
        ):
            x = getattr(self, name)
            if x is not None and (x.ndim != 4 or tuple(x.shape[:2]) != rows):
                raise ValueError(
                    f"the train batch's {name} is {tuple(x.shape)}, not [{rows[0]}, {rows[1]}, L, k]"
                )
        if (self.routed_experts is None) != (self.prompt_routed_experts is None):
            raise ValueError("the train batch has the routes of its completions or of its prompts, not both")

    def trim_completions(self, length: int) -> Batch:
        """The batch with its [B, C] fields cut to their first ``length`` columns (``completion_bucket``).

        Only padding may be cut: every row's completion must fit in ``length`` tokens (asserted on host arrays).
        """
        mask = self.completion_mask
        if isinstance(mask, np.ndarray):
            assert not mask[:, length:].any(), f"trimming to {length} tokens would cut completion tokens"
        cut = lambda x: None if x is None else x[:, :length]  # noqa: E731
        return self.replace(**{name: cut(getattr(self, name)) for name in COMPLETION_FIELDS})

    def split(self, num_micro_batches: int, prompt_shards: int = 1) -> Batch:
        """The batch cut into M micro-batches of whole prompts and their completions: leaves [M, rows / M, ...].

        When M is not a multiple of the prompts' blocks (more micro-batches than prompts, e.g. one group too
        large for memory), each prompt row is repeated so that every micro-batch holds whole sub-groups of
        G / r rows. Likewise, when a micro-batch holds fewer prompt rows than ``prompt_shards`` (the devices its
        rows are split over), each prompt is repeated r times, each copy answered by G / r of its completions,
        so that the prompts are split over the devices too instead of each device running all of them (the same
        loss and gradient: a copy's states are the prompt's, and the gradients of the copies add up). Where G
        does not allow it (G / r not whole) the prompts stay as they are.

        Raises:
          ValueError: the prompts and completions cannot be cut into M blocks of whole (sub-)groups.
        """
        M = num_micro_batches
        num_prompts, num_rows = self.prompt_ids.shape[0], self.completion_ids.shape[0]
        repeat = M // math.gcd(M, num_prompts)  # sub-groups per prompt
        if num_rows % num_prompts or (num_rows // num_prompts) % repeat or num_rows % M:
            raise ValueError(
                f"a batch of {num_prompts} prompts x {num_rows // max(num_prompts, 1)} completions cannot be cut "
                f"into num_micro_batches={M} blocks of whole prompt groups"
            )
        spread = M * prompt_shards // math.gcd(M * prompt_shards, num_prompts)  # a multiple of repeat
        if (num_rows // num_prompts) % spread == 0:
            repeat = spread

        def cut(x, prompt_row: bool):
            if x is None:
                return None
            if prompt_row and repeat > 1:
                x = jnp.repeat(x, repeat, axis=0)
            return x.reshape(M, x.shape[0] // M, *x.shape[1:])

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "host"}
        return Batch(**{k: cut(x, k in PROMPT_FIELDS) for k, x in fields.items()})

    @staticmethod
    def abstract(
        num_prompts: int,
        num_generations: int,
        prompt_length: int,
        completion_length: int,
        *,
        with_ref: bool,
        with_old: bool,
        with_teacher: bool = False,
        sharding_of=None,
        routes: tuple[int, int, Any] | None = None,
    ) -> Batch:
        """The ``ShapeDtypeStruct``s of the batch the trainer builds (what ``compile_topology`` compiles).

        ``sharding_of(shape) -> Sharding`` places each field (None: no sharding); rollout_logprobs and
        truncated are always present, as the trainer's batches carry them; ``with_teacher``: teacher_logprobs
        (``distillation_coef`` > 0); ``routes`` (L, k, dtype): the
        routing fields of a mixture of experts' recorded routing (``router_replay``).
        """
        B, Lp, C = num_prompts * num_generations, prompt_length, completion_length

        def spec(shape, dtype):
            sharding = sharding_of(shape) if sharding_of is not None else None
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        if routes is not None:
            L, k, dtype = routes
            routed = dict(
                routed_experts=spec((B, C, L, k), dtype),
                prompt_routed_experts=spec((num_prompts, Lp, L, k), dtype),
            )
        else:
            routed = {}

        return Batch(
            prompt_ids=spec((num_prompts, Lp), jnp.int32),
            prompt_mask=spec((num_prompts, Lp), jnp.int32),
            completion_ids=spec((B, C), jnp.int32),
            completion_mask=spec((B, C), jnp.int32),
            advantages=spec((B,), jnp.float32),
            rollout_logprobs=spec((B, C), jnp.float32),
            truncated=spec((B,), jnp.bool_),
            ref_logprobs=spec((B, C), jnp.float32) if with_ref else None,
            old_logprobs=spec((B, C), jnp.float32) if with_old else None,
            teacher_logprobs=spec((B, C), jnp.float32) if with_teacher else None,
            **routed,
        )
