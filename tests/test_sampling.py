"""Sampling filters and draws on known distributions (grpax.sampler.sampling)."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from grpax.sampler import sampling
from grpax.sampler.sampling import (
    apply_top_k,
    apply_top_p,
    sample_from_uniform,
    sample_tokens,
    token_logprobs,
)

PROBS = np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float32)  # sorted: 1 (.4), 3 (.3), 4 (.15), 2 (.1), 0 (.05)


def _kept(filtered):
    return set(np.flatnonzero(np.isfinite(np.asarray(filtered)[0])).tolist())


def test_top_k_keeps_k_largest():
    logits = jnp.log(jnp.asarray(PROBS))[None]
    assert _kept(apply_top_k(logits, 1)) == {1}
    assert _kept(apply_top_k(logits, 3)) == {1, 3, 4}
    assert _kept(apply_top_k(logits, 0)) == {0, 1, 2, 3, 4}
    kept = apply_top_k(logits, 2)
    np.testing.assert_allclose(np.asarray(kept)[0, [1, 3]], np.log(PROBS[[1, 3]]), rtol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = jnp.log(jnp.asarray(PROBS))[None]
    assert _kept(apply_top_p(logits, 0.4)) == {1}  # 0.4 alone reaches 0.4
    assert _kept(apply_top_p(logits, 0.41)) == {1, 3}  # 0.7
    assert _kept(apply_top_p(logits, 0.7)) == {1, 3}
    assert _kept(apply_top_p(logits, 0.71)) == {1, 3, 4}  # 0.85
    assert _kept(apply_top_p(logits, 0.96)) == {0, 1, 2, 3, 4}
    assert _kept(apply_top_p(logits, 1e-6)) == {1}  # always at least one token
    assert _kept(apply_top_p(logits, 1.0)) == {0, 1, 2, 3, 4}


def test_top_p_rows_are_independent():
    logits = jnp.log(jnp.asarray(np.stack([PROBS, PROBS[::-1]])))
    out = np.isfinite(np.asarray(apply_top_p(logits, 0.5)))
    assert np.flatnonzero(out[0]).tolist() == [1, 3]
    assert np.flatnonzero(out[1]).tolist() == [1, 3]  # reversed: 0.3 at 1, 0.4 at 3


def test_sampling_frequencies_follow_filtered_distribution():
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS)), (20000, 5))
    tokens = np.asarray(sample_tokens(logits, jax.random.key(0), temperature=1.0, top_k=3))
    freq = np.bincount(tokens, minlength=5) / tokens.size
    expected = np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85
    np.testing.assert_allclose(freq, expected, atol=0.015)
    tokens = np.asarray(sample_tokens(logits, jax.random.key(1), temperature=1.0, top_p=0.7))
    freq = np.bincount(tokens, minlength=5) / tokens.size
    np.testing.assert_allclose(freq, np.array([0, 0.4, 0, 0.3, 0]) / 0.7, atol=0.015)
    # temperature 0.5 squares the probabilities before renormalising
    tokens = np.asarray(sample_tokens(logits, jax.random.key(2), temperature=0.5))
    freq = np.bincount(tokens, minlength=5) / tokens.size
    np.testing.assert_allclose(freq, PROBS**2 / (PROBS**2).sum(), atol=0.015)


def test_greedy_and_seeds():
    logits = jax.random.normal(jax.random.key(3), (8, 50))
    np.testing.assert_array_equal(
        sample_tokens(logits, jax.random.key(0), greedy=True), np.argmax(np.asarray(logits), -1)
    )
    a = sample_tokens(logits, jax.random.key(0))
    b = sample_tokens(logits, jax.random.key(0))
    c = sample_tokens(logits, jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert a.dtype == jnp.int32 and (np.asarray(a) != np.asarray(c)).any()


def test_token_logprobs_is_scaled_log_softmax():
    logits = jnp.log(jnp.asarray(PROBS))[None].repeat(2, 0)
    tokens = jnp.array([1, 0])
    np.testing.assert_allclose(token_logprobs(logits, tokens), np.log(PROBS[[1, 0]]), rtol=1e-6)
    p2 = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(token_logprobs(logits, tokens, 0.5), np.log(p2[[1, 0]]), rtol=1e-5)


def test_two_level_inverse_cdf_is_exact_on_a_grid():
    # uniforms on a regular grid hit each token with frequency = its probability (to the grid spacing)
    n = 200
    grid = (np.arange(n) + 0.5) / n
    u = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS)), (n * n, 5))
    tokens = np.asarray(sample_from_uniform(logits, jnp.asarray(u), block_size=2))  # blocks {0,1},{2,3},{4}
    np.testing.assert_allclose(np.bincount(tokens, minlength=5) / tokens.size, PROBS, atol=1.0 / n)
    # filtered tokens are never drawn, even at u = 0 and u -> 1
    edge = jnp.asarray([[0.0, 0.0], [0.9999999, 0.9999999]], jnp.float32)
    two = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS)), (2, 5))
    assert set(np.asarray(sample_from_uniform(two, edge, top_k=2, block_size=2)).tolist()) <= {1, 3}


def test_top_p_bisection_equals_the_sorting_definition():
    # The nucleus by its textbook construction: sort, keep tokens whose preceding mass is < p, ties kept.
    logits = 3.0 * jax.random.normal(jax.random.key(0), (8, 49152))
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    for p in (0.05, 0.3, 0.5, 0.9, 0.95):
        keep = ((jnp.cumsum(probs, axis=-1) - probs) < p).at[..., 0].set(True)
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        expected = np.asarray(logits >= threshold)
        np.testing.assert_array_equal(np.isfinite(np.asarray(apply_top_p(logits, p))), expected)


def _threshold_cases(seed: int) -> list[jax.Array]:
    """float32 [6, 5003] logits a top-k threshold must get right: spread, heavy ties (integers), tokens already
    at -inf, and the 32 largest crowded into one block of 32."""
    rng = np.random.default_rng(seed)
    V = 5003
    spread = 3.0 * rng.standard_normal((6, V))
    ties = np.round(2.0 * rng.standard_normal((6, V)))
    filtered = np.where(rng.random((6, V)) < 0.9, -np.inf, spread)
    crowded = spread.copy()
    crowded[:, 64:96] = 50.0 + np.arange(32)
    return [jnp.asarray(x, jnp.float32) for x in (spread, ties, filtered, crowded)]


def test_block_threshold_is_the_sorted_kth_value_ties_and_filtered_tokens_included():
    # The GPU's top-k threshold (the largest logit of each block of 32 tokens) against lax.top_k's k-th value,
    # bit for bit: spread logits, heavy ties (integers), tokens already at -inf, the top k crowded into one
    # block, a vocabulary that is not a multiple of the block.
    for logits in _threshold_cases(0):
        for k in (1, 7, 50, 77):
            blocks = sampling._kth_largest_by_blocks(logits, k)
            np.testing.assert_array_equal(blocks, sampling._kth_largest_by_sort(logits, k))


def test_top_k_on_a_gpu_sorts_no_vocabulary_sized_row():
    # Lowered for CUDA (no GPU needed), apply_top_k's top-k's run on V / 32 block maxima and k * 32 candidates;
    # for CPU (and TPU: the default branch) it stays lax.top_k over the whole row.
    logits = jax.ShapeDtypeStruct((4, 128256), jnp.float32)
    lowered = {
        platform: jax.jit(apply_top_k, static_argnums=1)
        .trace(logits, 50)
        .lower(lowering_platforms=(platform,))
        for platform in ("cuda", "cpu")
    }
    top_k_inputs = {
        p: re.findall(r"top_k\(%\S+, k = 50\) : tensor<(\S+?)>", low.as_text()) for p, low in lowered.items()
    }
    assert sorted(top_k_inputs["cuda"]) == ["4x1600xf32", "4x4008xf32"], top_k_inputs
    assert top_k_inputs["cpu"] == ["4x128256xf32"], top_k_inputs


def test_bisection_threshold_is_the_sorted_kth_value_with_each_rows_own_k():
    # The per-row top-k threshold (bisection over the float32 order) against lax.top_k's k-th value, bit for bit,
    # on spread logits, heavy ties, tokens already at -inf and the top k crowded into one block.
    ks = np.array([1, 7, 50, 77, 400, 5002], np.int32)
    for logits in _threshold_cases(1):
        got = np.asarray(sampling._kth_largest_by_bisection(logits, jnp.asarray(ks)))
        for b, k in enumerate(ks.tolist()):
            np.testing.assert_array_equal(got[b], sampling._kth_largest_by_sort(logits[b : b + 1], k)[0])


def test_per_row_filters_equal_the_scalar_filters_row_by_row():
    # Each row of filter_logits_per_row is filter_logits of that row with its settings, bit for bit (the kept
    # tokens and their scaled values), whether every row asks the static k (lax.top_k's path) or not (bisection).
    logits = 3.0 * jax.random.normal(jax.random.key(2), (6, 5003))
    settings = [(0.7, 0, 1.0), (1.0, 50, 1.0), (1.3, 0, 0.9), (0.9, 20, 0.95), (0.5, 1, 1.0), (1.0, 0, 1.0)]
    temperature, top_k, top_p = (jnp.asarray(column) for column in zip(*settings, strict=True))
    per_row = jax.jit(sampling.filter_logits_per_row, static_argnums=4)
    for static_k in (0, 50):
        got = np.asarray(
            per_row(logits, temperature.astype(jnp.float32), top_k, top_p.astype(jnp.float32), static_k)
        )
        for b, (t, k, p) in enumerate(settings):
            want = jax.jit(sampling.filter_logits, static_argnums=(1, 2, 3))(logits[b : b + 1], t, k, p)
            np.testing.assert_array_equal(got[b : b + 1], want, err_msg=f"row {b}: {(t, k, p)}")
    # every row asking the static k: lax.top_k's path, the same tokens
    same_k = jnp.full((6,), 50, jnp.int32)
    ones = jnp.ones((6,), jnp.float32)
    got = np.asarray(per_row(logits, ones, same_k, ones, 50))
    np.testing.assert_array_equal(got, sampling.apply_top_k(logits, 50))
    assert (np.isfinite(got).sum(-1) == 50).all()


def test_the_per_row_program_samples_each_row_as_the_static_program_of_its_rule():
    # grpax.sampler.decode.sample on S rows of mixed rules (read as data) against the static program of each row's
    # rule (its SamplerConfig's fields, the GRPO rollout's program): the same tokens, row by row, and the same
    # logprobs to float32 rounding (XLA fuses the static temperature's scaling into the draw and the logprobs).
    from grpax.sampler.decode import RULE_FIELDS, sample
    from grpax.sampler.keys import SamplerConfig, SamplingRule

    S, V = 12, 4096
    logits = 4.0 * jax.random.normal(jax.random.key(5), (S, V))
    keys = jax.random.split(jax.random.key(6), S)
    n, rows = jnp.arange(S) + 3, jnp.arange(S)
    configs = [
        SamplerConfig(temperature=0.7),
        SamplerConfig(greedy=True),
        SamplerConfig(temperature=1.3, top_k=5),
        SamplerConfig(temperature=0.9, top_p=0.8),
        SamplerConfig(temperature=0.8, top_k=50, top_p=0.95),
        SamplerConfig(temperature=1.0),
    ] * 2
    rules = [SamplingRule.of(c) for c in configs]
    rule = {
        name: jnp.asarray(column, dtype)
        for name, column, dtype in zip(
            RULE_FIELDS, zip(*rules, strict=True), (jnp.float32, jnp.int32, jnp.float32), strict=True
        )
    }
    per_row = jax.jit(sample, static_argnums=4)
    for static_k in (
        0,
        50,
    ):  # the per-row program's top-k: bisection for all rows, or lax.top_k where all ask 50
        token, logprob = per_row(logits, keys, n, rows, SamplerConfig(top_k=static_k), rule)
        for s, sc in enumerate(configs):
            want_token, want_logprob = per_row(logits, keys, n, rows, sc)
            assert int(token[s]) == int(want_token[s]), (s, sc)
            np.testing.assert_allclose(logprob[s], want_logprob[s], rtol=0, atol=2e-6)
    same_k = {**rule, "top_k": jnp.full((S,), 50, jnp.int32), "temperature": jnp.full((S,), 0.8, jnp.float32)}
    same_k["top_p"] = jnp.full((S,), 0.95, jnp.float32)
    token, _ = per_row(logits, keys, n, rows, SamplerConfig(top_k=50), same_k)
    np.testing.assert_array_equal(token, per_row(logits, keys, n, rows, configs[4])[0])
    assert len(set(np.asarray(token).tolist())) > 1
