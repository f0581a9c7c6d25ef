"""The engine's program set: which prefill and decode programs it compiles, jitted once per process, and the same
programs with abstract arguments for a compile check.

An engine compiles either the fixed set (one decode slot count, the whole page table, one prompt padding, one
prompt count per group size, every row's sampling rule read as data: a small set known before the run, what an
accelerator runs) or the adaptive one (the ladders of ``grpax.sampler.keys`` that follow the work, what CPU
runs): ``SamplerConfig.programs``, resolved by ``fixed_programs``. ``abstract_programs`` builds the engine's two
programs with the shapes and placements it runs them with, so that the planner's compile check
(``grpax.plan.compile_check``) lowers the run's own programs. The programs themselves are
``grpax.sampler.decode``'s ``admit``, ``decode`` and ``refill``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler import decode
from grpax.sampler.keys import (
    SamplerConfig,
    fixed_prefill_prompts,
    prefill_prompts,
    program_group,
    slot_counts,
)
from grpax.sampler.paging import abstract_pool, pool_pages, pool_sharding


def fixed_programs(sampler_cfg: SamplerConfig, params: Params) -> bool:
    """Whether an engine on ``params`` (concrete or abstract with shardings) compiles the fixed program set
    (``SamplerConfig.programs``; auto: where the params live on accelerators)."""
    if sampler_cfg.programs != "auto":
        return sampler_cfg.programs == "fixed"
    try:
        devices = jax.tree.leaves(params)[0].sharding.device_set
    except (IndexError, AttributeError, ValueError, RuntimeError):  # none, unplaced, or an abstract mesh
        devices = jax.devices()
    return all(d.platform != "cpu" for d in devices)


def program_config(sampler_cfg: SamplerConfig, fixed: bool) -> SamplerConfig:
    """The ``SamplerConfig`` the programs are compiled with (a static argument): with the fixed set, its
    sampling fields at their neutral values (every row's rule is data), so that engines of other sampling (an
    evaluation's greedy rows, a request's own) run the rollout's decode."""
    if not fixed:
        return sampler_cfg
    return dataclasses.replace(sampler_cfg, temperature=1.0, top_k=0, top_p=1.0, greedy=False)


def describe_programs(sampler_cfg: SamplerConfig, fixed: bool, uses: dict[str, tuple[int, int]]) -> str:
    """One line naming the prefill and decode programs an engine compiles for each use (``uses``: name ->
    (prompts, G) at once, e.g. {"rollout": (4, 4), "evaluation": (16, 1)}): with the fixed set their shapes
    (a decode of as many slots as an earlier use's is that program); else the adaptive ladders."""
    sc = sampler_cfg
    if not fixed:
        counts = {sc.decode_slots(n * g) for n, g in uses.values()}
        ladders = "; ".join(
            f"{S} slots: {slot_counts(S, sc.slot_count_step) if sc.retire_rows else [S]}"
            for S in sorted(counts)
        )
        widths = (
            f"page-table widths by {sc.decode_phase_length} tokens"
            if sc.decode_phase_length
            else "the whole page table"
        )
        return (
            f"adaptive: decode slot counts ({ladders}), {widths}, prompt buckets {list(sc.buckets())}, "
            "power-of-two prompt counts: one program each as met"
        )
    parts, decodes, prefills = [], set(), set()
    for use, (n, g) in uses.items():
        S, G = sc.decode_slots(n * g), program_group(sc, fixed, g)
        decoding = (
            "the same decode"
            if S in decodes
            else (f"decode {S} slots x {sc.pages_per_sequence()} pages x {sc.decode_steps_per_call} steps")
        )
        decodes.add(S)
        P = list(sc.buckets()) if sc.prompt_length_buckets else sc.max_prompt_length  # Engine.prompt_width
        N = fixed_prefill_prompts(S, G)
        prefill = "the same prefill" if (N, G) in prefills else f"prefill {N} prompts x {P} tokens (G = {G})"
        prefills.add((N, G))
        parts.append(f"{use}: {prefill}, {decoding}")
    return "fixed: " + "; ".join(parts)


@functools.cache
def compiled(fn, static_argnames: tuple[str, ...], compiler_options: tuple[tuple[str, str], ...], donate=()):
    """``fn`` jitted with these XLA compiler options (the backend's) and ``donate`` donated, once per process."""
    return jax.jit(
        fn,
        static_argnames=static_argnames,
        donate_argnames=donate,
        compiler_options=dict(compiler_options) or None,
    )


ADMIT_STATIC = ("cfg", "sampler_cfg", "num_generations", "backend", "plan", "key_impl")
DECODE_STATIC = ("cfg", "sampler_cfg", "backend", "num_steps", "key_impl")
REFILL_STATIC = ("cfg", "sampler_cfg", "backend", "plan")
# Context tokens (rows x padded length) one ``refill`` call recomputes at most: a bound on its dense prefill cache.
REFILL_TOKENS = 16384


def compiled_admit(backend):
    """The jitted prefill of new prompts into the pages (``grpax.sampler.decode.admit``)."""
    return compiled(decode.admit, ADMIT_STATIC, backend.compiler_options, ("pages",))


def compiled_decode(backend):
    """The jitted decode steps of a set of slots (``grpax.sampler.decode.decode``)."""
    return compiled(decode.decode, DECODE_STATIC, backend.compiler_options, ("pages",))


def compiled_refill(backend):
    """The jitted recompute of sequences' keys and values after a weight swap (``grpax.sampler.decode.refill``)."""
    return compiled(decode.refill, REFILL_STATIC, backend.compiler_options, ("pages",))


@functools.cache
def compiled_zeros(backend, args: tuple, sharding):
    """The jitted ``backend.init_pages(*args)`` placed on ``sharding``, once per process and equal backend: an
    engine built per rollout (or per evaluation batch) compiles no new program for its pool."""
    return jax.jit(functools.partial(backend.init_pages, *args), out_shardings=sharding)


