"""The jitted GRPO update on a tiny random Llama: accumulation equivalence, learning, NaN guard, LR schedule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpax.errors import ConfigError
from grpax.models import attention
from grpax.models.llama import forward, logits_from_hidden
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl import train_step as train_step_module
from grpax.rl.batch import Batch
from grpax.rl.config import GRPOConfig
from grpax.rl.losses import per_token_logprobs, token_entropy
from grpax.rl.optim import learning_rate_at, make_lr_schedule, make_optimizer, optimizer_from_config
from grpax.rl.train_step import (
    TrainState,
    accumulate_gradients,
    completion_logprobs,
    compute_logprobs,
    make_train_step,
)

CFG = ModelConfig(
    vocab_size=61, hidden_dim=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32
)
B, P, C = 8, 5, 6
TEMPERATURE = 0.7


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    prompt_len = np.array([5, 3, 4, 2, 5, 1, 3, 4])
    completion_len = np.array([6, 2, 0, 4, 1, 6, 3, 5])  # one empty row
    prompt_mask = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.int32)  # left-padded
    completion_mask = (np.arange(C)[None] < completion_len[:, None]).astype(np.int32)
    return {
        "prompt_ids": (rng.integers(1, CFG.vocab_size, (B, P)) * prompt_mask).astype(np.int32),
        "prompt_mask": prompt_mask,
        "completion_ids": (rng.integers(1, CFG.vocab_size, (B, C)) * completion_mask).astype(np.int32),
        "completion_mask": completion_mask,
        "advantages": np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.5], np.float32),
        "truncated": completion_len == C,
    }


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def test_compute_logprobs_matches_unpadded_forward(params):
    batch = _batch()
    lp1 = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    lp4 = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 4))
    np.testing.assert_allclose(lp4, lp1, atol=1e-6)
    for b in (0, 3, 7):  # rows with different left padding
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b] == 1]
        completion = batch["completion_ids"][b][batch["completion_mask"][b] == 1]
        tokens = jnp.asarray(np.concatenate([prompt, completion]))[None]
        logits, _ = forward(params, tokens, CFG)
        logp = jax.nn.log_softmax(logits[0] / TEMPERATURE, axis=-1)
        n = len(completion)
        want = [float(logp[len(prompt) - 1 + t, completion[t]]) for t in range(n)]
        np.testing.assert_allclose(lp1[b, :n], want, atol=2e-5)
        assert (lp1[b, n:] == 0.0).all()


def _grouped_batch(seed=0):
    """3 prompts x G = 2 completions: one prompt row per group (the trainer's layout)."""
    rng = np.random.default_rng(seed)
    prompt_len, completion_len = np.array([5, 2, 3]), np.array([6, 2, 0, 4, 1, 6])
    prompt_mask = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.int32)
    completion_mask = (np.arange(C)[None] < completion_len[:, None]).astype(np.int32)
    return {
        "prompt_ids": (rng.integers(1, CFG.vocab_size, (3, P)) * prompt_mask).astype(np.int32),
        "prompt_mask": prompt_mask,
        "completion_ids": (rng.integers(1, CFG.vocab_size, (6, C)) * completion_mask).astype(np.int32),
        "completion_mask": completion_mask,
        "advantages": np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], np.float32),
    }


