"""The device side of multi-turn rollouts: decode segments that pause rows at turn ends and continue them in
the same KV cache after their observation tokens.

A trajectory is ``prompt, turn 1, observation 1, turn 2, ...`` in one row of T = ``max_completion_length``
slots after the prompt (slot == position, as in ``grpax.sampler.engine``). ``decode_segment`` runs the decode
loop inside ``jax.jit`` until a row pauses, after a stop token or a token that may end one of the
environment's stop strings (``pause_table``: the host checks the text), or until no row runs (a row also stops
at its turn's token budget, ``turn_end``, or at T). Returning at the first pause, not when every row has
paused, keeps rows from idling while the slowest row finishes its turn; a return costs one small host
round trip. The host (``grpax.rl.multi_turn``) then calls the environment and gives the paused rows
their observation tokens (``forced``), which the next segment feeds through the same decode step, one per
step, into the same cache (mask 0, logprob 0: in the sequence, out of the loss), before the row samples
again. The cache is never rebuilt: continuing a row costs its observation's tokens, not a new prefill of
the conversation, and the logprobs of the model tokens are those of one forward over the final sequence.

Rows that are not running (paused, finished) still pass through the batched decode step; their key/value is
written at their next free slot (``prompt_length + n``), which the row's own next token overwrites before
anything attends to it, and their logits are kept. Each row's noise is ``fold_in(fold_in(key, row), n)``
(n = its tokens so far), so a row's sample does not depend on when the others paused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler.engine import SamplerConfig, _compiled
from grpax.sampler.sampling import draw_from_uniform, filter_logits, token_logprobs

# Why a row stopped running (``state["reason"]``).
RUNNING, STOP_TOKEN, STOP_CANDIDATE, TURN_BUDGET, TRAJECTORY_BUDGET = range(5)

STATE_FIELDS = (
    "ids",  # int32 [B, T] trajectory tokens (model and observation); pad after n
    "mask",  # int32 [B, T] 1 = a model token (in the loss)
    "logprobs",  # float32 [B, T] the sampler's logprob of each model token; 0 elsewhere
    "n",  # int32 [B] tokens written so far
    "logits",  # float32 [B, V] the next token's logits
    "prompt_lengths",  # int32 [B]
    "run",  # bool [B] the row decodes in this segment
    "turn_end",  # int32 [B] the n at which this turn's token budget ends
    "forced",  # int32 [B, F] observation tokens to feed before sampling again
    "num_forced",  # int32 [B]
    "forced_pos",  # int32 [B] those already fed
    "reason",  # int32 [B] why the row paused (RUNNING, STOP_TOKEN, ...)
)


def _row_uniforms(key: jax.Array, n: jax.Array) -> jax.Array:
    """float32 [B, 2] uniforms, row b's from fold_in(fold_in(key, b), n[b])."""

    def one(b, nb):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, b), nb), (2,), jnp.float32)

    return jax.vmap(one)(jnp.arange(n.shape[0]), n)


def _prepare(params: Params, cfg: ModelConfig, backend, num_slots: int):
    return backend.prepare_decode(params, cfg, num_slots)


def prepare_decode(params: Params, cfg: ModelConfig, backend, num_slots: int):
    """The backend's decode weights (``prepare_decode``), once per rollout: every segment reads them (a
    backend's weight packing per segment would cost as much as many decode steps)."""
    fn = _compiled(_prepare, ("cfg", "backend", "num_slots"), backend.compiler_options)
    return fn(params, cfg, backend, num_slots)


