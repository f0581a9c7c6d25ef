"""Rollout correction (TIS / MIS / IcePop) and CISPO by hand; a perturbed behaviour policy against exact values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.config import ConfigError, build_config
from grpax.rl import train_step as train_step_module
from grpax.rl.config import GRPOConfig
from grpax.rl.correction import importance_weights
from grpax.rl.losses import policy_loss


def _policy_loss(logprobs, old, ref, adv, mask, **keys):
    """``policy_loss`` with its GRPOConfig built from ``keys`` (beta 0 unless given), the batch's extras apart."""
    call = {
        k: keys.pop(k)
        for k in ("max_completion_length", "normalizer", "truncated", "rollout_logprobs")
        if k in keys
    }
    return policy_loss(logprobs, old, ref, adv, mask, GRPOConfig(**{"beta": 0.0, **keys}), **call)


# Two rows x four tokens; row 1 has three real tokens and junk (NaN) in its padding.
# Token ratios pi_old / mu: row 0 (3.0, 0.5, 1.0, 0.4), row 1 (6.0, 2.0, 1.0, padding).
OLD = np.log([[0.9, 0.2, 0.5, 0.2], [0.6, 0.4, 0.3, 0.5]])
ROLLOUT = np.log([[0.3, 0.4, 0.5, 0.5], [0.1, 0.2, 0.3, np.nan]])
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)
COUNTED = MASK > 0


def _weights(mode, clip_max=2.0, clip_min=None):
    w, stats = importance_weights(
        jnp.array(OLD), jnp.array(ROLLOUT), jnp.array(MASK), mode, clip_max, clip_min
    )
    return np.asarray(w), {k: float(v) for k, v in stats.items()}


def test_token_truncate_is_tis():
    w, s = _weights("token_truncate", clip_max=2.0)
    np.testing.assert_allclose(w, [[2.0, 0.5, 1.0, 0.4], [2.0, 2.0, 1.0, 0.0]], rtol=1e-6)
    assert s["mismatch/is_truncated_frac"] == pytest.approx(2 / 7)  # 3.0 and 6.0; 2.0 sits on the cap
    assert s["mismatch/is_masked_frac"] == 0.0
    assert s["mismatch/is_ratio_mean"] == pytest.approx((3 + 0.5 + 1 + 0.4 + 6 + 2 + 1) / 7, rel=1e-6)
    assert s["mismatch/is_ratio_max"] == pytest.approx(6.0, rel=1e-6)
    assert s["mismatch/is_ratio_min"] == pytest.approx(0.4, rel=1e-6)
    w, s = _weights("token_truncate", clip_max=2.0, clip_min=0.5)  # two-sided truncation (TRL's C_min)
    np.testing.assert_allclose(w[0], [2.0, 0.5, 1.0, 0.5], rtol=1e-6)
    assert s["mismatch/is_truncated_frac"] == pytest.approx(3 / 7)


def test_token_mask_is_mis_and_icepop_is_its_two_sided_band():
    w, s = _weights("token_mask", clip_max=2.0)
    np.testing.assert_allclose(w, [[0.0, 0.5, 1.0, 0.4], [0.0, 2.0, 1.0, 0.0]], rtol=1e-6)
    assert s["mismatch/is_masked_frac"] == pytest.approx(2 / 7)
    assert s["mismatch/is_truncated_frac"] == 0.0
    # IcePop (Ring-1T): keep the ratio inside [alpha, beta] = [0.5, 5], zero it outside.
    w, s = _weights("token_mask", clip_max=5.0, clip_min=0.5)
    np.testing.assert_allclose(w, [[3.0, 0.5, 1.0, 0.0], [0.0, 2.0, 1.0, 0.0]], rtol=1e-6)
    assert s["mismatch/is_masked_frac"] == pytest.approx(2 / 7)  # 0.4 below, 6.0 above


def test_sequence_weights_are_the_product_of_token_ratios():
    # Row 0: 3 * 0.5 * 1 * 0.4 = 0.6; row 1: 6 * 2 * 1 = 12 (padding ignored).
    w, s = _weights("sequence_truncate", clip_max=2.0)
    np.testing.assert_allclose(w, [[0.6] * 4, [2.0, 2.0, 2.0, 0.0]], rtol=1e-5)
    assert s["mismatch/is_truncated_frac"] == pytest.approx(3 / 7)  # row 1's three tokens
    assert s["mismatch/is_ratio_max"] == pytest.approx(12.0, rel=1e-5)
    assert s["mismatch/is_ratio_mean"] == pytest.approx((4 * 0.6 + 3 * 12) / 7, rel=1e-5)
    w, s = _weights("sequence_mask", clip_max=2.0)
    np.testing.assert_allclose(w, [[0.6] * 4, [0.0] * 4], rtol=1e-5)
    assert s["mismatch/is_masked_frac"] == pytest.approx(3 / 7)
    w, _ = _weights("sequence_mask", clip_max=20.0, clip_min=1.0)  # row 0 below C_min
    np.testing.assert_allclose(w, [[0.0] * 4, [12.0, 12.0, 12.0, 0.0]], rtol=1e-5)