@pytest.mark.parametrize("num_micro_batches", [1, 3, 6])  # 6: each prompt row repeated for 2 half-groups
@pytest.mark.parametrize("query_chunk", [128, 2])  # 2: prompts and completions attend in query blocks
def test_grouped_logprobs_match_each_row_alone(params, num_micro_batches, query_chunk, monkeypatch):
    """Each prompt runs once for its G completions; every row still gets its own unpadded forward's values."""
    monkeypatch.setattr(attention, "_QUERY_CHUNK", query_chunk)
    jax.clear_caches()  # the block size is read at trace time
    batch = _grouped_batch()
    logprobs = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, num_micro_batches))
    for b in range(6):
        prompt = batch["prompt_ids"][b // 2][batch["prompt_mask"][b // 2] == 1]
        completion = batch["completion_ids"][b][batch["completion_mask"][b] == 1]
        logits, _ = forward(params, jnp.asarray(np.concatenate([prompt, completion]))[None], CFG)
        logp = jax.nn.log_softmax(logits[0] / TEMPERATURE, axis=-1)
        want = [float(logp[len(prompt) - 1 + t, completion[t]]) for t in range(len(completion))]
        np.testing.assert_allclose(logprobs[b, : len(completion)], want, atol=2e-5)
        assert (logprobs[b, len(completion) :] == 0.0).all()


def test_grouped_gradient_accumulation_equals_full_batch(params):
    """Micro-batches of whole groups (3) or half-groups (6, prompts repeated) give the full batch's gradient."""
    batch = _grouped_batch()
    batch["old_logprobs"] = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    grpo = GRPOConfig(num_generations=2, beta=0.0, temperature=TEMPERATURE)
    fn = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4))
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    _, full, _ = fn(params, batch, CFG, grpo, 1)
    for m in (3, 6):
        _, grads, _ = fn(params, batch, CFG, grpo, m)
        assert np.linalg.norm(flat(grads) - flat(full)) <= 1e-6 * np.linalg.norm(flat(full)), m


def test_micro_batches_refuse_a_split_across_groups(params):
    batch = _grouped_batch()  # 3 prompts x 2: 4 blocks would cut a group's rows apart
    with pytest.raises(ValueError, match="num_micro_batches=4"):
        compute_logprobs(params, batch, CFG, TEMPERATURE, 4)


def test_chunked_logprobs_and_entropy_equal_the_full_logits(params, monkeypatch):
    """Projected in chunks (here 2 chunks of 3 tokens), the same values as at once."""
    monkeypatch.setattr(train_step_module, "LOGITS_CHUNK_ELEMENTS", 2 * 5 * CFG.vocab_size)
    monkeypatch.setattr(train_step_module, "LOGITS_CHUNK_MIN_TOKENS", 0)
    assert train_step_module.logits_chunk(2, CFG.vocab_size, C) == 3
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(2, C, CFG.hidden_dim)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, C)).astype(np.int32))
    logprobs, entropy = completion_logprobs(params, hidden, tokens, CFG, TEMPERATURE, with_entropy=True)
    logits = logits_from_hidden(params, hidden, CFG)
    np.testing.assert_allclose(logprobs, per_token_logprobs(logits, tokens, TEMPERATURE), atol=1e-5)
    np.testing.assert_allclose(entropy, token_entropy(logits, TEMPERATURE), atol=1e-5)
    grad = jax.grad(lambda h: completion_logprobs(params, h, tokens, CFG, TEMPERATURE)[0].sum())(hidden)
    want = jax.grad(
        lambda h: per_token_logprobs(logits_from_hidden(params, h, CFG), tokens, TEMPERATURE).sum()
    )
    np.testing.assert_allclose(grad, want(hidden), atol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"])
def test_gradient_accumulation_equals_full_batch(params, mode):
    batch = _batch()
    ref = compute_logprobs(params, batch, CFG, TEMPERATURE, 1)
    rng = np.random.default_rng(1)
    batch["old_logprobs"] = np.asarray(ref) + rng.normal(0, 0.3, ref.shape).astype(
        np.float32
    )  # some clipping
    batch["ref_logprobs"] = np.asarray(ref) + rng.normal(0, 0.1, ref.shape).astype(np.float32)
    grpo = GRPOConfig(loss_agg_mode=mode, beta=0.05, epsilon_high=0.28, temperature=TEMPERATURE)
    fn = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4))
    loss1, g1, aux1 = fn(params, batch, CFG, grpo, 1)
    assert float(aux1["clip_region_frac"]) > 0
    flat1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g1)])
    for m in (2, 4):
        loss_m, g_m, aux_m = fn(params, batch, CFG, grpo, m)
        flat_m = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_m)])
        assert np.linalg.norm(flat_m - flat1) <= 1e-6 * np.linalg.norm(flat1), m
        # The loss is a sum of per-token terms of size ~|A| ~ 1 that cancel to ~1e-2, so float32 summation
        # order moves it by ~1e-7 of the terms' scale, not of the (small) result.
        scale = float(np.abs(batch["advantages"]).max())
        assert float(loss_m) == pytest.approx(float(loss1), abs=1e-6 * scale)
        for k in ("kl", "entropy", "ratio_mean", "clip_region_frac", "num_tokens"):
            assert float(aux_m[k]) == pytest.approx(float(aux1[k]), rel=1e-5), k


