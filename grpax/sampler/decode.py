"""The rollout engine's device programs: prompts admitted into the paged KV cache, and decode steps of a fixed
set of slots. ``grpax.sampler.engine`` schedules them from the host.

``admit`` prefills new prompts (the backend's prefill into a dense cache of the prompt bucket), writes their keys
and values into the pages the host chose (a prompt's full pages once, for all its G completions; its partial
last page into each completion's own first page) and samples each completion's first token. ``decode`` runs up
to ``num_steps`` decode steps of S slots inside one ``lax.while_loop``, the page pools in the loop carry
(updated in place: the pools are donated to the call, so neither program copies them). Each step feeds every
running slot's last token (or the next of its forced tokens: a multi-turn observation), samples the next, and
ends a slot's segment at a stop token, a pause token (the host checks a stop string), its turn budget or its
length limit. The loop returns early once ``exit_after`` segments have ended (the host then refills their
slots) or no slot runs. A third program, ``refill``, recomputes running sequences' keys and values after a
weight swap (AReaL's interruptible generation): the prefill of each one's context written into its own pages.

A sequence's noise depends on nothing but its own key, row id and token index: token n of row r draws the
uniforms of ``fold_in(fold_in(key, n), r)``, the static engine's ``fold_in(fold_in(key, step), row)`` with
step == n, so the slot it runs in, its companions and when it was admitted change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpax.models.llama import init_cache, logits_from_hidden
from grpax.models.moe import route_dtype
from grpax.sampler.sampling import (
    draw_from_uniform,
    filter_logits,
    filter_logits_per_row,
    sample_tokens,
    token_logprobs,
)

# Why a slot's segment ended (``reason``); RUNNING: it did not.
RUNNING, STOP, PAUSE, LENGTH, TURN = range(5)
# A row's sampling rule, one array per field (``sample``).
RULE_FIELDS = ("temperature", "top_k", "top_p")


def row_uniforms(keys: jax.Array, n: jax.Array, rows: jax.Array) -> jax.Array:
    """float32 [S, 2] uniforms, slot s's from fold_in(fold_in(keys[s], n[s]), rows[s]) (keys: typed [S])."""
    with jax.named_scope("rng"):

        def one(key, step, row):
            return jax.random.uniform(
                jax.random.fold_in(jax.random.fold_in(key, step), row), (2,), jnp.float32
            )

        return jax.vmap(one)(keys, n, rows)


def sample(
    logits: jax.Array, keys: jax.Array, n: jax.Array, rows: jax.Array, sc, rule: dict | None = None
) -> tuple[jax.Array, jax.Array]:
    """Token n of each slot from its logits float32 [S, V] with the noise of ``row_uniforms``; returns int32 [S]
    tokens and their float32 [S] log-probabilities under the distribution drawn from (``filter_logits``;
    greedy: the unfiltered softmax at temperature 1).

    ``rule`` None: every slot samples by ``sc``'s fields (static: the GRPO rollout's program). Else each slot by
    its own rule, read as data (one program for every mix of rules): ``rule`` holds float32 ``temperature`` [S]
    (0 = greedy), int32 ``top_k`` [S] (0 = off) and float32 ``top_p`` [S] (1.0 = off; greedy rows carry top_k 0
    and top_p 1.0); where every slot is greedy the draw is skipped, where none is the argmax, and top-k takes
    ``lax.top_k``'s path where every slot asks ``sc.top_k`` (``apply_top_k_per_row``): a per-row call costs about
    the static one's except for mixes of greedy and sampled rows and of several top-k values
    (``benchmarks/per_row_sampling.py``, docs/benchmarks.md). A slot's tokens are the same both ways; its logprobs
    may differ in the last float32 bit (XLA fuses a static temperature's scaling differently).
    """
    with jax.named_scope("sampling"):  # profiles split it: top_k, top_p, rng, draw, logprobs
        if rule is not None:
            return _sample_per_row(logits, keys, n, rows, rule, sc.top_k)
        if sc.greedy:
            token = sample_tokens(logits, None, greedy=True)
            return token, token_logprobs(logits, token)
        scaled = filter_logits(logits, sc.temperature, sc.top_k, sc.top_p)
        token = draw_from_uniform(scaled, row_uniforms(keys, n, rows))
        return token, token_logprobs(scaled, token)


