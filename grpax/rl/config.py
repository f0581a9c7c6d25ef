"""``GRPOConfig``: the algorithm and optimizer keys of a GRPO run, each tied to its paper symbol.

The objective (DeepSeekMath, Shao et al. 2024, eq. 3) for a prompt q with G sampled completions o_1..o_G:

    J(theta) = 1/G sum_i 1/|o_i| sum_t { min(r_it A_i, clip(r_it, 1 - eps, 1 + eps_high) A_i) - beta KL_t }

with r_it = pi_theta(o_it) / pi_old(o_it) and A_i the group-relative advantage (``grpax.rl.advantages``).
Variants are selected by keys rather than classes: DAPO (Yu et al. 2025) clip-higher ``epsilon_high`` and
``loss_agg_mode="token-mean"``; Dr. GRPO (Liu et al. 2025) ``scale_rewards="none"`` and
``loss_agg_mode="sequence-mean-token-sum-norm"``; GSPO (Zheng et al. 2025) ``importance_sampling_level=
"sequence"``; CISPO (MiniMax 2025) ``loss_type="cispo"``; RLOO's leave-one-out baseline
``adv_estimator="rloo"``; on-policy distillation (a teacher's per-token reverse KL in the advantage,
``grpax.rl.distill``) ``distillation_coef``. Rollout correction (``vllm_importance_sampling_*``,
``grpax.rl.correction``) weights each token's loss by the trainer / sampler probability ratio.
``docs/algorithm.md`` explains the defaults and where they differ from MaxText's ``rl.yml``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from grpax.config import ConfigError, field

# The accepted values of the keys with a fixed set; the library modules use these tuples too.
LOSS_AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm")
SCALE_REWARDS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
LR_SCHEDULES = ("cosine", "linear", "constant")
MU_DTYPES = ("", "float32", "bfloat16")
# TRL's vllm_importance_sampling_mode values: {token, sequence} x {truncate (TIS), mask (MIS / IcePop)}.
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOSS_TYPES = ("ppo_clip", "cispo")  # verl's name for the clipped surrogate; TRL's and verl's "cispo"
ADV_ESTIMATORS = ("grpo", "rloo")  # verl's algorithm.adv_estimator values
# A mixture of experts' routing replay (R3): off, the sampler's routes recorded (router/* metrics only), or the
# trainer's passes routed by them (docs/algorithm.md, "Routing replay").
ROUTER_REPLAY_MODES = ("none", "record", "replay")
# TRL's loss_type values that choose an aggregation (here loss_agg_mode) rather than an objective.
_TRL_AGGREGATION_LOSS_TYPES = {
    "grpo": "sequence-mean-token-mean",
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "sequence-mean-token-sum-norm",
}


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO algorithm and optimizer hyper-parameters (see the module docstring for the objective)."""

    # MaxText key -> our key, so MaxText command lines (rl.yml names) work unchanged.
    ALIASES: ClassVar[dict[str, str]] = {
        "grpo_beta": "beta",
        "grpo_epsilon": "epsilon",
        "adam_b1": "b1",
        "adam_b2": "b2",
        "adam_weight_decay": "weight_decay",
        "gradient_clipping_threshold": "max_grad_norm",
        "warmup_steps_fraction": "warmup_ratio",
        "decode_sampling_temperature": "temperature",
        "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL's older (deprecated) name
        "advantage_estimator": "adv_estimator",
    }

    num_generations: int = field(
        4, "G: completions sampled per prompt; advantages are relative within a group"
    )
    num_iterations: int = field(1, "mu: policy updates per sampled batch (1 = on-policy, ratio r == 1)")
    beta: float = field(0.04, "beta: KL coefficient in the GRPO objective; 0 skips the reference model")
    distillation_coef: float = field(
        0.0,
        "lambda of on-policy distillation (Thinking Machines 2025; MiniLLM's reverse KL): each completion token's "
        "advantage gains -lambda (log pi_old - log pi_teacher) of the sampled token (teacher_parameters_path); "
        "0 = GRPO as without a teacher (docs/algorithm.md, 'On-policy distillation')",
    )
    epsilon: float = field(0.2, "eps: lower clip range, the ratio is clipped at 1 - eps")
    epsilon_high: float | None = field(
        None, "eps_high: upper clip range, 1 + eps_high (DAPO clip-higher); None = epsilon"
    )
    kl_estimator: str = field("k3", "KL_t estimator of KL(pi_theta || pi_ref): k1, k2 or k3 (Schulman 2020)")
    loss_agg_mode: str = field(
        "token-mean", "how per-token losses are averaged: " + ", ".join(LOSS_AGG_MODES)
    )
    scale_rewards: str = field(
        "group", "A_i = (r_i - mean_group) / std: std of the group, batch, or none (Dr. GRPO)"
    )
    importance_sampling_level: str = field("token", "r_it per token (GRPO) or one ratio per sequence (GSPO)")
    loss_type: str = field(
        "ppo_clip",
        "the objective: ppo_clip (GRPO's clipped surrogate min(r A, clip(r) A)) or cispo (MiniMax-M1: "
        "sg(clip(r, 1 - eps, 1 + eps_high)) A log pi, every token keeps its gradient); aggregation is "
        "loss_agg_mode",
    )
    adv_estimator: str = field(
        "grpo",
        "the baseline of A_i: grpo (group mean) or rloo (mean of the other G - 1 rewards); the std "
        "division is scale_rewards' (TRL's and verl's RLOO: scale_rewards=none)",
    )
    max_staleness: int = field(
        0,
        "how many updates the policy that sampled a batch may lag behind the one it trains (TRL "
        "AsyncGRPOTrainer's key): 0 = synchronous (sample, then update); N >= 1 = the rollout of step k + N runs "
        "in a background thread while step k's update runs, sampled by the params after update k (pi_old "
        "recomputed by the trainer; docs/algorithm.md, 'Off-policy rollouts')",
    )
    vllm_importance_sampling_correction: bool | None = field(
        None,
        "rollout correction (TRL's key): weight each token's loss by the stop-gradient ratio w = pi_old / "
        "pi_sampler of the trainer's and the sampler's logprobs, bounded by vllm_importance_sampling_mode; "
        "None (default) = on when max_staleness > 0, off on-policy (there the two differ only by rounding)",
    )
    vllm_importance_sampling_mode: str = field(
        "token_truncate",
        "with the correction on: token_truncate (TIS: w clipped to [clip_min, clip_max]), token_mask (MIS: "
        "w = 0 outside [clip_min, clip_max]; IcePop with both bounds), sequence_truncate, sequence_mask (one w "
        "per sequence: the product of its tokens' ratios)",
    )
    vllm_importance_sampling_clip_max: float | None = field(
        2.0, "C_max: the upper bound of the rollout-correction weight w (TIS cap C); None = no upper bound"
    )
    vllm_importance_sampling_clip_min: float | None = field(
        None,
        "C_min: the lower bound of w (IcePop: 0.5 with clip_max 5.0 and token_mask); None = no lower bound",
    )
    mask_truncated_completions: bool = field(
        False, "drop completions that hit max_completion_length from the loss (DAPO overlong filtering)"
    )
    filter_zero_std_groups: bool = field(
        False,
        "DAPO dynamic sampling: drop groups whose G rewards are all equal (no signal) and sample more prompts "
        "until the batch holds batch_size groups with signal",
    )
    dynamic_sampling_max_batches: int = field(
        3,
        "with filter_zero_std_groups: prompt batches sampled per step at most (the first included); a batch "
        "still short after them is filled with zero-std groups (zero advantages, counted in "
        "dynamic_sampling/filled_groups)",
    )
    overlong_buffer_length: int = field(
        0,
        "L_cache of DAPO's soft overlong punishment (eq. 13), in tokens: completions longer than "
        "max_completion_length - L_cache lose up to overlong_penalty_factor points; 0 = off",
    )
    overlong_penalty_factor: float = field(1.0, "points of the overlong punishment at max_completion_length")
    temperature: float = field(0.9, "tau: sampling temperature; logprobs are of logits / tau")
    learning_rate: float = field(3e-6, "eta: peak AdamW learning rate")
    b1: float = field(0.9, "AdamW beta_1 (first-moment decay)")
    b2: float = field(0.99, "AdamW beta_2 (second-moment decay)")
    weight_decay: float = field(
        0.1, "AdamW decoupled weight decay lambda (weight matrices and embeddings; not norms or biases)"
    )
    adam_eps: float = field(1e-8, "AdamW epsilon added to sqrt(v)")
    mu_dtype: str = field(
        "",
        "dtype of AdamW's first moment m (MaxText mu_dtype): '' = float32 (the params' or their master "
        "copy's), or bfloat16 (half its memory; v and the update stay float32)",
    )
    max_grad_norm: float = field(0.1, "clip the global gradient norm to this value; 0 disables clipping")
    warmup_ratio: float = field(0.1, "fraction of the training steps spent in linear warmup from 0")
    lr_schedule: str = field("cosine", "after warmup: cosine (to end_lr_ratio * eta), linear, or constant")
    end_lr_ratio: float = field(0.0, "final learning rate as a fraction of learning_rate")
    learning_rate_schedule_steps: int = field(
        -1,
        "the schedule's length in training steps (MaxText key; warmup_ratio is of it): -1 = num_batches; longer: "
        "the run ends before the decay does; shorter: the rate stays at end_lr_ratio x learning_rate after it",
    )

    num_micro_batches: int = field(
        1,
        "gradient accumulation: the batch rows are split into this many "
        "micro-batches; the update equals the full-batch update (train_rl: only with micro_batch_size=-1)",
    )
    router_replay: str = field(
        "none",
        "a mixture of experts' rollout routing replay (R3, Ma et al. 2025): none; record (the sampler records "
        "each token's top-k experts per layer, the router/disagreement_* metrics compare the trainer's own "
        "top-k with them); replay (recorded, and the update, reference and pi_old passes route by them)",
    )
    load_balance_loss_weight: float = field(
        0.0,
        "coefficient of a mixture of experts' auxiliary load-balancing loss (Switch Transformer's, per layer, "
        "averaged; MaxText's key), added to the GRPO loss; 0 = off, as the reference RL stacks train",
    )

    def __post_init__(self):
        validate(self)

    @property
    def rollout_is_mode(self) -> str | None:
        """The rollout correction of the loss: an ``IMPORTANCE_SAMPLING_MODES`` value, or None (off)."""
        return self.vllm_importance_sampling_mode if self.rollout_correction else None

    @property
    def rollout_correction(self) -> bool:
        """vllm_importance_sampling_correction, its default (None) resolved: on when max_staleness > 0."""
        on = self.vllm_importance_sampling_correction
        return self.max_staleness > 0 if on is None else on

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the update reads ``old_logprobs`` (pi_old recomputed by the trainer at the sampling params):
        with num_iterations > 1 (the later updates move away from pi_old) or max_staleness > 0 (the update runs
        at a later version than the one that sampled). Otherwise pi_old is the update's own logprobs (ratio 1).
        The rollout, the compile check, the memory estimate and the step cost all read this one predicate."""
        return self.num_iterations > 1 or self.max_staleness > 0

    @property
    def clip_high(self) -> float:
        """eps_high, defaulting to eps."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def schedule_steps(self, num_batches: int) -> int:
        """Optimizer updates the learning-rate schedule spans (``schedule_steps``)."""
        return schedule_steps(num_batches, self.learning_rate_schedule_steps, self.num_iterations)

    def replace(self, **kwargs) -> GRPOConfig:
        return dataclasses.replace(self, **kwargs)