@pytest.fixture(scope="module")
def train_step():
    """One compiled step shared by the tests below: constant lr 1e-2, no clipping, no weight decay."""
    grpo = GRPOConfig(beta=0.0, temperature=TEMPERATURE, max_grad_norm=0.0, weight_decay=0.0)
    schedule = make_lr_schedule(1e-2, 10, schedule="constant")
    optimizer = make_optimizer(schedule, 10, weight_decay=0.0)
    return optimizer, make_train_step(CFG, grpo, optimizer, num_micro_batches=2, lr_schedule=schedule)


def test_train_step_raises_logprobs_of_positive_rows(params, train_step):
    optimizer, step = train_step
    batch = _batch()
    batch["old_logprobs"] = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    copy = jax.tree.map(jnp.copy, params)
    state = TrainState(params=copy, opt_state=optimizer.init(copy), step=jnp.zeros((), jnp.int32))
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        assert not bool(metrics["nonfinite"])
        assert float(metrics["learning_rate"]) == pytest.approx(1e-2)
        losses.append(float(metrics["loss"]))
    # The first update is on-policy: ratio 1, loss = -sum(A * tokens) / tokens.
    mask = batch["completion_mask"]
    assert losses[0] == pytest.approx(-(batch["advantages"] @ mask.sum(1)) / mask.sum(), rel=1e-5)
    assert losses[-1] < losses[0] - 0.05
    assert int(state.step) == 4
    new = np.asarray(compute_logprobs(state.params, batch, CFG, TEMPERATURE, 1))
    seq_delta = ((new - batch["old_logprobs"]) * mask).sum(1)
    adv = batch["advantages"]
    assert (seq_delta[(adv > 0) & (mask.sum(1) > 0)] > 0).all()
    assert (seq_delta[adv < 0] < 0).all()


def test_nan_advantage_skips_the_step(params, train_step):
    optimizer, step = train_step
    batch = _batch()
    batch["old_logprobs"] = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    batch["advantages"][3] = np.nan
    copy = jax.tree.map(jnp.copy, params)
    state = TrainState(params=copy, opt_state=optimizer.init(copy), step=jnp.zeros((), jnp.int32))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, batch)
    assert bool(metrics["nonfinite"])
    assert int(state.step) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    counts = optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")
    assert [int(c) for _, c in counts] == [0, 0]  # Adam moments and the schedule did not advance
    # The state still works: the same batch with finite advantages updates it.
    batch["advantages"][3] = -0.5
    state, metrics = step(state, batch)
    assert not bool(metrics["nonfinite"]) and int(state.step) == 1


def test_optimizer_from_config_sizes_the_schedule():
    _, schedule = optimizer_from_config(GRPOConfig(learning_rate=2e-6, warmup_ratio=0.1), num_train_steps=50)
    assert learning_rate_at(schedule, 0) == pytest.approx(2e-6 / 6)  # 5 warmup steps: (0 + 1) / (5 + 1)
    assert learning_rate_at(schedule, 5) == pytest.approx(2e-6)
    assert learning_rate_at(schedule, 50) == pytest.approx(0.0, abs=1e-15)


def test_lr_schedule_warmup_then_cosine():
    s = make_lr_schedule(1e-3, 100, warmup_ratio=0.1, end_lr_ratio=0.1)
    assert learning_rate_at(s, 0) == pytest.approx(1e-3 / 11)  # update s of a 10-step warmup: (s + 1) / 11
    assert learning_rate_at(s, 5) == pytest.approx(1e-3 * 6 / 11)
    assert learning_rate_at(s, 10) == pytest.approx(1e-3)
    # Halfway through the decay: end + (peak - end) * (1 + cos(pi / 2)) / 2.
    assert learning_rate_at(s, 55) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate_at(s, 100) == pytest.approx(1e-4)
    # Sized from the real step count: a 20-step run warms up for 2 steps and ends at step 20.
    short = make_lr_schedule(1e-3, 20, warmup_ratio=0.1)
    assert learning_rate_at(short, 2) == pytest.approx(1e-3)
    assert learning_rate_at(short, 11) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 9 / 18)))
    assert learning_rate_at(short, 20) == pytest.approx(0.0, abs=1e-12)
    lin = make_lr_schedule(1e-3, 100, warmup_steps=10, schedule="linear")
    assert learning_rate_at(lin, 55) == pytest.approx(5e-4)
    const = make_lr_schedule(1e-3, 100, warmup_steps=0, schedule="constant")
    assert learning_rate_at(const, 0) == learning_rate_at(const, 99) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="real step count"):
        make_lr_schedule(1e-3, 0)
    with pytest.raises(ValueError, match="no room"):
        make_lr_schedule(1e-3, 10, warmup_steps=10)


