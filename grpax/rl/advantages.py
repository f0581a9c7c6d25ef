"""Group-relative advantages for GRPO (host-side numpy; rewards come from Python reward functions).

GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2, outcome supervision) replaces PPO's value network by a
baseline computed from the G completions sampled for the same prompt:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)

and gives every token of completion i the same advantage A_i. ``scale_rewards`` selects the denominator:
``"group"`` is the equation above; ``"batch"`` divides by the std of all rewards in the batch (TRL's
``scale_rewards="batch"``: group mean, batch std, as in "Tricks or Traps?", Liu et al. 2025); ``"none"`` keeps only
the mean subtraction, as Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025, eq. 3) argues the
std division biases learning toward too-easy and too-hard prompts. The std is the unbiased sample std
(ddof=1) and eps = 1e-4, as in TRL and Tunix.

``estimator="rloo"`` (REINFORCE Leave-One-Out; Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline
for free!"; Ahmadian et al. 2024, "Back to Basics", eq. 7) takes as each row's baseline the mean of the OTHER
G - 1 rewards of its group, a baseline independent of the row's own sample:

    A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r_1..r_G))

so RLOO is GRPO's mean-centred reward scaled by G/(G-1) (n/(n-1) over a group's n valid rows).
``scale_rewards`` then divides it as for GRPO; TRL's ``RLOOTrainer`` (default ``normalize_advantages=False``)
and verl's ``algorithm.adv_estimator=rloo`` divide by nothing: ``scale_rewards="none"``.

Rows are grouped contiguously: row i answers prompt i // G. A NaN reward means "abstain" (e.g. a reward
function that could not score the row): it is left out of its group's mean and std and its advantage is 0.
A group whose valid rewards are all equal has no signal and gets advantages of exactly 0.0, with no float
residue, so such rows contribute exactly nothing to the gradient.

The statistics are computed in float64 and the result is cast to float32.
"""

from __future__ import annotations

import numpy as np

from grpax.rl.config import ADV_ESTIMATORS, SCALE_REWARDS


def compute_advantages(
    rewards,
    num_generations: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    return_stats: bool = False,
    estimator: str = "grpo",
):
    """Group-relative advantages A_i = (r_i - baseline_i) / (std + eps).

    Args:
      rewards: float [B] rewards in points; NaN marks an abstained row. B = num_prompts * G, grouped
        contiguously (row i answers prompt i // G).
      num_generations: G, the group size.
      scale_rewards: "group" (std of the group), "batch" (std of the whole batch, NaN rows excluded) or
        "none" (Dr. GRPO: no std division).
      eps: added to the std before dividing.
      return_stats: also return a dict of host-side statistics.
      estimator: the baseline: "grpo" (the group mean) or "rloo" (the mean of the group's other valid rows).

    Returns:
      advantages float32 [B] (numpy); with ``return_stats`` a tuple (advantages, stats) where stats holds
      ``num_nan_rewards`` (rows excluded), ``frac_zero_std_groups`` (groups with no signal: all valid rewards
      equal, or fewer than 2 valid rows), ``reward_mean`` and ``reward_std`` (over valid rows, ddof=0 for
      reporting), ``group_std_mean`` (mean over groups of the ddof=1 std).

    Raises:
      ValueError: if rewards is not 1-D, B is not a multiple of num_generations, or scale_rewards or estimator
        is unknown (num_generations >= 2 is checked where it enters, ``GRPOConfig``).

    Example:
      >>> compute_advantages([1.0, 0.0, 2.0, 2.0], num_generations=2)
      array([ 0.7070068, -0.7070068,  0.       ,  0.       ], dtype=float32)

      Group 0: mean 0.5, std (ddof=1) 0.70711, so A = +-0.5 / (0.70711 + 1e-4); group 1 has equal rewards: exactly 0.

      >>> compute_advantages([1.0, 0.0, 0.0], num_generations=3, scale_rewards="none", estimator="rloo")
      array([ 1. , -0.5, -0.5], dtype=float32)

      Row 0: 1 - mean(0, 0) = 1; rows 1 and 2: 0 - mean(1, 0) = -0.5 (= 3/2 (r_i - 1/3)).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {r.shape}")
    if r.shape[0] % num_generations != 0:
        raise ValueError(
            f"batch of {r.shape[0]} rewards is not a multiple of num_generations={num_generations}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected one of {', '.join(SCALE_REWARDS)}")
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator={estimator!r}: expected one of {', '.join(ADV_ESTIMATORS)}")

    grouped = r.reshape(-1, num_generations)  # [P, G]
    valid = ~np.isnan(grouped)
    num_valid = valid.sum(axis=1, keepdims=True)  # [P, 1]
    filled = np.where(valid, grouped, 0.0)
    mean = filled.sum(axis=1, keepdims=True) / np.maximum(num_valid, 1)
    centered = np.where(valid, grouped - mean, 0.0)
    group_std = np.sqrt((centered**2).sum(axis=1, keepdims=True) / np.maximum(num_valid - 1, 1))
    # A group with equal valid rewards (or < 2 valid rows) has no signal; forcing exact zeros removes the
    # ~1e-17 residue that r - mean can leave when mean is not exactly representable.
    lo = np.where(valid, grouped, np.inf).min(axis=1, keepdims=True)
    hi = np.where(valid, grouped, -np.inf).max(axis=1, keepdims=True)
    no_signal = (num_valid < 2) | (lo == hi)
    centered = np.where(no_signal, 0.0, centered)
    if (
        estimator == "rloo"
    ):  # r_i - mean of the n - 1 others = n / (n - 1) (r_i - mean); n >= 2 where not zero
        centered = centered * num_valid / np.maximum(num_valid - 1, 1)

    if scale_rewards == "group":
        advantages = centered / (group_std + eps)
    elif scale_rewards == "batch":
        flat = r[~np.isnan(r)]
        batch_std = flat.std(ddof=1) if flat.size > 1 else 0.0
        advantages = centered / (batch_std + eps)
    else:
        advantages = centered
    advantages = advantages.reshape(-1).astype(np.float32)
    if not return_stats:
        return advantages
    flat = r[~np.isnan(r)]
    stats = {
        "num_nan_rewards": int(np.isnan(r).sum()),
        "frac_zero_std_groups": float(no_signal.mean()),
        "reward_mean": float(flat.mean()) if flat.size else float("nan"),
        "reward_std": float(flat.std()) if flat.size else float("nan"),
        "group_std_mean": float(np.where(no_signal, 0.0, group_std).mean()),
    }
    return advantages, stats