def schedule_steps(num_batches: int, learning_rate_schedule_steps: int, num_iterations: int) -> int:
    """Optimizer updates the learning-rate schedule spans: its training steps (``learning_rate_schedule_steps``,
    -1 = ``num_batches``) x ``num_iterations``."""
    steps = num_batches if learning_rate_schedule_steps < 0 else learning_rate_schedule_steps
    return steps * num_iterations


def validate(cfg: GRPOConfig) -> None:
    """Raises ConfigError naming the bad key."""
    _validate_choices(cfg)
    _validate_counts(cfg)
    _validate_rollout_correction(cfg)
    _validate_numbers(cfg)


def _validate_choices(cfg: GRPOConfig) -> None:
    """The keys with a fixed set of values."""
    choices = {
        "kl_estimator": KL_ESTIMATORS,
        "loss_agg_mode": LOSS_AGG_MODES,
        "scale_rewards": SCALE_REWARDS,
        "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
        "lr_schedule": LR_SCHEDULES,
        "adv_estimator": ADV_ESTIMATORS,
        "vllm_importance_sampling_mode": IMPORTANCE_SAMPLING_MODES,
        "router_replay": ROUTER_REPLAY_MODES,
    }
    if cfg.loss_type in _TRL_AGGREGATION_LOSS_TYPES:
        raise ConfigError(
            f"loss_type={cfg.loss_type!r} is TRL's name for an aggregation: set loss_type=ppo_clip "
            f"loss_agg_mode={_TRL_AGGREGATION_LOSS_TYPES[cfg.loss_type]}"
        )
    if cfg.loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={cfg.loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    if cfg.mu_dtype not in MU_DTYPES:
        raise ConfigError(f"mu_dtype={cfg.mu_dtype!r}: expected '' (the params' dtype), float32 or bfloat16")
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            raise ConfigError(f"{key}={getattr(cfg, key)!r}: expected one of {', '.join(valid)}")


def _validate_counts(cfg: GRPOConfig) -> None:
    """The integer keys (completions, updates, staleness, micro-batches, DAPO's batches and buffer)."""
    if cfg.num_generations < 2:
        raise ConfigError(
            f"num_generations={cfg.num_generations}: GRPO needs at least 2 completions per prompt"
        )
    if cfg.num_iterations < 1:
        raise ConfigError(f"num_iterations={cfg.num_iterations}: expected >= 1")
    if cfg.max_staleness < 0:
        raise ConfigError(
            f"max_staleness={cfg.max_staleness}: expected >= 0 updates (0 = synchronous, 1 = one step ahead)"
        )
    if cfg.num_micro_batches < 1:
        raise ConfigError(f"num_micro_batches={cfg.num_micro_batches}: expected >= 1")
    if cfg.learning_rate_schedule_steps == 0 or cfg.learning_rate_schedule_steps < -1:
        raise ConfigError(
            f"learning_rate_schedule_steps={cfg.learning_rate_schedule_steps}: expected >= 1 steps, or -1 for "
            "num_batches"
        )
    if cfg.dynamic_sampling_max_batches < (2 if cfg.filter_zero_std_groups else 1):
        raise ConfigError(
            f"dynamic_sampling_max_batches={cfg.dynamic_sampling_max_batches}: expected >= 2 with "
            "filter_zero_std_groups=true (the first batch and at least one more to refill dropped groups)"
        )
    if cfg.overlong_buffer_length < 0 or not 0 <= cfg.overlong_penalty_factor < math.inf:
        raise ConfigError(
            f"overlong_buffer_length={cfg.overlong_buffer_length}, overlong_penalty_factor="
            f"{cfg.overlong_penalty_factor}: expected >= 0 tokens and finite >= 0 points"
        )


def _validate_numbers(cfg: GRPOConfig) -> None:
    """The objective's, the optimizer's and the sampler's numbers: NaN or inf here would make every weight NaN
    (Adam's 0 / 0 with adam_eps=0 on a zero gradient, an infinite step), so each must be finite and in range."""
    if not (cfg.beta >= 0 and math.isfinite(cfg.beta)):  # NaN fails every comparison
        raise ConfigError(
            f"beta={cfg.beta}: expected a finite KL coefficient >= 0 (e.g. 0.04; 0 = no reference)"
        )
    if not (0 <= cfg.epsilon < 1 and 0 <= cfg.clip_high and math.isfinite(cfg.clip_high)):
        raise ConfigError(
            f"epsilon={cfg.epsilon}, epsilon_high={cfg.epsilon_high}: expected 0 <= eps < 1, finite eps_high >= 0"
        )
    at_least_0, in_0_1 = (">= 0", lambda x: x >= 0), ("in [0, 1)", lambda x: 0 <= x < 1)
    above_0 = ("> 0", lambda x: x > 0)
    ranges = {
        "temperature": (above_0, "the sampling temperature, e.g. 0.9"),
        "learning_rate": (above_0, "the peak AdamW step size, e.g. 3e-6"),
        "adam_eps": (above_0, "Adam's denominator epsilon, e.g. 1e-8"),
        "b1": (in_0_1, "Adam's first-moment decay, e.g. 0.9"),
        "b2": (in_0_1, "Adam's second-moment decay, e.g. 0.99"),
        "weight_decay": (at_least_0, "AdamW's decay, e.g. 0.1; 0 = none"),
        "max_grad_norm": (at_least_0, "the gradient clip, e.g. 0.1; 0 = off"),
        "end_lr_ratio": (at_least_0, "the final learning rate's fraction"),
        "warmup_ratio": (in_0_1, "e.g. 0.1"),
        "load_balance_loss_weight": (at_least_0, "the auxiliary loss's coefficient, e.g. 0.01; 0 = off"),
        "distillation_coef": (at_least_0, "the reverse-KL advantage's weight, e.g. 1.0; 0 = GRPO alone"),
    }
    for key, ((expected, ok), meaning) in ranges.items():
        value = getattr(cfg, key)
        if not (math.isfinite(value) and ok(value)):
            raise ConfigError(f"{key}={value}: expected a finite value {expected} ({meaning})")


def _validate_rollout_correction(cfg: GRPOConfig) -> None:
    """The bounds [C_min, C_max] of the rollout-correction weight: finite, C_min < C_max, one set when on."""
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if hi is not None and not (math.isfinite(hi) and hi > 0):
        raise ConfigError(
            f"vllm_importance_sampling_clip_max={hi}: expected a finite weight > 0 (e.g. 2.0) or None "
            "(no cap)"
        )
    if lo is not None and not (math.isfinite(lo) and lo >= 0):
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={lo}: expected a finite weight >= 0 (e.g. 0.5) or None "
            "(no floor)"
        )
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={lo} must be below vllm_importance_sampling_clip_max={hi}"
        )
    if cfg.rollout_correction and lo is None and hi is None:
        raise ConfigError(
            "vllm_importance_sampling_correction=true with neither vllm_importance_sampling_clip_max nor "
            "_clip_min: the weights would be unbounded (set vllm_importance_sampling_clip_max, e.g. 2.0)"
        )