def test_weights_are_finite_and_stop_gradient():
    old = jnp.array([[0.0, -100.0]])
    rollout = jnp.array([[-100.0, 0.0]])  # ratios e^100 and e^-100: clamped to e^+-20 before exp
    w, s = importance_weights(old, rollout, jnp.ones((1, 2)), "token_mask", None, None)
    assert np.isfinite(np.asarray(w)).all() and float(s["mismatch/is_ratio_max"]) == pytest.approx(
        math.exp(20)
    )
    grad = jax.grad(lambda o: jnp.sum(importance_weights(o, rollout, jnp.ones((1, 2)), "token_truncate")[0]))(
        old
    )
    assert (np.asarray(grad) == 0).all()


def test_loss_multiplies_the_policy_term_not_the_kl():
    logp = jnp.array(OLD) + 0.1  # ratio pi / pi_old = e^0.1 everywhere, inside no clip
    adv, mask, ref = jnp.array([1.0, -1.0]), jnp.array(MASK), jnp.array(OLD)
    kw = dict(epsilon=0.2, beta=0.5, loss_agg_mode="token-mean")
    base, base_aux = _policy_loss(logp, jnp.array(OLD), ref, adv, mask, **kw)
    on, aux = _policy_loss(
        logp, jnp.array(OLD), ref, adv, mask, rollout_logprobs=jnp.array(ROLLOUT),
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0, **kw,
    )  # fmt: skip
    w, _ = _weights("token_truncate")
    surrogate = -np.exp(0.1) * np.array([1.0, -1.0])[:, None]
    kl = np.expm1(-0.1) + 0.1
    expected = (np.where(COUNTED, surrogate * w + 0.5 * kl, 0.0)).sum() / 7
    assert float(on) == pytest.approx(expected, rel=1e-5)
    assert float(aux["kl"]) == pytest.approx(float(base_aux["kl"]))
    # Correction off with the sampler's logprobs present: the same loss and gradient, bit for bit.
    off, off_aux = _policy_loss(
        logp, jnp.array(OLD), ref, adv, mask, rollout_logprobs=jnp.array(ROLLOUT), **kw
    )
    assert float(off) == float(base)
    assert off_aux["mismatch/is_truncated_frac"] == 0.0 and off_aux["mismatch/is_masked_frac"] == 0.0
    assert float(off_aux["mismatch/is_ratio_max"]) == pytest.approx(6.0, rel=1e-6)

    def grad(**k):
        return jax.grad(lambda lp: _policy_loss(lp, jnp.array(OLD), ref, adv, mask, **kw, **k)[0])(logp)

    np.testing.assert_array_equal(grad(rollout_logprobs=jnp.array(ROLLOUT)), grad())


def _perturbed(scale, num_samples=20000, vocab=8, seed=0):
    """Tokens drawn from mu = softmax(z + scale * noise); their logprobs under mu and pi = softmax(z)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=vocab)
    log_pi = z - np.log(np.exp(z).sum())
    zm = z + scale * rng.normal(size=vocab)
    log_mu = zm - np.log(np.exp(zm).sum())
    tokens = rng.choice(vocab, size=num_samples, p=np.exp(log_mu))
    return log_pi, log_mu, log_pi[tokens][None], log_mu[tokens][None]


@pytest.mark.parametrize("scale", [0.0, 0.3, 1.0])
def test_a_perturbed_behaviour_policy_moves_the_metrics_as_the_maths_says(scale):
    """Samples of mu, scored by pi: the mismatch metrics estimate their exact values, E_mu[w] = 1 for any mu
    that gives every token of pi's a non-zero probability (a top-k filter does not: there E_mu[w] = Z, the kept
    mass).

    KL(mu || pi) = sum mu log(mu / pi) (estimated by mismatch/kl); the fraction truncated at C is
    P_mu(pi / mu > C); the fraction masked outside IcePop's [0.5, 5] is P_mu(w < 0.5 or w > 5)."""
    log_pi, log_mu, old, rollout = _perturbed(scale)
    mu, w_exact = np.exp(log_mu), np.exp(log_pi - log_mu)
    kl_exact = float((mu * (log_mu - log_pi)).sum())
    mask = jnp.ones(old.shape)
    _, tis = importance_weights(jnp.array(old), jnp.array(rollout), mask, "token_truncate", 1.5)
    _, ice = importance_weights(jnp.array(old), jnp.array(rollout), mask, "token_mask", 5.0, 0.5)
    kl = float(train_step_module._mismatch(jnp.array(old), jnp.array(rollout), mask)["mismatch/kl"])
    n = old.shape[1]
    tol = 4 * math.sqrt(0.25 / n)  # 4 standard errors of a fraction
    assert kl == pytest.approx(kl_exact, abs=4 * kl_exact / math.sqrt(n) + 1e-6)
    assert float(tis["mismatch/is_ratio_mean"]) == pytest.approx(
        1.0, abs=4 * w_exact.std() / math.sqrt(n) + 1e-5
    )
    assert float(tis["mismatch/is_truncated_frac"]) == pytest.approx(mu[w_exact > 1.5].sum(), abs=tol)
    band = (w_exact < 0.5) | (w_exact > 5.0)
    assert float(ice["mismatch/is_masked_frac"]) == pytest.approx(mu[band].sum(), abs=tol)
    if scale == 0.0:
        assert kl == 0.0 and float(tis["mismatch/is_truncated_frac"]) == 0.0
    if scale == 1.0:  # the exact values themselves move: a visible mismatch
        assert kl_exact > 0.1 and mu[w_exact > 1.5].sum() > 0.1