def test_mu_dtype_bfloat16_stores_the_first_moment_in_bfloat16():
    """mu_dtype=bfloat16 (MaxText's key) halves m's memory; the update is computed from float32 values."""
    params = {"w": jnp.full((4, 4), 0.5, jnp.float32)}
    grads = {"w": jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32).reshape(4, 4) / 3}  # not bf16-exact
    optimizers = {
        dtype: optimizer_from_config(GRPOConfig(learning_rate=1e-2, warmup_ratio=0.0, mu_dtype=dtype), 10)[0]
        for dtype in ("", "bfloat16")
    }
    full_state, half_state = (optimizers[d].init(params) for d in ("", "bfloat16"))
    mu = lambda state: state[0].mu["w"]  # noqa: E731  (adamw's ScaleByAdamState comes first)
    assert mu(full_state).dtype == jnp.float32 and mu(half_state).dtype == jnp.bfloat16
    full_updates, full_state = optimizers[""].update(grads, full_state, params)
    half_updates, half_state = optimizers["bfloat16"].update(grads, half_state, params)
    # The first update reads m = 0 either way: equal; the stored m is the float32 one rounded to bfloat16.
    np.testing.assert_array_equal(half_updates["w"], full_updates["w"])
    np.testing.assert_array_equal(mu(half_state), mu(full_state).astype(jnp.bfloat16))
    with pytest.raises(ConfigError, match=r"mu_dtype='float16': expected '' \(the params' dtype\), float32"):
        GRPOConfig(mu_dtype="float16")


def _fraction_changed(before, after) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(before)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(after)])
    return float(np.mean(a != b))


def _preset_dtypes() -> dict:
    """weight_dtype and dtype of an accelerator model's train_rl run, read through the real config loader."""
    from grpax.config import build_config
    from grpax.rl.train_config import TrainConfig

    cfg = build_config(TrainConfig, ["model_name=llama3.1-8b-Instruct"])
    return {"weight_dtype": cfg.weight_dtype, "dtype": cfg.dtype}


def _one_update(cfg, params, lr=3e-6, batch=None):
    grpo = GRPOConfig(
        beta=0.0, temperature=TEMPERATURE, learning_rate=lr, warmup_ratio=0.0, lr_schedule="constant"
    )
    optimizer, schedule = optimizer_from_config(grpo, 10, cfg.weight_dtype)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    step = make_train_step(cfg, grpo, optimizer, num_micro_batches=2, lr_schedule=schedule)
    return step(state, _batch() if batch is None else batch)


