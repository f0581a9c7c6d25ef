"""The rollout side of a GRPO step: prompt rows in, a ``grpax.rl.batch.Batch`` out.

``Rollout`` owns the params it samples with and their version (``update_params``). A call samples G =
``num_generations`` completions of each prompt with the rollout engine (``grpax.sampler.engine``: one per call,
its KV pool freed after it; or, for rollouts ahead that overlap batches, ``keep_engine``: one engine running
across calls, the next batch's prompts entering the slots the current batch's tail frees, the weights swapped
between decode calls; on the sampler's mesh, the weights resharded when its layout differs from the trainer's),
scores them with the task (``scorer``), adds DAPO's
overlong punishment, refills zero-std groups from more prompt batches (DAPO dynamic sampling,
``grpax.rl.dapo``), turns the rewards into group-relative advantages (``grpax.rl.advantages``), places the
batch on the trainer's mesh and adds the frozen reference's logprobs (beta > 0), a distillation teacher's
(``distillation_coef`` > 0, ``grpax.rl.distill``) and, where the update's ratio needs them
(``GRPOConfig.needs_old_logprobs``), the sampling params' own ``old_logprobs``. ``num_generations`` is handled
here and nowhere else in the step: the sampler returns each prompt once, the batch holds one prompt row per group.

The shape follows Tunix's ``BaseRollout`` (``update_params``, ``generate``, ``get_per_token_logps``) and
its ``TrainExample``; the trainer's loop is ``batch = rollout(rows, key); state, metrics = update(state, batch)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpax import prng, sharding
from grpax.eval.evaluate import decode_completions
from grpax.models.registry import ModelConfig
from grpax.rl import dapo
from grpax.rl.advantages import compute_advantages
from grpax.rl.batch import MIN_COMPLETION_BUCKET, Batch, RolloutInfo, completion_bucket, counted_length
from grpax.rl.config import GRPOConfig
from grpax.rl.reference import FrozenParams, release_host_memory
from grpax.rl.train_step import compute_logprobs
from grpax.sampler.engine import Engine, generate
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.program_set import fixed_programs
from grpax.sampler.requests import GenerateOutput, Request, prepare_prompts
from grpax.sharding import mesh_context

# (rows [B], rollout) -> ({reward name: [B] points, "total" included; NaN = abstain}, correct [B])
Scorer = Callable[[list[dict], GenerateOutput], tuple[dict[str, Any], Any]]


def task_scorer(task: Any, tokenizer: Any) -> Scorer:
    """The ``Scorer`` of a ``grpax.tasks.Task``: its reward functions on the decoded completions, and which
    completions it calls correct (the step's ``accuracy``)."""

    def score(rows: list[dict], out: GenerateOutput) -> tuple[dict[str, Any], Any]:
        completions = decode_completions(tokenizer, out.completion_ids, out.completion_mask)
        scores = task.score(rows, completions)
        return scores, task.step_correct(rows, completions, scores)

    return score


def decode_work(outs: list[GenerateOutput]) -> dict[str, float]:
    """``decode/row_steps`` (rows x decode steps the model ran over the sampling rounds ``outs``) and
    ``decode/past_eos_fraction`` (the share of them spent on rows that had already finished: 0 when every row
    ran exactly to its end), where the sampler counted them."""
    row_steps = sum(int(out.decode_row_steps) for out in outs)
    if row_steps <= 0:
        return {}
    # each row needs lengths - 1 decode steps: its first token comes from the prefill
    needed = sum(int(np.maximum(np.asarray(out.lengths) - 1, 0).sum()) for out in outs)
    return {"decode/row_steps": float(row_steps), "decode/past_eos_fraction": 1.0 - needed / row_steps}


class Rollout:
    """Turns prompt rows into the update's ``Batch``.

    Args:
      model_cfg, sampler_cfg, grpo: the model, the sampler's settings and the algorithm's.
      scorer: rewards and correctness of a rollout (``task_scorer`` for a task).
      mesh: the trainer's mesh (the batch is placed on its data/fsdp axes); None = default placement.
      rollout_mesh: the sampler's mesh; when its layout differs from the trainer's the weights are resharded
        once per rollout (``time/reshard_s``), otherwise the sampler reads the trainer's arrays.
      reference: the frozen reference params (a tree or ``FrozenParams``), or None (beta == 0).
      teacher: a distillation teacher's frozen params (a tree or ``FrozenParams``; ``distillation_coef`` > 0),
        or None; its model is ``teacher_cfg`` (default ``model_cfg``), of the student's vocabulary.
      num_micro_batches: blocks of the reference / old logprob passes (memory).
      min_completion_bucket: the batch's completion axis is cut to its longest completion rounded up to this
        many tokens times a power of two (``grpax.rl.batch.completion_bucket``), so the reference pass and the
        update run on the real lengths, not on max_completion_length; 0 keeps the full length.
      logprobs_options: XLA's options of the logprob passes (``TrainConfig.training_compile_options``).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        sampler_cfg: SamplerConfig,
        grpo: GRPOConfig,
        scorer: Scorer,
        *,
        mesh: jax.sharding.Mesh | None = None,
        rollout_mesh: jax.sharding.Mesh | None = None,
        reference: Any = None,
        teacher: Any = None,
        teacher_cfg: ModelConfig | None = None,
        num_micro_batches: int = 1,
        min_completion_bucket: int = MIN_COMPLETION_BUCKET,
        logprobs_options: tuple = (),
    ):
        self.model_cfg, self.sampler_cfg, self.grpo, self.scorer = model_cfg, sampler_cfg, grpo, scorer
        self.mesh, self.rollout_mesh = mesh, rollout_mesh
        if reference is not None and not isinstance(reference, FrozenParams):
            reference = FrozenParams(reference)
        if teacher is not None and not isinstance(teacher, FrozenParams):
            teacher = FrozenParams(teacher)
        self.reference, self.num_micro_batches = reference, num_micro_batches
        self.teacher, self.teacher_cfg = teacher, teacher_cfg or model_cfg
        self.min_completion_bucket = min_completion_bucket
        self.logprobs_options = logprobs_options
        self.params: Any = None
        self.version = 0
        self.engine: Engine | None = None  # one engine running across calls (``keep_engine``), else None
        self._keep_engine = False
        self._params_of: dict[int, Any] = {}  # the versions a kept engine's batches may hold tokens of
        self._presubmitted: tuple | None = None  # (rows, request) of ``presubmit``
        self._recomputed_seen = 0  # the kept engine's recomputed KV tokens (weight swaps) logged so far

    def update_params(self, params: Any, version: int) -> None:
        """The params the next rollouts sample with (not copied), and their version (recorded per batch). A kept
        engine swaps to them at its next decode call: the batch in flight samples its later tokens with them."""
        self.params, self.version = params, version
        if self._keep_engine:
            self._params_of[version] = params

    def keep_engine(self) -> None:
        """From now on, sample on one engine running across calls (``presubmit`` and ``on_tail`` need it); its
        KV pool stays allocated between rollouts."""
        self._keep_engine = True
        if self.params is not None:
            self._params_of[self.version] = self.params

    def presubmit(self, rows: list[dict], key: jax.Array) -> None:
        """Queues the next call's prompts on the running engine now (with the current params version), so they
        enter the decode slots the batch in flight frees; the next call with these ``rows`` collects them."""
        G = self.grpo.num_generations
        engine = self._engine_for(self._sampler_params(), len(rows) * G)
        self._presubmitted = (rows, self._submit(engine, rows, key))

    def __call__(
        self,
        rows: list[dict],
        key: jax.Array,
        extra_rows: Iterator[list[dict]] | None = None,
        on_tail: Callable[[], None] | None = None,
    ) -> Batch:
        """G completions of each of the P ``rows``, scored, as the update's ``Batch`` (``host`` filled).

        Args:
          rows: P prompt rows (``prompt_ids`` and the task's fields).
          key: this rollout's PRNG key (dynamic sampling's later rounds fold in their index).
          extra_rows: more prompt batches for DAPO dynamic sampling (``filter_zero_std_groups``); without it
            zero-std groups are kept.
          on_tail: with a kept engine, called once when half its decode slots are free and none of these rows
            waits for one (the tail of the batch: e.g. to ``update_params`` and ``presubmit`` the next batch).

        Raises:
          RewardFunctionError: a reward function misbehaved (from the task).
        """
        if self.params is None:
            raise ValueError("Rollout has no params: call update_params(params, version) first")
        grpo, G = self.grpo, self.grpo.num_generations
        version = self.version  # the batch's first tokens'; a kept engine's tail may sample with later ones
        t_start = time.perf_counter()
        self._times = {"time/rollout_s": 0.0, "time/reshard_s": 0.0}
        if self.teacher is not None:
            self._times["time/teacher_s"] = 0.0
        self._rounds: list[GenerateOutput] = []  # every sampling round's output (dynamic sampling: several)
        self._on_tail = on_tail
        out, scores, correct = self._sample(rows, key)
        zero_std = dapo.zero_std_groups(scores["total"], G)
        extra = {"zero_std_fraction": float(zero_std.mean())}
        if grpo.filter_zero_std_groups and extra_rows is not None:
            out, scores, correct, extra = self._dynamic_sampling(
                out, scores, correct, zero_std, extra_rows, key, extra
            )
        extra.update(decode_work(self._rounds))
        self._rounds = []
        advantages = compute_advantages(
            scores["total"].astype(np.float32),
            G,
            scale_rewards=grpo.scale_rewards,
            estimator=grpo.adv_estimator,
        )
        batch = self._place(out, advantages)
        info = RolloutInfo(
            rewards=scores,
            correct=np.asarray(correct, np.float64),
            finish_reason=list(out.finish_reason),
            advantages=np.asarray(advantages, np.float32),
            completion_lengths=np.asarray(out.completion_mask).sum(axis=1),
            prompt_tokens=int(np.asarray(out.prompt_mask).sum()) * G,
            policy_version=version,
            extra=extra,
        )
        versions = out.policy_versions
        if versions is not None and self._keep_engine:
            newer = (versions > version).sum() / max(int((versions >= 0).sum()), 1)
            extra["rollout/newer_version_token_fraction"] = float(newer)
            recomputed = self.engine.stats["recomputed_tokens"] if self.engine is not None else 0
            extra["rollout/recomputed_kv_tokens"] = float(recomputed - self._recomputed_seen)
            self._recomputed_seen = recomputed
        t_scored = time.perf_counter()
        batch = self._logprobs(batch, versions, version)
        info.timings = {
            **self._times,
            "time/rewards_s": t_scored - t_start - self._times["time/rollout_s"],
        }
        # the reference's and pi_old's passes; the teacher's is time/teacher_s
        info.timings["time/reference_s"] = (
            time.perf_counter() - t_scored - self._times.get("time/teacher_s", 0.0)
        )
        return batch.replace(host=info)

    def _sampler_params(self) -> Any:
        """The params as the sampler reads them (resharded onto its mesh when the layouts differ)."""
        params = self.params
        if self.mesh is not None and self.rollout_mesh is not None:
            params, reshard_s = sharding.reshard_for_rollout(
                params, self.mesh, self.rollout_mesh, dtype=self.model_cfg.dtype
            )
            if hasattr(self, "_times"):
                self._times["time/reshard_s"] += reshard_s
        return params

    def _engine_for(self, params: Any, num_slots: int) -> Engine:
        """The kept engine on ``params`` at this version, created at first use with ``num_slots`` decode slots."""
        if self.engine is None:
            with mesh_context(self.rollout_mesh or self.mesh):
                self.engine = Engine(
                    params, self.model_cfg, self.sampler_cfg, version=self.version, num_slots=num_slots
                )
        elif self.engine.version != self.version:
            self.engine.update_params(params, self.version)
        return self.engine

    def _engine_generate(self, params: Any, rows: list[dict], key: jax.Array) -> GenerateOutput:
        """``generate`` on the kept engine: the presubmitted request of these rows, or a new one; ``on_tail``
        called once when the batch's tail frees half the slots."""
        engine = self._engine_for(params, len(rows) * self.grpo.num_generations)
        if self._presubmitted is not None and self._presubmitted[0] is rows:
            request = self._presubmitted[1]
        else:
            request = self._submit(engine, rows, key)
        self._presubmitted = None
        with mesh_context(self.rollout_mesh or self.mesh):
            while not request.done:
                engine.step()
                tail = not engine.waiting(request) and engine.num_running <= engine.num_slots // 2
                if self._on_tail is not None and tail:
                    hook, self._on_tail = self._on_tail, None
                    hook()
        return engine.collect(request)

    def _submit(self, engine: Engine, rows: list[dict], key: jax.Array) -> Request:
        """G completions of each row's prompt queued on ``engine`` (truncated by ``prepare_prompts``)."""
        kept, indices = prepare_prompts([row["prompt_ids"] for row in rows], self.sampler_cfg)
        return engine.submit(kept, key, self.grpo.num_generations, prompt_indices=indices)

    def _sample(self, rows: list[dict], key: jax.Array) -> tuple[GenerateOutput, dict[str, np.ndarray], Any]:
        """One sampling round: G completions of each row, their rewards (plus overlong) and correctness."""
        t0 = time.perf_counter()
        params = self._sampler_params()
        prompts = [row["prompt_ids"] for row in rows]
        if self._keep_engine:
            out = self._engine_generate(params, rows, key)
        else:
            with mesh_context(self.rollout_mesh or self.mesh):
                out = generate(
                    params,
                    prompts,
                    self.model_cfg,
                    self.sampler_cfg,
                    key,
                    num_generations=self.grpo.num_generations,
                )
        del params
        release_host_memory()
        self._times["time/rollout_s"] += time.perf_counter() - t0
        self._rounds.append(out)
        repeated = [rows[i] for i in out.prompt_indices for _ in range(self.grpo.num_generations)]
        raw, correct = self.scorer(repeated, out)
        scores = {name: np.asarray(values, np.float64) for name, values in raw.items()}
        if self.grpo.overlong_buffer_length > 0:
            scores["overlong"] = dapo.overlong_penalty(
                np.asarray(out.completion_mask).sum(axis=1),
                self.sampler_cfg.max_completion_length,
                self.grpo.overlong_buffer_length,
                self.grpo.overlong_penalty_factor,
            )
            scores["total"] = scores["total"] + scores["overlong"]  # an abstained row stays NaN
        return out, scores, np.asarray(correct, np.float64)

    def _dynamic_sampling(self, out, scores, correct, zero_std, extra_rows, key, metrics):
        """DAPO dynamic sampling: more prompt batches until P groups have signal (``grpax.rl.dapo``).

        Returns:
          The rollout of P groups (those with signal first, in sampling order), its scores and correctness, and
          ``metrics`` plus ``dynamic_sampling/{batches,dropped_groups,filled_groups}``.
        """
        G, num_groups = self.grpo.num_generations, len(zero_std)
        outs, all_scores, all_correct, flags = [out], [scores], [correct], [zero_std]
        while (
            int((~np.concatenate(flags)).sum()) < num_groups
            and len(outs) < self.grpo.dynamic_sampling_max_batches
        ):
            more, more_scores, more_correct = self._sample(next(extra_rows), prng.fold_in(key, len(outs)))
            outs.append(more)
            all_scores.append(more_scores)
            all_correct.append(more_correct)
            flags.append(dapo.zero_std_groups(more_scores["total"], G))
        groups, filled = dapo.pick_groups(np.concatenate(flags), num_groups)
        picked_rows = (groups[:, None] * G + np.arange(G)).reshape(-1)
        picked = {name: np.concatenate([s[name] for s in all_scores])[picked_rows] for name in scores}
        metrics = {
            **metrics,
            "dynamic_sampling/batches": float(len(outs)),
            "dynamic_sampling/dropped_groups": float(np.concatenate(flags).sum() - filled),
            "dynamic_sampling/filled_groups": float(filled),
        }
        out = dapo.take_groups(outs, groups, G, self.sampler_cfg.pad_token_id)
        return out, picked, np.concatenate(all_correct)[picked_rows], metrics

    def _place(self, out: GenerateOutput, advantages: np.ndarray) -> Batch:
        """The update's arrays on the trainer's mesh (every process holds the whole rollout and computed the
        same rewards: each keeps its devices' rows), or as plain device arrays without one; the completion axis
        cut to the longest completion's bucket (the same on every process: the rollouts are equal), or kept whole
        with the fixed program set."""
        longest, C = counted_length(out.completion_mask), out.completion_ids.shape[1]
        # The fixed program set (accelerators): the update and the reference pass run on the full widths too, one
        # program each, as the compile check compiled them (decided here, for every rollout's ``_sample``).
        full_width = fixed_programs(self.sampler_cfg, self.params)
        batch = Batch(
            prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            advantages=np.asarray(advantages, np.float32),
            rollout_logprobs=out.logprobs,  # the behaviour policy's: the mismatch metrics
            truncated=np.asarray([r == "length" for r in out.finish_reason]),
            routed_experts=out.routed_experts,  # a mixture of experts' (router_replay): metrics, replay
            prompt_routed_experts=out.prompt_routed_experts,
        ).trim_completions(C if full_width else completion_bucket(longest, C, self.min_completion_bucket))
        if self.mesh is not None:
            return sharding.shard_global_batch(batch, self.mesh)
        return jax.tree.map(jnp.asarray, batch)

    def _logprobs(
        self, batch: Batch, versions: np.ndarray | None = None, version: int | None = None
    ) -> Batch:
        """The reference's logprobs (beta > 0), the teacher's (``distillation_coef`` > 0) and, where
        ``GRPOConfig.needs_old_logprobs``, the sampling params' own (pi_old of the clipped ratio): each token's
        under the version that sampled it
        (``versions`` int32 [B, C], -1 where masked; a kept engine's batch may hold two), else ``self.params``'."""
        temperature, M = self.grpo.temperature, self.num_micro_batches
        replay = self.grpo.router_replay == "replay"  # a mixture of experts routed by the sampler's routing
        with mesh_context(self.mesh):
            if self.reference is not None:
                # mapped from files on a CPU host, unmapped after
                ref = self.reference.apply(
                    compute_logprobs, batch, self.model_cfg, temperature, M, replay, self.logprobs_options
                )
                batch = batch.replace(ref_logprobs=ref)
                release_host_memory()
            if self.teacher is not None:  # its own model; never the student's recorded routes
                t0 = time.perf_counter()
                teacher = self.teacher.apply(
                    compute_logprobs, batch, self.teacher_cfg, temperature, M, False, self.logprobs_options
                )
                batch = batch.replace(teacher_logprobs=teacher)
                release_host_memory()
                self._times["time/teacher_s"] = time.perf_counter() - t0
            if self.grpo.needs_old_logprobs:  # pi_old: the sampling params'
                old = self._old_logprobs(batch, versions, replay)
                batch = batch.replace(old_logprobs=old)
        if self._keep_engine and version is not None:  # no later batch holds tokens of older versions
            self._params_of = {v: p for v, p in self._params_of.items() if v >= self.version}
        return batch

    def _old_logprobs(self, batch: Batch, versions: np.ndarray | None, replay: bool) -> Any:
        """pi_old: each token's logprob under the params version that sampled it (``versions``), else under
        ``self.params``; ``replay``: a mixture of experts routed by the batch's recorded routing."""
        temperature, M = self.grpo.temperature, self.num_micro_batches
        present = [] if versions is None or not self._keep_engine else sorted(set(np.unique(versions)) - {-1})
        if len(present) <= 1:
            params = self._params_of.get(present[0], self.params) if present else self.params
            return compute_logprobs(
                params, batch, self.model_cfg, temperature, M, replay, self.logprobs_options
            )
        versions = versions[:, : batch.completion_ids.shape[1]]  # the batch's completion axis is trimmed
        old = None
        for v in present:
            lp = compute_logprobs(
                self._params_of[v], batch, self.model_cfg, temperature, M, replay, self.logprobs_options
            )
            old = lp if old is None else jnp.where(jnp.asarray(versions == v), lp, old)
        return old
