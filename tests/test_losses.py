"""GRPO loss against hand-computed numbers: aggregation modes, KL estimators, clipping, GSPO ratios."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.rl.config import GRPOConfig
from grpax.rl.losses import (
    kl_k1,
    kl_k2,
    kl_k3,
    loss_normalizer,
    per_token_logprobs,
    policy_loss,
    token_entropy,
)


def _policy_loss(logprobs, old, ref, adv, mask, **keys):
    """``policy_loss`` with its GRPOConfig built from ``keys`` (beta 0 unless given), the batch's extras apart."""
    call = {
        k: keys.pop(k)
        for k in ("max_completion_length", "normalizer", "truncated", "rollout_logprobs")
        if k in keys
    }
    return policy_loss(logprobs, old, ref, adv, mask, GRPOConfig(**{"beta": 0.0, **keys}), **call)


# Two completions x three tokens; the second completion has 2 real tokens.
LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5]]
# Ratios: row 0 (1.49 clipped high, 0.61, 1.0), row 1 (1.0, 0.67 clipped low); masked slot (1, 2) 1.65.
OLD = [[-1.4, -1.5, -0.5], [-0.3, -0.8, -3.0]]
REF = [[-1.2, -2.0, -0.4], [-0.5, -1.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]
EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.1


def _kl_by_hand(estimator, lp, ref):
    log_rho = ref - lp
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho * log_rho
    return (math.exp(log_rho) - 1.0) - log_rho


def _per_token_by_hand(estimator, beta, sequence_ratio=False):
    """Plain-Python per-token losses [[...], [...]] (masked tokens -> None)."""
    out = []
    for i in range(2):
        real = [t for t in range(3) if MASK[i][t]]
        seq_log_ratio = sum(LOGP[i][t] - OLD[i][t] for t in real) / len(real)
        row = []
        for t in range(3):
            if not MASK[i][t]:
                row.append(None)
                continue
            ratio = math.exp(seq_log_ratio if sequence_ratio else LOGP[i][t] - OLD[i][t])
            clipped = min(max(ratio, 1 - EPS), 1 + EPS_HIGH)
            surrogate = -min(ratio * ADV[i], clipped * ADV[i])
            row.append(surrogate + beta * _kl_by_hand(estimator, LOGP[i][t], REF[i][t]))
        out.append(row)
    return out


def _aggregate_by_hand(per_token, mode, max_len):
    rows = [[x for x in row if x is not None] for row in per_token]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "sequence-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / max_len for r in rows) / len(rows)


def _loss(**kwargs):
    args = dict(epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA)
    args.update(kwargs)
    return _policy_loss(
        jnp.array(LOGP), jnp.array(OLD), jnp.array(REF), jnp.array(ADV), jnp.array(MASK, jnp.float32), **args
    )


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_matches_hand_computation(mode, estimator):
    loss, aux = _loss(kl_estimator=estimator, loss_agg_mode=mode, max_completion_length=4)
    expected = _aggregate_by_hand(_per_token_by_hand(estimator, BETA), mode, max_len=4)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    surrogate_only = _aggregate_by_hand(_per_token_by_hand(estimator, 0.0), mode, max_len=4)
    assert float(aux["policy_loss"]) == pytest.approx(surrogate_only, rel=1e-6)
    kls = [_kl_by_hand(estimator, LOGP[i][t], REF[i][t]) for i in range(2) for t in range(3) if MASK[i][t]]
    assert float(aux["kl"]) == pytest.approx(sum(kls) / 5, rel=1e-6)
    assert float(aux["num_tokens"]) == 5.0


def test_on_policy_loss_literal_values():
    # old = None: ratio 1, the loss is -A averaged by the mode; beta = 0 needs no reference.
    logp, adv, mask = jnp.array(LOGP), jnp.array(ADV), jnp.array(MASK, jnp.float32)
    tm, _ = _policy_loss(logp, None, None, adv, mask, loss_agg_mode="token-mean")
    sm, _ = _policy_loss(logp, None, None, adv, mask, loss_agg_mode="sequence-mean-token-mean")
    dr, _ = _policy_loss(logp, None, None, adv, mask, loss_agg_mode="sequence-mean-token-sum-norm")
    assert float(tm) == pytest.approx(-(1.0 * 3 - 0.5 * 2) / 5)  # -0.4
    assert float(sm) == pytest.approx(-(1.0 - 0.5) / 2)  # -0.25
    assert float(dr) == pytest.approx(-(3 / 3 - 0.5 * 2 / 3) / 2)  # -1/3 with L_max = T = 3
    grad = jax.grad(lambda lp: _policy_loss(lp, None, None, adv, mask)[0])(logp)
    np.testing.assert_allclose(grad, [[-0.2, -0.2, -0.2], [0.1, 0.1, 0.0]], rtol=1e-6)


def test_literal_kl_values():
    lp, ref = jnp.array([-1.0]), jnp.array([-2.0])  # log rho = -1
    assert float(kl_k1(lp, ref)[0]) == pytest.approx(1.0)
    assert float(kl_k2(lp, ref)[0]) == pytest.approx(0.5)
    assert float(kl_k3(lp, ref)[0]) == pytest.approx(math.exp(-1) - 1 + 1, rel=1e-6)  # 0.3678794


def test_k3_never_negative_even_at_extremes():
    values = np.array(
        [0.0, -1e-8, -1e-6, -1e-3, -0.1, -1.0, -5.0, -30.0, -88.0, -100.0, -1e4, -1e30], np.float32
    )
    lp, ref = np.meshgrid(values, values)
    kl = np.asarray(kl_k3(jnp.array(lp), jnp.array(ref)))
    assert np.isfinite(kl).all()
    assert (kl >= 0).all()
    near = jnp.array([-1.0, -1.0, -0.5]) + jnp.array([0.0, 1e-7, -1e-7])
    assert (np.asarray(kl_k3(near, jnp.array([-1.0, -1.0, -0.5]))) >= 0).all()
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 10_000)).astype(np.float32) * 3 - 3
    assert (np.asarray(kl_k3(jnp.array(a), jnp.array(b))) >= 0).all()