def test_accelerator_preset_trains_float32_weights_with_bfloat16_compute(params):
    """One AdamW step at the seed's lr 3e-6 with the run's own preset dtypes moves >= 90% of the weights (with
    bfloat16 weights and no master copy it moved 0.57% of SmolLM2's: the rest rounded away)."""
    dtypes = _preset_dtypes()
    assert dtypes == {"weight_dtype": "float32", "dtype": "bfloat16"}
    cfg = CFG.replace(**dtypes)
    before = jax.tree.map(np.asarray, params)
    state, metrics = _one_update(cfg, jax.tree.map(jnp.copy, params))
    assert not bool(metrics["nonfinite"]) and not bool(metrics["nonfinite_params"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert _fraction_changed(before, state.params) >= 0.9


def test_bfloat16_weights_train_through_a_float32_master_copy(params):
    """weight_dtype=bfloat16: the optimizer keeps float32 weights; the params are their rounding."""
    from grpax.rl.optim import MasterWeightsState

    cfg = CFG.replace(weight_dtype="bfloat16", dtype="bfloat16")
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    before = jax.tree.map(lambda x: np.asarray(x, np.float32), half)
    state, _ = _one_update(cfg, jax.tree.map(jnp.copy, half))
    assert isinstance(state.opt_state, MasterWeightsState)
    master = state.opt_state.master
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(master))
    assert _fraction_changed(before, master) >= 0.9  # no update lost to rounding
    adam = state.opt_state.inner[0]  # the moments are float32 too (mu_dtype '' = the master's)
    assert adam.mu["embed"].dtype == jnp.float32 and adam.nu["embed"].dtype == jnp.float32
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(master), strict=True):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))
    # Most bfloat16 weights did not move in one step: the master holds what they could not.
    assert _fraction_changed(before, state.params) < 0.5


def test_gradients_accumulate_in_float32_with_bfloat16_params(params):
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    cfg = CFG.replace(weight_dtype="bfloat16", dtype="bfloat16")
    grpo = GRPOConfig(num_generations=2, beta=0.0, temperature=TEMPERATURE)
    _, grads, _ = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4))(
        half, _grouped_batch(), cfg, grpo, 3
    )
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_weight_decay_spares_norms_and_biases_by_name():
    """A zero gradient leaves only the decay: matrices and embeddings shrink by lr * wd; stacked [L, D] norm
    scales, q/k norms and q/k/v biases do not move (the old ndim >= 2 mask decayed the stacked norms)."""
    cfg = CFG.replace(attention_bias=True, qk_norm=True)
    p = jax.tree.map(lambda x: x + 1.0, init_params(cfg, jax.random.key(1)))  # no zero to hide a decay
    lr, wd = 0.1, 0.5
    optimizer = make_optimizer(make_lr_schedule(lr, 10, schedule="constant"), 10, weight_decay=wd)
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p)
    decayed = {"embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    seen = set()
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = path[-1].key
        seen.add(name)
        x = p[name] if len(path) == 1 else p["layers"][name]
        expected = -lr * wd * np.asarray(x) if name in decayed else np.zeros_like(x)
        np.testing.assert_allclose(np.asarray(u), expected, rtol=1e-6, err_msg=name)
    assert {"attn_norm", "q_norm", "k_bias", "final_norm", "wq", "embed"} <= seen


@pytest.mark.parametrize(
    "steps, ratio, warmup", [(9, 0.1, 1), (30, 0.1, 3), (50, 0.1, 5), (1, 0.1, 0), (2, 0.9, 1)]
)
def test_warmup_rounds_up_as_hugging_face(steps, ratio, warmup):
    from grpax.rl.optim import num_warmup_steps

    assert num_warmup_steps(steps, ratio) == warmup


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_every_update_of_a_short_run_moves_the_weights(schedule):
    # The main job's schedule: 6 updates at warmup_ratio 0.1 warm up for 1 update. Starting the warmup at 0
    # (MaxText's, Hugging Face's) ran that first update at learning rate 0: one rollout of six thrown away.
    s = make_lr_schedule(3e-5, 6, warmup_ratio=0.1, schedule=schedule)
    lrs = [learning_rate_at(s, step) for step in range(6)]
    assert lrs[:2] == pytest.approx([1.5e-5, 3e-5])  # (0 + 1) / (1 + 1) of the peak, then the peak
    assert all(lr > 0 for lr in lrs)
    # A 3-update warmup ramps 1/4, 2/4, 3/4 of the peak, then the peak.
    ramp = make_lr_schedule(1e-3, 30, warmup_steps=3, schedule=schedule)
    assert [learning_rate_at(ramp, step) for step in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def test_on_policy_ratio_is_one_whatever_the_sampler_logprobs(params):
    """num_iterations=1: the ratio is exp(logp - stop_gradient(logp)) = 1, not against the sampler's logprobs.

    The sampler's logprobs here carry bfloat16-sized noise (~0.03 nats): with GSPO's clip range they used to
    put every sequence outside the band and remove its gradient. Now they only move the mismatch metrics,
    which equal their hand-computed values."""
    grpo = GRPOConfig(
        beta=0.0,
        temperature=TEMPERATURE,
        epsilon=3e-4,
        epsilon_high=4e-4,
        importance_sampling_level="sequence",
    )
    batch = _batch()
    exact = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    noise = np.random.default_rng(0).normal(0, 0.03, exact.shape).astype(np.float32)
    mask = batch["completion_mask"]
    fn = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4))
    _, clean, aux_clean = fn(params, batch, CFG, grpo, 1)
    batch["rollout_logprobs"] = (exact + noise) * mask
    _, grads, aux = fn(params, batch, CFG, grpo, 1)
    assert float(aux["ratio_mean"]) == 1.0
    assert float(aux["clip_region_frac"]) == 0.0
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    log_rho = -noise[mask > 0]  # trainer - sampler, up to the trainer's own float32 rounding
    n = mask.sum()
    assert float(aux["mismatch/logprob_diff_mean"]) == pytest.approx(np.abs(log_rho).sum() / n, rel=1e-3)
    assert float(aux["mismatch/logprob_diff_max"]) == pytest.approx(np.abs(log_rho).max(), rel=1e-3)
    assert float(aux["mismatch/kl"]) == pytest.approx((np.expm1(log_rho) - log_rho).sum() / n, rel=1e-2)
    assert float(aux_clean["mismatch/kl"]) == 0.0  # no sampler logprobs: nothing to compare


