"""Multi-turn rollouts as one ``Batch``: the trajectories of ``grpax.sampler.multi_turn`` (a model that calls tools
or plays an environment between its turns), scored by the task and the environment, for the GRPO update.

``completion_ids`` holds the whole trajectory after the prompt (model and observation tokens), ``completion_mask``
is 1 only at the model's tokens, so observation tokens are attended by the update's forward but are out of the
loss and the KL; the reward is per trajectory (``score_trajectories``: the task's reward functions on the
trajectory's text, plus the environment's points, ``rewards/environment``), so are the advantages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from grpax import sharding
from grpax.models.registry import ModelConfig
from grpax.rl.rollout import Rollout
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.multi_turn import MultiTurnOutput, trajectory_sampler
from grpax.tasks.environment import MultiTurnConfig


class MultiTurnRollout(Rollout):
    """``Rollout`` whose trajectories talk to an environment between turns (``grpax.sampler.multi_turn.generate_multi_turn``).

    Args:
      task: scores each trajectory's text (observations included) with its reward functions; the
        environment's points are added as ``rewards/environment``.
      tokenizer: renders prompts and observations.
      env_factory: makes one environment per trajectory (``grpax.tasks.environment.load_environment``).
      turn_cfg: the turn budgets and tool format.
      The other arguments are ``Rollout``'s (``scorer`` unused; DAPO dynamic sampling is not supported).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        sampler_cfg: SamplerConfig,
        grpo: Any,
        task: Any,
        tokenizer: Any,
        env_factory: Callable[[], Any],
        turn_cfg: MultiTurnConfig,
        **kwargs: Any,
    ):
        super().__init__(model_cfg, sampler_cfg, grpo, scorer=None, **kwargs)
        self.task, self.tokenizer, self.env_factory, self.turn_cfg = task, tokenizer, env_factory, turn_cfg
        self._turn_metrics: dict[str, float] = {}

    def __call__(self, rows: list[dict], key: jax.Array, extra_rows: Any = None):
        batch = super().__call__(rows, key, None)
        batch.host.extra.update(self._turn_metrics)
        return batch

    def _sample(self, rows: list[dict], key: jax.Array):
        t0 = time.perf_counter()
        params = self.params
        if self.mesh is not None and self.rollout_mesh is not None:
            params, reshard_s = sharding.reshard_for_rollout(
                params, self.mesh, self.rollout_mesh, dtype=self.model_cfg.dtype
            )
            self._times["time/reshard_s"] += reshard_s
        sample = trajectory_sampler(
            self.task,
            self.tokenizer,
            self.env_factory,
            self.model_cfg,
            self.sampler_cfg,
            self.turn_cfg,
            mesh=self.rollout_mesh or self.mesh,
        )
        out = sample(params, rows, key, self.grpo.num_generations)
        self._times["time/rollout_s"] += time.perf_counter() - t0
        repeated = [rows[i] for i in out.prompt_indices for _ in range(self.grpo.num_generations)]
        scores, correct = score_trajectories(self.task, repeated, out)
        self._turn_metrics = out.metrics()
        return out, scores, correct


def score_trajectories(
    task: Any, rows: list[dict], out: MultiTurnOutput
) -> tuple[dict[str, np.ndarray], Any]:
    """The task's rewards on each trajectory's text plus the environment's points (``"environment"``, added
    to ``"total"``), and which trajectories the task calls correct."""
    raw = task.score(rows, out.texts)
    scores = {name: np.asarray(values, np.float64) for name, values in raw.items()}
    scores["environment"] = out.env_rewards.astype(np.float64)
    scores["total"] = scores["total"] + scores["environment"]
    correct = task.step_correct(rows, out.texts, scores)
    return scores, np.asarray(correct, np.float64)