def _grad_one_token(logp, old, adv, **kw):
    def f(lp):
        return _policy_loss(lp, jnp.array([[old]]), None, jnp.array([adv]), jnp.ones((1, 1)), **kw)[0]

    return float(jax.grad(f)(jnp.array([[logp]]))[0, 0])


@pytest.mark.parametrize(
    "ratio, adv, clipped",
    [(1.5, 1.0, True), (0.5, -1.0, True), (1.5, -1.0, False), (0.5, 1.0, False), (1.1, 1.0, False)],
)
def test_clipping_zeroes_the_gradient_outside_the_trust_region(ratio, adv, clipped):
    logp, old = math.log(ratio), 0.0
    grad = _grad_one_token(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    if clipped:
        assert grad == 0.0
    else:
        assert grad == pytest.approx(-adv * ratio, rel=1e-6)  # d(-r A)/dlogp = -r A
    _, aux = _policy_loss(
        jnp.array([[logp]]), jnp.array([[old]]), None, jnp.array([adv]), jnp.ones((1, 1)), epsilon_high=0.28
    )
    assert float(aux["clip_region_frac"]) == (1.0 if clipped else 0.0)
    assert float(aux["clip_high_frac"]) == (1.0 if clipped and adv > 0 else 0.0)
    assert float(aux["clip_low_frac"]) == (1.0 if clipped and adv < 0 else 0.0)


def test_clip_higher_keeps_gradient_between_eps_and_eps_high():
    # ratio 1.25 is clipped with eps = 0.2 but not with DAPO's eps_high = 0.28.
    assert _grad_one_token(math.log(1.25), 0.0, 1.0, epsilon=0.2) == 0.0
    assert _grad_one_token(math.log(1.25), 0.0, 1.0, epsilon=0.2, epsilon_high=0.28) == pytest.approx(-1.25)


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean-token-mean"])
def test_gspo_sequence_ratio(mode):
    loss, aux = _loss(importance_sampling_level="sequence", loss_agg_mode=mode, beta=0.0)
    expected = _aggregate_by_hand(_per_token_by_hand("k3", 0.0, sequence_ratio=True), mode, max_len=3)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    # Row 0: mean log-ratio (0.4 - 0.5 + 0) / 3; row 1: (0 - 0.4) / 2.
    r0, r1 = math.exp(-0.1 / 3), math.exp(-0.2)
    assert float(aux["ratio_mean"]) == pytest.approx((3 * r0 + 2 * r1) / 5, rel=1e-6)


def test_global_normalizer_and_masking():
    logp, old, ref, adv = jnp.array(LOGP), jnp.array(OLD), jnp.array(REF), jnp.array(ADV)
    mask = jnp.array(MASK, jnp.float32)
    assert float(loss_normalizer(mask, "token-mean")) == 5.0
    assert float(loss_normalizer(mask, "sequence-mean-token-mean")) == 2.0
    full, _ = _policy_loss(logp, old, ref, adv, mask, beta=0.1)
    parts = [
        _policy_loss(
            logp[i : i + 1],
            old[i : i + 1],
            ref[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            beta=0.1,
            normalizer=5.0,
        )[0]
        for i in range(2)
    ]
    assert float(parts[0] + parts[1]) == pytest.approx(float(full), rel=1e-6)
    # Truncated rows leave the loss; garbage (inf / NaN) at padding never leaks.
    bad = logp.at[1, 2].set(jnp.nan)
    masked, _ = _policy_loss(
        bad,
        old.at[1, 2].set(jnp.inf),
        ref,
        adv,
        mask,
        beta=0.1,
        epsilon_high=EPS_HIGH,
        kl_estimator="k3",
        truncated=jnp.array([False, True]),
        mask_truncated_completions=True,
    )
    row0 = _per_token_by_hand("k3", 0.1)[0]
    assert float(masked) == pytest.approx(sum(row0) / 3, rel=1e-6)
    g = jax.grad(
        lambda lp: _policy_loss(
            lp, old.at[1, 2].set(jnp.inf), ref.at[1, 2].set(-jnp.inf), adv, mask, beta=0.1
        )[0]
    )(bad)
    assert np.isfinite(np.asarray(g)).all()


def test_beta_needs_reference():
    with pytest.raises(ValueError, match="ref_logprobs"):
        _policy_loss(jnp.array(LOGP), None, None, jnp.array(ADV), jnp.array(MASK), beta=0.04)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        _policy_loss(jnp.array(LOGP), None, None, jnp.array(ADV), jnp.array(MASK), loss_agg_mode="mean")


def test_per_token_logprobs_and_entropy():
    logits = jnp.array([[[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]])
    tokens = jnp.array([[1, 2]])
    lp = per_token_logprobs(logits, tokens, temperature=2.0)
    z = math.exp(0.5) + math.exp(1.0) + 1.0
    assert float(lp[0, 0]) == pytest.approx(1.0 - math.log(z), rel=1e-6)
    assert float(lp[0, 1]) == pytest.approx(-math.log(3.0), rel=1e-6)
    ent = token_entropy(logits, temperature=2.0)
    p = [math.exp(0.5) / z, math.exp(1.0) / z, 1.0 / z]
    assert float(ent[0, 0]) == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-6)
    assert float(ent[0, 1]) == pytest.approx(math.log(3.0), rel=1e-6)
