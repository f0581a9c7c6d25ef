"""Rollout routing replay (``router_replay``) on a tiny mixture of experts, CPU float32.

The sampler records each token's top-k experts per layer; the trainer compares its own top-k with them
(``router/disagreement_*``) and, with replay, routes by them. The sampler/trainer mismatch is made on purpose:
experts 0 and 1 get nearly equal router rows, the trainer's tilted one way and the sampler's the other by a
logit difference of ~3e-5 (far above float32 rounding), so wherever the pair straddles the top-k boundary the
two pick different experts. Replay must then give the sampler's logprobs back, to the ~1e-5 nats that the tilt
itself moves the gates by (bit-near exactly with the sampler's own weights); without it the flips show in the
logprobs (over 1e-2 nats) and in the disagreement metric.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.batch import Batch
from grpax.rl.config import GRPOConfig
from grpax.rl.train_step import TrainState, compute_logprobs, make_train_step
from grpax.sampler.engine import generate
from grpax.sampler.keys import SamplerConfig

CFG = ModelConfig(
    vocab_size=64, hidden_dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    family="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True,
)  # fmt: skip
SC = SamplerConfig(
    max_prompt_length=8, max_completion_length=16, temperature=1.0, pad_token_id=0, stop_token_ids=(1,),
    record_routes=True,
)  # fmt: skip
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
_forward = jax.jit(forward, static_argnames=("cfg", "return_routes"))


def _params(tilt: float | None) -> dict:
    """The tiny model, routers x50 (decisive routing) and experts x10 (a flipped route moves the logits);
    ``tilt``: expert 1's router row set to expert 0's plus ``tilt`` times a fixed random direction."""
    params = init_params(CFG, jax.random.key(0))
    layers = dict(params["layers"])
    layers["router"] = layers["router"] * 50
    for name in ("expert_gate", "expert_up", "expert_down"):
        layers[name] = layers[name] * 10
    if tilt is not None:
        u = jax.random.normal(jax.random.key(1), layers["router"].shape[:2])
        layers["router"] = layers["router"].at[..., 1].set(layers["router"][..., 0] + tilt * u)
    return {**params, "layers": layers}


def _rollout(params) -> tuple[Batch, np.ndarray]:
    """G = 2 sampled completions of each prompt as a train batch (with the recorded routing) and the sampler's
    logprobs."""
    out = generate(params, PROMPTS, CFG, SC, jax.random.key(3), num_generations=2)
    batch = Batch(
        out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
        advantages=np.array([1.0, -1.0, 1.0, -1.0], np.float32), rollout_logprobs=out.logprobs,
        routed_experts=out.routed_experts, prompt_routed_experts=out.prompt_routed_experts,
    )  # fmt: skip
    return jax.tree.map(jnp.asarray, batch), out.logprobs


def _lengths(batch: Batch) -> np.ndarray:
    return np.asarray(batch.completion_mask).sum(axis=1)


def _own_routes(params, batch: Batch) -> tuple[list, list]:
    """Each row's prompt + completion through the plain ``forward`` (not the trainer's grouped one): the
    router's own top-k of each prompt's real tokens (once per prompt: causal, they do not depend on the
    completion) and of each row's completion tokens that precede a counted one (length - 1 of them)."""
    prompts, completions = [], []
    G = batch.completion_ids.shape[0] // batch.prompt_ids.shape[0]
    for b, n in enumerate(_lengths(batch)):
        prompt = np.asarray(batch.prompt_ids[b // G])[np.asarray(batch.prompt_mask[b // G]) > 0]
        seq = np.concatenate([prompt, np.asarray(batch.completion_ids[b])])[None]
        _, _, routing = _forward(params, seq, CFG, return_routes=True)
        experts = np.asarray(routing.experts[0])  # [T, L, k]
        if b % G == 0:
            prompts.append(experts[: len(prompt)])
        completions.append(experts[len(prompt) : len(prompt) + n - 1])
    return prompts, completions


def _recorded(batch: Batch) -> tuple[list, list]:
    """The batch's recorded routes on the tokens ``_own_routes`` returns."""
    masks = np.asarray(batch.prompt_mask) > 0
    prompts = [np.asarray(r)[m] for r, m in zip(batch.prompt_routed_experts, masks, strict=True)]
    completions = [np.asarray(batch.routed_experts[b])[: n - 1] for b, n in enumerate(_lengths(batch))]
    return prompts, completions


def _disagreement(params, batch: Batch) -> np.ndarray:
    """Per layer, the share of the plain forward's own k choices the sampler did not make."""
    own, recorded = _own_routes(params, batch), _recorded(batch)
    own, recorded = np.concatenate(own[0] + own[1]), np.concatenate(recorded[0] + recorded[1])
    kept = (own[..., :, None] == recorded[..., None, :]).any(-1)  # [T, L, k]
    return 1.0 - kept.mean(axis=(0, 2))


def test_the_sampler_records_the_routing_the_model_computes():
    """Same params, decisive routers: the recorded routes (prefill and decode, int8 [B, C, L, k]) are the plain
    forward's top-k of every prompt and fed completion token, and the trainer's logprobs are the sampler's."""
    params = _params(tilt=None)
    batch, sampler_logprobs = _rollout(params)
    assert batch.routed_experts.shape == (4, 16, 2, 2) and batch.routed_experts.dtype == jnp.int8
    assert batch.prompt_routed_experts.shape == (2, 8, 2, 2)
    own, recorded = _own_routes(params, batch), _recorded(batch)
    for a, b in zip(own[0] + own[1], recorded[0] + recorded[1], strict=True):
        assert np.array_equal(a, b)
    assert (_disagreement(params, batch) == 0).all()
    logprobs = np.asarray(compute_logprobs(params, batch, CFG, 1.0))
    assert np.abs(logprobs - sampler_logprobs).max() <= 1e-5


@pytest.fixture(scope="module")
def flipped():
    """A rollout by the sampler's tilt, the trainer's params tilted the other way."""
    trainer, sampler = _params(tilt=5e-6), _params(tilt=-5e-6)
    batch, sampler_logprobs = _rollout(sampler)
    return trainer, batch, sampler_logprobs


def test_replay_gives_the_sampler_logprobs_despite_flipped_routes(flipped):
    trainer, batch, sampler_logprobs = flipped
    mask = np.asarray(batch.completion_mask) > 0
    share = _disagreement(trainer, batch)
    assert (share > 0.1).all(), share  # the tilt flips routes in every layer
    free = np.asarray(compute_logprobs(trainer, batch, CFG, 1.0))
    replayed = np.asarray(compute_logprobs(trainer, batch, CFG, 1.0, replay=True))
    assert np.abs(free - sampler_logprobs)[mask].max() > 1e-2
    # The tilts' own effect: a replayed pair's gate is computed from the trainer's router logit, ~3e-5 from the
    # sampler's; it moves the logprobs by ~1e-5 (4x that at a 4x larger tilt), the flips by over 1e-2.
    assert np.abs(replayed - sampler_logprobs)[mask].max() <= 3e-5
    # The sampler's own weights, replayed: its logprobs to float32 rounding.
    own = np.asarray(compute_logprobs(_params(tilt=-5e-6), batch, CFG, 1.0, replay=True))
    assert np.abs(own - sampler_logprobs)[mask].max() <= 2e-6


@pytest.mark.parametrize("mode", ["record", "replay"])
def test_update_reports_the_router_disagreement_with_and_without_replay(flipped, mode):
    """The update's router/disagreement_{mean,max} are the plain forward's own top-k against the recorded one
    (record: the trainer routes by its own; replay: by the recorded, its own top-k still compared), and its
    pi_old matches the sampler's logprobs only with replay."""
    trainer, batch, _ = flipped
    grpo = GRPOConfig(beta=0.0, temperature=1.0, num_generations=2, router_replay=mode)
    optimizer = optax.sgd(0.1)
    step = make_train_step(CFG, grpo, optimizer, num_micro_batches=2)
    params = jax.tree.map(jnp.array, trainer)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    _, metrics = step(state, batch)
    if mode == "record":
        share = _disagreement(trainer, batch)
        assert float(metrics["router/disagreement_mean"]) == pytest.approx(share.mean(), abs=1e-6)
        assert float(metrics["router/disagreement_max"]) == pytest.approx(share.max(), abs=1e-6)
        assert float(metrics["mismatch/logprob_diff_max"]) > 1e-2
    else:  # its own top-k, downstream of the replayed layers: still most flips, compared all the same
        assert float(metrics["router/disagreement_mean"]) > 0.1
        assert float(metrics["mismatch/logprob_diff_max"]) <= 3e-5  # the tilts' own effect, as above
    assert "router/disagreement_sum" not in metrics and "load_balance_loss" not in metrics


def test_load_balancing_loss_is_an_option_that_trains_the_router(flipped):
    """load_balance_loss_weight > 0 adds Switch Transformer's loss (E sum_e f_e P_e: k = 2 for a uniform
    router, at most E = 4 here) and its gradient reaches the router: with zero advantages (no policy gradient)
    the router still moves."""
    trainer, batch, _ = flipped
    grpo = GRPOConfig(beta=0.0, temperature=1.0, num_generations=2, load_balance_loss_weight=1.0)
    optimizer = optax.sgd(1.0)
    step = make_train_step(CFG, grpo, optimizer, num_micro_batches=1)
    params = jax.tree.map(jnp.array, trainer)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    new, metrics = step(state, batch.replace(advantages=jnp.zeros(4)))
    assert 2.0 - 1e-6 <= float(metrics["load_balance_loss"]) <= 4.0
    moved = np.abs(np.asarray(trainer["layers"]["router"]) - np.asarray(new.params["layers"]["router"]))
    assert moved.max() > 0.0