def _step_with(params, grpo, batch, num_micro_batches=1):
    schedule = make_lr_schedule(1e-2, 10, schedule="constant")
    optimizer = make_optimizer(schedule, 10, weight_decay=0.0)
    step = make_train_step(CFG, grpo, optimizer, num_micro_batches=num_micro_batches, lr_schedule=schedule)
    copy = jax.tree.map(jnp.copy, params)
    state = TrainState(params=copy, opt_state=optimizer.init(copy), step=jnp.zeros((), jnp.int32))
    return step(state, batch)


def test_correction_off_is_bit_identical_whatever_the_sampler_logprobs(params):
    """vllm_importance_sampling_correction=false (the default): the sampler's logprobs, however far off,
    change no weight and no metric of before; only the mismatch/is_* statistics are added."""
    grpo = GRPOConfig(beta=0.0, temperature=TEMPERATURE, max_grad_norm=0.0)
    batch = _batch()
    clean_state, clean = _step_with(params, grpo, batch, 2)
    exact = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    batch["rollout_logprobs"] = exact - 1.0  # every ratio e, past any cap
    state, metrics = _step_with(params, grpo, batch, 2)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(clean_state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for k, v in clean.items():
        if not k.startswith("mismatch/"):
            np.testing.assert_array_equal(np.asarray(metrics[k]), np.asarray(v), err_msg=k)
    assert float(metrics["mismatch/is_ratio_mean"]) == pytest.approx(math.e, rel=1e-4)
    assert float(metrics["mismatch/is_truncated_frac"]) == 0.0


def test_truncated_and_masked_correction_scale_and_remove_the_gradient(params, num_micro_batches=2):
    """A behaviour policy e times less likely on every token: ratio e > C = 2, so TIS weights every token by 2
    (the gradient doubles) and MIS masks every token (no policy gradient)."""
    batch = _batch()
    exact = np.asarray(compute_logprobs(params, batch, CFG, TEMPERATURE, 1))
    base = GRPOConfig(beta=0.0, temperature=TEMPERATURE)
    fn = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4))
    _, clean, _ = fn(params, batch, CFG, base, num_micro_batches)
    with pytest.raises(ValueError, match="needs the batch's rollout_logprobs"):
        fn(params, batch, CFG, base.replace(vllm_importance_sampling_correction=True), num_micro_batches)
    batch["rollout_logprobs"] = exact - 1.0
    tis = base.replace(vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=2.0)
    _, grads, aux = fn(params, batch, CFG, tis, num_micro_batches)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(clean), strict=True):
        np.testing.assert_allclose(np.asarray(a), 2 * np.asarray(b), rtol=2e-5, atol=1e-9)
    assert float(aux["mismatch/is_truncated_frac"]) == 1.0
    assert float(aux["mismatch/is_ratio_min"]) == pytest.approx(math.e, rel=1e-4)
    assert float(aux["mismatch/is_ratio_max"]) == pytest.approx(math.e, rel=1e-4)
    mis = tis.replace(vllm_importance_sampling_mode="sequence_mask")
    loss, grads, aux = fn(params, batch, CFG, mis, num_micro_batches)
    assert float(loss) == 0.0 and all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))
    assert float(aux["mismatch/is_masked_frac"]) == 1.0