def test_cispo_hand_computed_values_and_gradients():
    """l = -sg(clip(r, 1 - eps, 1 + eps_high)) A logp: r = 2 -> 1.28 (A = 1), r = 0.5 -> 0.8 (A = -1)."""
    logp = jnp.log(jnp.array([[0.5], [0.25]]))
    old = jnp.log(jnp.array([[0.25], [0.5]]))
    adv, mask = jnp.array([1.0, -1.0]), jnp.ones((2, 1))

    def loss(lp, loss_type):
        return _policy_loss(lp, old, None, adv, mask, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type)

    value, aux = loss(logp, "cispo")
    expected = (-1.28 * 1.0 * math.log(0.5) - 0.8 * -1.0 * math.log(0.25)) / 2
    assert float(value) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: loss(lp, "cispo")[0])(logp), [[-0.64], [0.4]], rtol=1e-6)
    assert float(aux["clip_region_frac"]) == 1.0  # both weights clipped, both keep a gradient
    # PPO's clip removes both tokens' gradients (each ratio is past the bound in its advantage's direction).
    np.testing.assert_array_equal(jax.grad(lambda lp: loss(lp, "ppo_clip")[0])(logp), [[0.0], [0.0]])
    # Inside the band the weight is the ratio itself: on-policy CISPO has GRPO's gradient -A / N.
    grad = jax.grad(lambda lp: _policy_loss(lp, None, None, adv, mask, loss_type="cispo")[0])(logp)
    np.testing.assert_allclose(grad, [[-0.5], [0.5]], rtol=1e-6)


def test_keys_and_their_one_line_errors():
    cfg = build_config(GRPOConfig, ["vllm_importance_sampling_cap=3.0", "advantage_estimator=rloo"])
    assert cfg.vllm_importance_sampling_clip_max == 3.0 and cfg.adv_estimator == "rloo"  # TRL's, verl's names
    assert GRPOConfig().rollout_is_mode is None  # off by default
    assert GRPOConfig(vllm_importance_sampling_correction=True).rollout_is_mode == "token_truncate"
    bad = {
        "loss_type=dapo": "loss_type='dapo' is TRL's name for an aggregation: set loss_type=ppo_clip "
        "loss_agg_mode=token-mean",
        "loss_type=sapo": "loss_type='sapo': expected one of ppo_clip, cispo",
        "adv_estimator=gae": "adv_estimator='gae': expected one of grpo, rloo",
        "vllm_importance_sampling_mode=icepop": "vllm_importance_sampling_mode='icepop': expected one of",
        "vllm_importance_sampling_clip_max=0": "vllm_importance_sampling_clip_max=0.0: expected a finite",
        "vllm_importance_sampling_clip_min=-1": "vllm_importance_sampling_clip_min=-1.0: expected a finite",
        "vllm_importance_sampling_clip_min=3": "vllm_importance_sampling_clip_min=3.0 must be below",
    }
    for arg, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            build_config(GRPOConfig, [arg])
    with pytest.raises(ConfigError, match="neither vllm_importance_sampling_clip_max"):
        build_config(
            GRPOConfig, ["vllm_importance_sampling_correction=true", "vllm_importance_sampling_clip_max=none"]
        )