def _sample_per_row(logits, keys, n, rows, rule: dict, static_top_k: int) -> tuple[jax.Array, jax.Array]:
    """``sample`` with each slot's own ``rule``."""
    greedy = rule["temperature"] == 0.0

    def argmax(logits):
        token = sample_tokens(logits, None, greedy=True)
        return token, token_logprobs(logits, token)

    def draw(logits):
        temperature = jnp.where(greedy, 1.0, rule["temperature"])  # a greedy row's logits unchanged
        scaled = filter_logits_per_row(logits, temperature, rule["top_k"], rule["top_p"], static_top_k)
        token = draw_from_uniform(scaled, row_uniforms(keys, n, rows))
        token = jax.lax.cond(  # XLA:CPU's argmax over V costs about a draw: only where a row is greedy
            jnp.any(greedy),
            lambda token: jnp.where(greedy, sample_tokens(logits, None, greedy=True), token),
            lambda token: token,
            token,
        )
        return token, token_logprobs(scaled, token)

    return jax.lax.cond(jnp.all(greedy), argmax, draw, logits)


def admit(
    params,
    pages: list,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    dest: jax.Array,
    key_data: jax.Array,
    rows: jax.Array,
    rule: dict | None,
    cfg,
    sampler_cfg,
    num_generations: int,
    backend,
    plan,
    key_impl: str,
):
    """Prefills N right-padded prompts into the pages and samples each of their G completions' first token.

    Args:
      params: the model's params (any sharding).
      pages: the backend's page pools (``init_pages``), donated.
      prompt_tokens: int32 [N, P] right-padded prompts (P: the prompt bucket); prompt_lengths: int32 [N].
      dest: int32 [N, G, P] the page prompt token t of completion g goes to (offset t % page_size); past the
        pool (padding, and a shared page's copies for g > 0) it is not written.
      key_data: [N * G, ...] each completion's PRNG key data (``jax.random.key_data``, impl ``key_impl``).
      rows: int32 [N * G] each completion's row id (its noise).
      rule: each completion's sampling rule, [N * G] per field, or None: ``sampler_cfg``'s for all (``sample``).
      cfg, sampler_cfg, num_generations (G), backend, plan, key_impl: static.

    Returns:
      (pages, int32 [N * G] first tokens, float32 [N * G] their logprobs, and where the backend records a
      mixture of experts' routing (``record_routes``) the prompt tokens' experts [N, P, L, k] in
      ``route_dtype``, else None); completion i answers prompt i // G.
    """
    N, P = prompt_tokens.shape
    cache = init_cache(cfg, N, P, sampler_cfg.cache_dtype or cfg.dtype, stacked=False)
    last, cache, *routes = backend.prefill(
        params, prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), cache, cfg, plan
    )
    with jax.named_scope("kv_cache"):
        pages = backend.write_prompts(pages, cache, dest)
    logits = jnp.repeat(logits_from_hidden(params, last, cfg), num_generations, axis=0)  # [N * G, V]
    keys = jax.random.wrap_key_data(key_data, impl=key_impl)
    token, logprob = sample(logits, keys, jnp.zeros_like(rows), rows, sampler_cfg, rule)
    routes = routes[0].astype(route_dtype(cfg.num_experts)) if routes else None
    return pages, token, logprob, routes