def test_a_checkpoint_restores_the_float32_master_copy_bit_exactly(params, tmp_path):
    """weight_dtype=bfloat16: what a resume restores (``TrainCheckpointer``, as the trainer saves and restores
    its state) is the float32 master copy bit for bit, not the bfloat16 params widened, with every optimizer
    leaf (moments, count) as it was saved."""
    from grpax.checkpoint.train_state import TrainCheckpointer

    cfg = CFG.replace(weight_dtype="bfloat16", dtype="bfloat16")
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    state, _ = _one_update(cfg, jax.tree.map(jnp.copy, half))
    checkpointer = TrainCheckpointer(tmp_path)
    checkpointer.save(1, state.params, state.opt_state, {"step": 1})
    template = jax.tree.map(jnp.zeros_like, (state.params, state.opt_state))
    params_back, opt_back, _ = checkpointer.restore(1, *template)
    checkpointer.close()
    saved, restored = jax.tree.leaves(state.opt_state.master), jax.tree.leaves(opt_back.master)
    for a, b in zip(saved, restored, strict=True):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    widened = jax.tree.leaves(jax.tree.map(lambda x: x.astype(jnp.float32), params_back))
    assert any(
        not np.array_equal(np.asarray(m), np.asarray(w)) for m, w in zip(restored, widened, strict=True)
    )
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _pad_completions(batch: dict, width: int) -> dict:
    """``batch`` with its [B, C] fields padded to ``width`` columns (pad id 0, mask 0, logprobs 0)."""
    out = dict(batch)
    for name in ("completion_ids", "completion_mask", "ref_logprobs", "old_logprobs", "rollout_logprobs"):
        if name in out:
            x = np.asarray(out[name])
            out[name] = np.pad(x, ((0, 0), (0, width - x.shape[1])))
    return out


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"])
def test_trimmed_update_equals_padded(params, mode):
    """The batch cut to its longest completion (C = 6) gives the loss, metrics and gradients of the same batch
    padded to max_completion_length = 16, for every loss_agg_mode (L_max passed, not read from the shape)."""
    trimmed = _batch()
    ref = np.asarray(compute_logprobs(params, trimmed, CFG, TEMPERATURE, 1))
    rng = np.random.default_rng(4)
    trimmed["old_logprobs"] = ref + rng.normal(0, 0.3, ref.shape).astype(np.float32)
    trimmed["ref_logprobs"] = ref + rng.normal(0, 0.1, ref.shape).astype(np.float32)
    trimmed["rollout_logprobs"] = ref + rng.normal(0, 0.05, ref.shape).astype(np.float32)
    padded = _pad_completions(trimmed, 16)
    # The reference pass: equal to float32 rounding. Not bit for bit: the attention's contraction over the
    # key axis (prompt + C) runs over 10 more zero-weighted keys when padded, and XLA:CPU's dot kernels group the
    # terms by the contraction's length (on an AVX-512 machine a K-padded "BNTS,BSNH" einsum differed in 20 of
    # 20 random draws; on AVX2 machines it happened to agree), so a few logprobs move by an ulp.
    np.testing.assert_array_max_ulp(
        np.asarray(compute_logprobs(params, padded, CFG, TEMPERATURE, 1))[:, :C], ref, maxulp=4
    )
    grpo = GRPOConfig(loss_agg_mode=mode, beta=0.05, epsilon_high=0.28, temperature=TEMPERATURE)
    fn = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4), static_argnames=("max_completion_length",))
    loss_p, grads_p, aux_p = fn(params, padded, CFG, grpo, 2, max_completion_length=16)
    loss_t, grads_t, aux_t = fn(params, trimmed, CFG, grpo, 2, max_completion_length=16)
    assert float(aux_p["clip_region_frac"]) > 0
    np.testing.assert_allclose(float(loss_t), float(loss_p), rtol=1e-6, atol=1e-7)
    for key in aux_p:
        np.testing.assert_allclose(float(aux_t[key]), float(aux_p[key]), rtol=1e-5, atol=1e-7, err_msg=key)
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    assert np.linalg.norm(flat(grads_t) - flat(grads_p)) <= 1e-6 * np.linalg.norm(flat(grads_p))
    if mode == "sequence-mean-token-sum-norm":  # L_max matters: the batch's own C = 6 gives another loss
        loss_c, _, _ = fn(params, trimmed, CFG, grpo, 2, max_completion_length=None)
        np.testing.assert_allclose(float(loss_c), float(loss_p) * 16 / C, rtol=1e-5)