def rule_inputs(rules: list, size: int, default, as_data: bool) -> dict[str, np.ndarray] | None:
    """A program's ``rule`` argument for rows sampled by ``rules`` (``SamplingRule``s; rows past them: ``default``),
    float32/int32/float32 [size] per field of ``decode.RULE_FIELDS``; None where every row's is ``default`` and
    rules are not read as data (``as_data``: the fixed set, ``rules_as_data``): the static program, the GRPO
    rollout's."""
    if not as_data and all(rule == default for rule in rules):
        return None
    rows = [*rules, *[default] * (size - len(rules))]
    dtypes = (np.float32, np.int32, np.float32)
    return {
        name: np.asarray(column, dtype)
        for name, column, dtype in zip(decode.RULE_FIELDS, zip(*rows, strict=True), dtypes, strict=True)
    }


def routing_backend(backend, cfg: ModelConfig, sampler_cfg: SamplerConfig):
    """``backend`` recording a mixture of experts' routing where ``sampler_cfg.record_routes`` asks for it (the
    XLA backend: the CPU one runs dense Llama models only)."""
    if sampler_cfg.record_routes and cfg.num_experts:
        return dataclasses.replace(backend, record_routes=True)
    return backend


def prepare_decode(params: Params, cfg: ModelConfig, backend, num_slots: int):
    """The backend's once-per-version preparation of ``params`` for its decode step (the CPU kernels' packing)."""
    return backend.prepare_decode(params, cfg, num_slots)


class _Replicated:
    """A backend stand-in whose pools (and so the small per-slot arrays) are replicated."""

    def page_spec(self, cfg, mesh_shape):
        return jax.sharding.PartitionSpec()


def replicated_sharding(params: Params, cfg: ModelConfig):
    """Where a fixed program set's small host inputs go: replicated over the params' devices (None: the default
    device), as ``abstract_programs`` specifies them."""
    return pool_sharding(params, cfg, _Replicated())


def abstract_programs(
    params: Params,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    backend,
    num_prompts: int,
    num_generations: int,
) -> dict[str, tuple]:
    """The engine's two programs with abstract arguments for ``num_prompts`` x G sequences in flight (the decode
    slots full, the largest prefill ``prefill_prompts``, prompts of the largest bucket, the pool, the widest page
    table, every row at ``sampler_cfg``'s sampling rule: the rollout's programs): what a compile check lowers.
    With the fixed program set (``fixed_programs``) they are exactly the programs the engine runs, its inputs
    placed as here (``Engine``'s inputs), so that a run reads them from the persistent compilation cache.

    Args:
      params: the rollout's params, concrete or ``jax.ShapeDtypeStruct`` with shardings.
      backend: ``select_backend``'s choice.

    Returns:
      {"prefill": (jitted, args, kwargs), "decode": (jitted, args, kwargs)}: ``jitted.lower(*args, **kwargs)``.
    """
    backend = routing_backend(backend, cfg, sampler_cfg)
    fixed = fixed_programs(sampler_cfg, params)
    sc = program_config(sampler_cfg, fixed)
    G = program_group(sc, fixed, num_generations)
    S, P, V = sc.decode_slots(num_prompts * num_generations), sc.max_prompt_length, cfg.vocab_size
    N = fixed_prefill_prompts(S, G) if fixed else prefill_prompts(sc, num_prompts, G)
    pages = abstract_pool(params, cfg, sc, backend, pool_pages(sc, S))
    replicated = replicated_sharding(params, cfg)
    key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    key_impl = jax.config.jax_default_prng_impl  # read, not run: the default backend may be compile-only

    def spec(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    def rule(rows):  # the fixed set reads every row's sampling rule as data (``Engine``'s rules)
        dtypes = (jnp.float32, jnp.int32, jnp.float32)
        return (
            dict(zip(decode.RULE_FIELDS, (spec((rows,), d) for d in dtypes), strict=True)) if fixed else None
        )

    prefill_args = (
        params, pages, spec((N, P)), spec((N,)), spec((N, G, P)), spec((N * G, *key_data.shape), key_data.dtype),
        spec((N * G,)), rule(N * G),
    )  # fmt: skip
    prefill_kwargs = dict(
        cfg=cfg, sampler_cfg=sc, num_generations=G, backend=backend, plan=None, key_impl=key_impl
    )
    slots = {
        **{name: spec((S,)) for name in ("token", "n", "prompt_length", "rows", "num_forced", "forced_pos")},
        **{name: spec((S,)) for name in ("turn_end", "limit")},
        "active": spec((S,), bool),
        "pauses": spec((S,), bool),
        "key_data": spec((S, *key_data.shape), key_data.dtype),
        "page_table": spec((S, sc.pages_per_sequence())),
        "forced": spec((S, 1)),
    }
    prepared = params
    if backend.prepares_once:
        prepared = jax.eval_shape(
            prepare_decode, params, cfg, backend, sc.max_prompt_length + sc.max_completion_length
        )
    decode_args = (prepared, pages, slots, rule(S), spec((V,), bool), spec((V,), bool), spec(()))
    decode_kwargs = dict(
        cfg=cfg, sampler_cfg=sc, backend=backend, num_steps=sc.decode_steps_per_call, key_impl=key_impl
    )
    return {
        "prefill": (compiled_admit(backend), prefill_args, prefill_kwargs),
        "decode": (compiled_decode(backend), decode_args, decode_kwargs),
    }


def clear_compiled() -> None:
    """Drops every jitted program this module keeps for the process (a test's teardown frees their memory)."""
    compiled.cache_clear()
    compiled_zeros.cache_clear()