def refill(
    params,
    pages: list,
    tokens: jax.Array,
    lengths: jax.Array,
    dest: jax.Array,
    cfg,
    sampler_cfg,
    backend,
    plan,
):
    """Recomputes the keys and values of R sequences' contexts under ``params`` into their pages (a weight swap:
    ``Engine.update_params``): the backend's prefill of each context, written where ``dest`` says.

    Args:
      params: the model's params (the new version's).
      pages: the page pools, donated.
      tokens: int32 [R, T] right-padded contexts (a sequence's prompt and every token it has fed: all but its
        last); lengths: int32 [R], each in 1..T.
      dest: int32 [R, T] the page of context token t (offset t % page_size); past the pool it is not written
        (padding, and a shared prompt page another row writes).
      cfg, sampler_cfg, backend, plan: static.

    Returns:
      The pools.
    """
    R, T = tokens.shape
    cache = init_cache(cfg, R, T, sampler_cfg.cache_dtype or cfg.dtype, stacked=False)
    _, cache, *_ = backend.prefill(
        params, tokens.astype(jnp.int32), lengths.astype(jnp.int32), cache, cfg, plan
    )
    with jax.named_scope("kv_cache"):
        return backend.write_prompts(pages, cache, dest[:, None])


def decode(
    prepared,
    pages: list,
    slots: dict,
    rule: dict | None,
    stop_table: jax.Array,
    pause_table: jax.Array,
    exit_after: jax.Array,
    cfg,
    sampler_cfg,
    backend,
    num_steps: int,
    key_impl: str,
):
    """Up to ``num_steps`` decode steps of S slots, all in one ``lax.while_loop``.

    Args:
      prepared: ``backend.prepare_decode``'s output, or the params where the backend prepares them inside each
        program (``backend.prepares_once`` false).
      pages: the page pools, donated.
      slots: per slot [S]: ``token`` int32 (its last token, fed next), ``n`` int32 (completion tokens so far,
        >= 1), ``prompt_length`` int32, ``active`` bool (runs), ``rows`` int32 (row id), ``key_data`` (PRNG
        key data), ``page_table`` int32 [S, n_pages], ``forced`` int32 [S, F] (tokens to feed before sampling
        again), ``num_forced`` and ``forced_pos`` int32, ``turn_end`` int32 (n at which a turn's budget ends),
        ``limit`` int32 (n at which the sequence ends), ``pauses`` bool (its segments end at pause tokens).
      rule: each slot's sampling rule, [S] per field, or None: ``sampler_cfg``'s for all (``sample``).
      stop_table, pause_table: bool [V], the tokens that end a segment (a stop token) or pause it.
      exit_after: int32 []: return once this many segments have ended in this call.
      cfg, sampler_cfg, backend, num_steps, key_impl: static.

    Returns:
      (pages, ``tokens`` int32 [S, num_steps], ``logprobs`` float32 [S, num_steps] (0 for forced tokens),
      ``model`` bool [S, num_steps] (sampled, not forced), ``wrote`` bool [S, num_steps] (a token recorded at
      that step), and the slots' final ``token``, ``n``, ``forced_pos``, ``reason`` [S] and ``steps`` []); where
      the backend records a mixture of experts' routing (``record_routes``) also ``routes`` [S, num_steps, L, k]
      in ``route_dtype``: the experts of the token each slot fed at that step (its token n - 1).
    """
    sc = sampler_cfg
    S = slots["token"].shape[0]
    if not backend.prepares_once:  # the compiler reads the weights in place, no prepared copy
        prepared = backend.prepare_decode(prepared, cfg, sc.max_prompt_length + sc.max_completion_length)
    keys = jax.random.wrap_key_data(slots["key_data"], impl=key_impl)
    positions_base = slots["prompt_length"] - 1
    out = _empty_outputs(S, num_steps, cfg, sc, backend)
    state = {
        "token": slots["token"].astype(jnp.int32),
        "n": slots["n"].astype(jnp.int32),
        "forced_pos": slots["forced_pos"].astype(jnp.int32),
        "active": slots["active"],
        "reason": jnp.zeros((S,), jnp.int32),
        "ended": jnp.int32(0),
    }

    def cond(carry):
        i, state, _, _ = carry
        return (i < num_steps) & jnp.any(state["active"]) & (state["ended"] < exit_after)

    def body(carry):
        i, s, pages, out = carry
        positions = jnp.where(s["active"], positions_base + s["n"], -1)  # the fed token's position
        logits, pages, *routes = backend.decode_step(
            prepared, s["token"], positions, pages, slots["page_table"], cfg
        )
        with jax.named_scope("record"):
            sampled, logprob = sample(logits, keys, s["n"], slots["rows"], sc, rule)
            s, out = _record(
                i, s, out, sampled, logprob, routes, slots, sc.pad_token_id, stop_table, pause_table
            )
        return i + 1, s, pages, out

    steps, state, pages, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, pages, out))
    final = {name: state[name] for name in ("token", "n", "forced_pos", "reason")}
    return pages, {**out, **final, "steps": steps}