def test_spread_prompts_give_the_same_loss_and_gradients(params, monkeypatch):
    """3 prompts x G = 2 over (pretended) 6 devices: each prompt row repeated, each copy answered by one of
    its completions; the loss and gradients are those of one row per prompt."""
    batch = _grouped_batch()
    grpo = GRPOConfig(num_generations=2, beta=0.0, temperature=TEMPERATURE)
    fn = jax.jit(accumulate_gradients, static_argnums=(2, 3, 4))
    loss1, grads1, _ = fn(params, batch, CFG, grpo, 1)
    split = Batch.split
    seen = []

    def spread(self, num_micro_batches, prompt_shards=1):
        out = split(self, num_micro_batches, 6)
        seen.append(out.prompt_ids.shape)
        return out

    monkeypatch.setattr(Batch, "split", spread)
    jax.clear_caches()
    loss6, grads6, _ = fn(params, batch, CFG, grpo, 1)
    assert seen == [(1, 6, P)]
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    np.testing.assert_allclose(float(loss6), float(loss1), rtol=1e-6, atol=1e-7)
    assert np.linalg.norm(flat(grads6) - flat(grads1)) <= 1e-6 * np.linalg.norm(flat(grads1))


def test_logits_chunk_holds_enough_tokens_per_chip_for_a_large_vocabulary():
    """The head's chunks: the element budget alone cut qwen3-0.6b's 64 x 256 completion tokens on one chip into
    256 chunks of one token per row (each chunk reads the float32 head and its gradient: bound by bytes); the
    token floor makes 32 chunks of 8 (512 tokens per chip). A small vocabulary keeps the element budget's larger
    chunks; a short completion is one chunk."""
    logits_chunk = train_step_module.logits_chunk
    assert train_step_module.LOGITS_CHUNK_MIN_TOKENS == 512
    assert logits_chunk(64, 151_936, 256) == 1  # the element budget alone (a CPU)
    assert logits_chunk(64, 151_936, 256, 512) == 8  # an accelerator's floor
    assert logits_chunk(16, 49_152, 192) == 20  # the README's main job on a CPU: 10 chunks of 20
    assert logits_chunk(16, 49_152, 192, 512) == 32  # ... on a TPU: 6 of 32
    assert (
        logits_chunk(2, 1_000, 10_000, 512) == 5_000
    )  # 2**24 logits per chip: 8,388 positions; 2 equal chunks
    assert logits_chunk(64, 151_936, 5, 512) == 5
    bound = train_step_module.logits_chunk_bytes(151_936)
    assert bound == 4 * 512 * 151_936 >= 4 * 64 * logits_chunk(64, 151_936, 256) * 151_936


def test_the_head_chunk_floor_is_an_accelerators(monkeypatch):
    """The floor of tokens per chunk applies where the mesh is on an accelerator (a TPU topology compiled from
    this CPU included), not on a CPU's mesh or outside one: the CPU's chunks, and so the README's main job, are
    as before."""
    import types

    assert train_step_module.head_chunk_floor() == 0  # no mesh
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        assert train_step_module.head_chunk_floor() == 0  # a CPU's
    tpu = types.SimpleNamespace(abstract_device=types.SimpleNamespace(platform="tpu"))
    monkeypatch.setattr(jax.sharding, "get_abstract_mesh", lambda: tpu)
    assert train_step_module.head_chunk_floor() == 512
