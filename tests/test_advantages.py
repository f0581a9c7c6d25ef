"""Group-relative advantages against hand-computed numbers."""

import math

import numpy as np
import pytest

from grpax.config import ConfigError
from grpax.rl.advantages import compute_advantages
from grpax.rl.config import GRPOConfig


def test_group_scaling_hand_computed():
    # Group of 3: mean 1, deviations (2, -1, -1), sample variance (4 + 1 + 1) / 2 = 3.
    adv = compute_advantages([3.0, 0.0, 0.0, 1.0, 2.0, 3.0], num_generations=3)
    std0 = math.sqrt(3.0) + 1e-4
    std1 = math.sqrt(((1 - 2) ** 2 + 0 + (3 - 2) ** 2) / 2) + 1e-4  # = 1 + 1e-4
    expected = [2 / std0, -1 / std0, -1 / std0, -1 / std1, 0.0, 1 / std1]
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    np.testing.assert_allclose(adv[:3], [1.1546338, -0.5773169, -0.5773169], rtol=1e-6)


def test_batch_scaling_uses_group_mean_and_batch_std():
    rewards = [3.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    adv = compute_advantages(rewards, num_generations=3, scale_rewards="batch")
    # Batch mean 1, squared deviations 4 + 1 + 1 + 0 + 0 + 0 = 6, sample variance 6 / 5.
    batch_std = math.sqrt(6 / 5) + 1e-4
    np.testing.assert_allclose(adv, [2 / batch_std, -1 / batch_std, -1 / batch_std, 0, 0, 0], rtol=1e-6)
    assert (adv[3:] == 0.0).all()


def test_none_scaling_is_mean_subtraction_only():
    adv = compute_advantages([3.0, 0.0, 0.0, 0.5, 1.5, 1.0], num_generations=3, scale_rewards="none")
    np.testing.assert_array_equal(adv, np.array([2.0, -1.0, -1.0, -0.5, 0.5, 0.0], np.float32))


def test_identical_rewards_give_exact_zero():
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 and / 3 = 0.10000000000000002: naive r - mean is -1.4e-17.
    assert np.mean([0.1, 0.1, 0.1]) != 0.1
    for mode in ("group", "batch", "none"):
        adv = compute_advantages([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.7, 0.7, 0.7], 3, scale_rewards=mode)
        assert (adv[:3] == 0.0).all() and (adv[6:] == 0.0).all(), mode
        assert adv[3] > 0


def test_nan_rewards_are_excluded_and_get_zero():
    adv, stats = compute_advantages(
        [1.0, np.nan, 0.0, 2.0, np.nan, 5.0, np.nan, np.nan], 4, return_stats=True
    )
    # Group 0 valid rewards (1, 0, 2): mean 1, sample std sqrt(2 / 2) = 1.
    np.testing.assert_allclose(adv[:4], [0.0, 0.0, -1 / 1.0001, 1 / 1.0001], rtol=1e-6)
    # Group 1 has one valid reward: no signal.
    assert (adv[4:] == 0.0).all()
    assert adv[1] == 0.0
    assert stats["num_nan_rewards"] == 4
    assert stats["frac_zero_std_groups"] == 0.5
    assert stats["reward_mean"] == pytest.approx((1 + 0 + 2 + 5) / 4)
    assert np.isfinite(adv).all()


def test_all_nan_group_is_zero():
    adv = compute_advantages([np.nan, np.nan, 1.0, 0.0], 2)
    assert adv[0] == 0.0 and adv[1] == 0.0
    np.testing.assert_allclose(
        adv[2:], [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)], rtol=1e-6
    )


def test_errors():
    with pytest.raises(ValueError, match="multiple of num_generations"):
        compute_advantages([1.0, 2.0, 3.0], 2)
    with pytest.raises(ConfigError, match="num_generations=1: GRPO needs at least 2 completions per prompt"):
        GRPOConfig(num_generations=1)  # checked once, where the value enters
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages([[1.0, 2.0]], 2)
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages([1.0, 2.0], 2, scale_rewards="global")


def test_rloo_leave_one_out_hand_computed():
    # Group (1, 0, 0, 1): row 0's baseline is mean(0, 0, 1) = 1/3, so A_0 = 2/3; row 1: 0 - 2/3.
    adv = compute_advantages([1.0, 0.0, 0.0, 1.0], 4, scale_rewards="none", estimator="rloo")
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    # G = 2: each row's baseline is the other row: A = r_i - r_j.
    adv = compute_advantages([3.0, 1.0, 2.0, 2.0], 2, scale_rewards="none", estimator="rloo")
    np.testing.assert_array_equal(adv, np.array([2.0, -2.0, 0.0, 0.0], np.float32))
    # An abstained (NaN) row is left out of the others' baselines: valid (1, 0, 2) -> 1 - 1, 0 - 1.5, 2 - 0.5.
    adv = compute_advantages([1.0, np.nan, 0.0, 2.0], 4, scale_rewards="none", estimator="rloo")
    np.testing.assert_allclose(adv, [0.0, 0.0, -1.5, 1.5], rtol=1e-6)
    # scale_rewards divides RLOO as GRPO: with the group std, RLOO is GRPO's advantage times n / (n - 1).
    rewards = [3.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    np.testing.assert_allclose(
        compute_advantages(rewards, 3, estimator="rloo"), 1.5 * compute_advantages(rewards, 3), rtol=1e-6
    )
    with pytest.raises(ValueError, match="adv_estimator='gae'"):
        compute_advantages([1.0, 2.0], 2, estimator="gae")


def test_rloo_gradient_is_minus_a_grad_logp():
    """On-policy, the loss gradient of each token is -A_i / N: RLOO's A_i, hand-computed above."""
    import jax
    import jax.numpy as jnp

    from grpax.rl.losses import policy_loss

    adv = compute_advantages([1.0, 0.0, 0.0, 1.0], 4, scale_rewards="none", estimator="rloo")
    logp, mask = jnp.full((4, 2), -1.0), jnp.ones((4, 2))
    grad = jax.grad(lambda lp: policy_loss(lp, None, None, jnp.asarray(adv), mask)[0])(logp)  # ON_POLICY keys
    np.testing.assert_allclose(grad, np.repeat(-np.array([2, -2, -2, 2])[:, None] / 3 / 8, 2, 1), rtol=1e-6)