def _empty_outputs(S: int, num_steps: int, cfg, sc, backend) -> dict:
    """``decode``'s per-step outputs before its first step (pad tokens, nothing written)."""
    out = {
        "tokens": jnp.full((S, num_steps), sc.pad_token_id, jnp.int32),
        "logprobs": jnp.zeros((S, num_steps), jnp.float32),
        "model": jnp.zeros((S, num_steps), bool),
        "wrote": jnp.zeros((S, num_steps), bool),
    }
    if getattr(backend, "record_routes", False):
        route_shape = (cfg.num_layers, cfg.num_experts_per_tok)
        out["routes"] = jnp.zeros((S, num_steps, *route_shape), route_dtype(cfg.num_experts))
    return out


def _record(
    i, s: dict, out: dict, sampled, logprob, routes, slots: dict, pad_token_id: int, stop_table, pause_table
):
    """``decode``'s step ``i`` recorded: each active slot's token (its next forced token, else ``sampled``) and
    logprob into ``out``; the slots' state ``s`` advanced, a slot whose segment ended (``segment_end``) made
    inactive. Returns ``(s, out)``."""
    active, forced, num_forced = s["active"], slots["forced"], slots["num_forced"]
    forcing = active & (s["forced_pos"] < num_forced)
    at = jnp.minimum(s["forced_pos"], forced.shape[1] - 1)[:, None]
    token = jnp.where(forcing, jnp.take_along_axis(forced, at, axis=1)[:, 0], sampled)
    model = active & ~forcing
    out = {
        **out,
        "tokens": out["tokens"].at[:, i].set(jnp.where(active, token, pad_token_id)),
        "logprobs": out["logprobs"].at[:, i].set(jnp.where(model, logprob, 0.0)),
        "model": out["model"].at[:, i].set(model),
        "wrote": out["wrote"].at[:, i].set(active),
    }
    if routes:
        out["routes"] = out["routes"].at[:, i].set(routes[0].astype(out["routes"].dtype))
    n = s["n"] + active.astype(jnp.int32)
    reason = segment_end(
        token, model, n, slots["turn_end"], slots["limit"], stop_table, pause_table, slots["pauses"]
    )
    ended = active & (reason != RUNNING)
    s = {
        "token": jnp.where(active, token, s["token"]),
        "n": n,
        "forced_pos": s["forced_pos"] + forcing.astype(jnp.int32),
        "active": active & ~ended,
        "reason": jnp.where(active, reason, s["reason"]),
        "ended": s["ended"] + jnp.sum(ended, dtype=jnp.int32),
    }
    return s, out


def segment_end(token, model, n, turn_end, limit, stop_table, pause_table, pauses) -> jax.Array:
    """int32 [S]: why each slot's segment ends after recording ``token`` int32 [S] as its token n - 1 (RUNNING:
    it goes on): a sampled stop token (``stop_table`` bool [V]), a sampled pause token (``pause_table`` bool [V],
    where ``pauses`` bool [S]), the length limit, then the turn's budget."""
    return jnp.where(
        model & stop_table[token],
        STOP,
        jnp.where(
            model & pauses & pause_table[token],
            PAUSE,
            jnp.where(n >= limit, LENGTH, jnp.where(model & (n >= turn_end), TURN, RUNNING)),
        ),
    ).astype(jnp.int32)