def _decode_segment(
    prepared,
    cache: dict,
    state: dict,
    key: jax.Array,
    stop_table: jax.Array,
    pause_table: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    backend,
) -> tuple[dict, dict]:
    """Decodes until a row pauses at a turn's end (the host's turn: its environment) or no row runs; returns
    (cache, state). Rows still running keep ``run`` and ``reason == RUNNING``; the others' ``reason`` says why.

    Args:
      prepared: the backend's decode weights (``prepare_decode``).
      cache: per-layer KV buffers of P + T slots (``engine._prefill``).
      state: ``STATE_FIELDS`` (shapes there).
      key: the rollout's PRNG key.
      stop_table: bool [V], True for the tokens that end a turn (EOS, end of turn).
      pause_table: bool [V], True for the tokens after which the host checks the stop strings.
      cfg, sampler_cfg: static; ``sampler_cfg.max_completion_length`` is T.
      backend: the sampler backend (``grpax.sampler.backend.select_backend``).
    """
    sc = sampler_cfg
    T = state["ids"].shape[1]
    num_slots = jax.tree.leaves(cache["k"])[0].shape[-1]
    slots = jnp.arange(T)[None, :]

    def cond(carry):
        _, s, paused = carry
        return jnp.any(s["run"]) & ~paused

    def body(carry):
        cache, s, _ = carry
        run = s["run"]
        forcing = run & (s["forced_pos"] < s["num_forced"])
        if sc.greedy:
            sampled = jnp.argmax(s["logits"], axis=-1).astype(jnp.int32)
            logprob = token_logprobs(s["logits"], sampled)
        else:
            scaled = filter_logits(s["logits"], sc.temperature, sc.top_k, sc.top_p)
            sampled = draw_from_uniform(scaled, _row_uniforms(key, s["n"]))
            logprob = token_logprobs(scaled, sampled)
        forced = jnp.take_along_axis(
            s["forced"], jnp.minimum(s["forced_pos"], s["forced"].shape[1] - 1)[:, None], axis=1
        )[:, 0]
        token = jnp.where(forcing, forced, sampled).astype(jnp.int32)
        model = run & ~forcing
        at = (slots == s["n"][:, None]) & run[:, None]  # [B, T]: this step's slot of the running rows
        ids = jnp.where(at, token[:, None], s["ids"])
        mask = jnp.where(at, model[:, None].astype(jnp.int32), s["mask"])
        logprobs = jnp.where(at, jnp.where(model, logprob, 0.0)[:, None], s["logprobs"])
        pos = jnp.minimum(s["prompt_lengths"] + s["n"], num_slots - 1)
        fed = jnp.where(run, token, sc.pad_token_id)
        logits, cache = backend.decode_step(prepared, fed, pos[:, None], cache, cfg)
        n = s["n"] + run.astype(jnp.int32)
        reason = jnp.where(
            ~run,
            s["reason"],
            jnp.where(
                model & stop_table[token],
                STOP_TOKEN,
                jnp.where(
                    model & pause_table[token],
                    STOP_CANDIDATE,
                    jnp.where(
                        n >= T,
                        TRAJECTORY_BUDGET,
                        jnp.where(model & (n >= s["turn_end"]), TURN_BUDGET, RUNNING),
                    ),
                ),
            ),
        )
        s = {
            **s,
            "ids": ids,
            "mask": mask,
            "logprobs": logprobs,
            "n": n,
            "logits": jnp.where(run[:, None], logits, s["logits"]),
            "forced_pos": s["forced_pos"] + forcing.astype(jnp.int32),
            "reason": reason.astype(jnp.int32),
            "run": run & (reason == RUNNING),
        }
        paused = jnp.any(run & ((reason == STOP_TOKEN) | (reason == STOP_CANDIDATE)))  # the host's turn
        return cache, s, paused

    cache, state, _ = jax.lax.while_loop(cond, body, (cache, state, jnp.bool_(False)))
    return cache, state


def decode_segment(prepared, cache, state, key, stop_table, pause_table, cfg, sampler_cfg, backend):
    """``_decode_segment`` compiled with the backend's XLA options (once per shape and config)."""
    fn = _compiled(_decode_segment, ("cfg", "sampler_cfg", "backend"), backend.compiler_options)
    return fn(prepared, cache, state, key, stop_table, pause_table, cfg, sampler_cfg, backend)
