"""The engine's fixed program set (``SamplerConfig.programs``, the accelerators' default): the same tokens as the
adaptive ladders, one decode program for every slot count, length and sampling rule, and exactly the programs
``abstract_programs`` names (the compile check's), read back from the persistent compilation cache."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import CPU_HAS_AVX512, tiny_run_keys
from jax._src import compilation_cache

from grpax.compiles import CompileLog
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.train_config import TrainConfig
from grpax.rl.trainer import train
from grpax.sampler.engine import Engine, generate
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.program_set import abstract_programs, fixed_programs

CFG = ModelConfig(
    vocab_size=61, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
    rope_theta=10000.0,
)  # fmt: skip
PROMPTS = [[5, 9, 11, 3, 7, 21, 30] * 10, [1, 2], [40, 41, 42, 43, 44], [17] * 70]
G = 3
STOPS = (3, 7, 12, 20, 33, 50)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)  # peaked, varied distributions


def _sc(**kw) -> SamplerConfig:
    base = dict(
        max_prompt_length=128, max_completion_length=40, temperature=0.9, pad_token_id=0, backend="xla"
    )
    return SamplerConfig(**{**base, **kw})


def test_auto_is_fixed_on_accelerators_and_adaptive_on_cpu(params):
    assert not fixed_programs(_sc(), params)  # this host's CPU
    assert fixed_programs(_sc(programs="fixed"), params) and not fixed_programs(
        _sc(programs="adaptive"), params
    )
    with pytest.raises(ValueError, match="programs='some': expected one of"):
        _sc(programs="some")


@pytest.mark.parametrize("max_num_seqs", [0, 5])
def test_fixed_set_samples_the_adaptive_ladders_tokens(params, max_num_seqs):
    """Rows stop at different lengths (STOPS), slots free and refill (max_num_seqs=5 < 12 sequences): the
    fixed set decodes every call on all slots and the whole page table, with rules as data; each row's tokens
    are the ladders'."""
    sc = _sc(stop_token_ids=STOPS, max_num_seqs=max_num_seqs)
    key = jax.random.key(7)
    adaptive = generate(params, PROMPTS, CFG, dataclasses.replace(sc, programs="adaptive"), key, G)
    fixed = generate(params, PROMPTS, CFG, dataclasses.replace(sc, programs="fixed"), key, G)
    assert len(set(adaptive.lengths.tolist())) > 3  # rows really end at different steps
    np.testing.assert_array_equal(fixed.completion_ids, adaptive.completion_ids)
    np.testing.assert_array_equal(fixed.completion_mask, adaptive.completion_mask)
    # The ladders retire rows: their decode calls multiply fewer rows than the fixed set's, and XLA:CPU's dot
    # rounds a product of other row counts differently: under 2e-5 on AVX-512 CPUs, 4.0e-5 of a logprob of -3.16
    # on an AVX2 AMD EPYC (conftest.CPU_HAS_AVX512): float32 rounding relative to the value there. With the same
    # row counts (retire_rows=false) the two agree to 2e-6 (below).
    rtol = 0 if CPU_HAS_AVX512 else 2e-5
    np.testing.assert_allclose(fixed.logprobs, adaptive.logprobs, rtol=rtol, atol=2e-5)
    same_rows = dataclasses.replace(sc, programs="adaptive", retire_rows=False)
    np.testing.assert_allclose(
        fixed.logprobs, generate(params, PROMPTS, CFG, same_rows, key, G).logprobs, atol=2e-6
    )


def test_fixed_set_runs_the_programs_abstract_programs_names_and_no_other(params):
    """The compile check's programs (abstract_programs, compiled ahead of time, in the run's process) are the
    engine's: the rollout and an evaluation (greedy, one completion per prompt, as many rows) over new prompt
    lengths obtain no other prefill or decode. The adaptive ladders, as a control, compile their own."""
    sc = _sc(stop_token_ids=STOPS, programs="fixed")
    placed = jax.device_put(params, jax.devices()[0])
    with CompileLog() as log:
        with log.phase("ahead"):
            backend = Engine(placed, CFG, sc, num_slots=4 * G).backend
            rollout = abstract_programs(placed, CFG, sc, backend, 4, G)
            eval_prefill = abstract_programs(placed, CFG, sc, backend, 4 * G, 1)["prefill"]
            for fn, args, kwargs in (*rollout.values(), eval_prefill):
                fn.lower(*args, **kwargs).compile()
        with log.phase("run"):
            engine = Engine(placed, CFG, sc, num_slots=4 * G)
            engine.run(engine.submit(PROMPTS, jax.random.key(0), num_generations=G))
            greedy = [[9] * 100, [4, 5], [6] * 33, [2] * 10] * 3  # 12 prompts, G = 1: the rollout's 12 slots
            evaluation = Engine(placed, CFG, dataclasses.replace(sc, greedy=True), num_slots=len(greedy))
            evaluation.run(evaluation.submit(greedy, jax.random.key(1)))
        with log.phase("control"):
            adaptive = Engine(placed, CFG, dataclasses.replace(sc, programs="adaptive"), num_slots=4 * G)
            adaptive.run(adaptive.submit(PROMPTS, jax.random.key(0), num_generations=G))
    ahead = sorted(p.name for p in log.programs if p.phase == "ahead" and p.name in ("admit", "decode"))
    assert ahead == ["admit", "admit", "decode"]
    assert engine.stats["prefills"] and engine.stats["calls"] >= 3 and evaluation.stats["calls"] >= 3
    assert [p for p in log.programs if p.phase == "run" and p.name in ("admit", "decode")] == []
    control = [p.name for p in log.programs if p.phase == "control"]
    assert control.count("decode") >= 2 and "admit" in control


def test_with_prefill_group_an_evaluation_runs_the_rollouts_prefill(params):
    """prefill_group = G (a GRPO run's): an evaluation of one completion per prompt over as many rows as the
    rollout obtains no program beyond the rollout's two (its prompts prefilled G rows apart, in calls of the
    rollout's prompt count), with the tokens of its own program; abstract_programs names the same program."""
    sc = _sc(stop_token_ids=STOPS, programs="fixed", prefill_group=G)
    placed = jax.device_put(params, jax.devices()[0])
    greedy = [[9] * 100, [4, 5], [6] * 33, [2] * 10] * 3  # 12 prompts, G = 1: the rollout's 12 slots
    own = generate(
        placed, greedy, CFG, dataclasses.replace(sc, greedy=True, prefill_group=0), jax.random.key(1)
    )
    with CompileLog() as log:
        with log.phase("ahead"):
            backend = Engine(placed, CFG, sc, num_slots=4 * G).backend
            rollout = abstract_programs(placed, CFG, sc, backend, 4, G)
            evaluation = abstract_programs(placed, CFG, sc, backend, 4 * G, 1)
            for fn, args, kwargs in rollout.values():
                fn.lower(*args, **kwargs).compile()
        with log.phase("run"):
            engine = Engine(placed, CFG, sc, num_slots=4 * G)
            engine.run(engine.submit(PROMPTS, jax.random.key(0), num_generations=G))
            out = generate(placed, greedy, CFG, dataclasses.replace(sc, greedy=True), jax.random.key(1))
    assert [p for p in log.programs if p.phase == "run" and p.name in ("admit", "decode")] == []
    assert jax.tree.leaves(evaluation["prefill"][1]) == jax.tree.leaves(rollout["prefill"][1])
    np.testing.assert_array_equal(out.completion_ids, own.completion_ids)
    np.testing.assert_array_equal(out.completion_mask, own.completion_mask)
    np.testing.assert_allclose(out.logprobs, own.logprobs, atol=2e-5)


def test_a_short_grpo_run_of_the_fixed_set_compiles_nothing_after_its_first_step(tiny_checkpoint, tmp_path):
    """The guard: from step 2 on, and in the evaluation after, nothing is compiled; the evaluation before ran the
    rollout's decode program (sampling as data), so step 1 compiles no decode of its own. Each step's metrics
    and the results give the compiles per phase. The fixed set runs XLA's ops on CPU too (the CPU kernels'
    prefill picks its own plan per prompt lengths)."""
    keys = tiny_run_keys(
        tiny_checkpoint, tmp_path, sampler_programs="fixed", num_batches=3, eval_before=True, num_test_batches=2,
        eval_batch_size=4, num_generations=2, batch_size=2,
    )  # fmt: skip
    # no persistent cache (an earlier test's CLI run may have opened one): its programs would be read, not compiled
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    try:
        with CompileLog() as log:
            result = train(TrainConfig(**keys))
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)
        compilation_cache.reset_cache()
    names = [p.name for p in log.programs]
    # the evaluation's prefills (4 questions, one pass) run the rollout's program (2 prompts x G = 2)
    assert names.count("admit") == 1 and names.count("decode") == 1, names
    # keys made on the host, the step counter from numpy, the update's flags reduced on the host: no small
    # eager programs beside the run's own
    eager = ("stage", "_threefry_seed", "_threefry_fold_in", "convert_element_type", "_reduce_any")
    assert not [n for n in names if n in eager], names
    compiles = result["compiles"]
    assert compiles["step 1"]["compiled"] > 0 and compiles["eval before"]["compiled"] > 0
    for phase in ("step 2", "step 3", "eval after"):
        assert compiles.get(phase, {"compiled": 0})["compiled"] == 0, (phase, compiles)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in metrics if "compile/compiled" in m}
    assert (
        by_step[1]["compile/compiled"] > 0
        and by_step[2]["compile/compiled"] == by_step[3]["compile/compiled"] == 0
    )


def test_the_runs_programs_are_named_before_it_runs():
    """train_rl logs the sampler's programs derived from the keys (the fixed set's shapes: what the fit check
    compiles; an evaluation of as many rows runs the rollout's decode)."""
    from grpax.sampler.program_set import describe_programs

    sc = SamplerConfig(max_prompt_length=256, max_completion_length=192)
    assert describe_programs(sc, True, {"rollout": (4, 4), "evaluation": (16, 1)}) == (
        "fixed: rollout: prefill 4 prompts x 256 tokens (G = 4), decode 16 slots x 14 pages x 16 steps; "
        "evaluation: prefill 16 prompts x 256 tokens (G = 1), the same decode"
    )
    # a GRPO run's (prefill_group = G): the evaluation's prefills run the rollout's program
    grouped = dataclasses.replace(sc, prefill_group=4)
    assert describe_programs(grouped, True, {"rollout": (4, 4), "evaluation": (16, 1)}) == (
        "fixed: rollout: prefill 4 prompts x 256 tokens (G = 4), decode 16 slots x 14 pages x 16 steps; "
        "evaluation: the same prefill, the same decode"
    )
    adaptive = describe_programs(sc, False, {"rollout": (4, 4), "evaluation": (8, 1)})
    assert "8 slots: [8, 6, 4, 2, 1]; 16 slots: [16, 14, 12, 10, 8, 6, 4, 2, 1]" in adaptive
    assert "prompt buckets [64, 128, 192, 256]" in adaptive


def test_the_programs_named_follow_the_keys_that_change_them():
    """retire_rows=false decodes on one slot count, decode_phase_length=0 on the whole page table, and the fixed
    set pads prompts to prompt_length_buckets where they are given: the line says so."""
    from grpax.sampler.program_set import describe_programs

    sc = SamplerConfig(
        max_prompt_length=256, max_completion_length=192, retire_rows=False, decode_phase_length=0
    )
    adaptive = describe_programs(sc, False, {"rollout": (4, 4)})
    assert "(16 slots: [16])" in adaptive and "the whole page table" in adaptive
    bucketed = dataclasses.replace(sc, prompt_length_buckets=(64, 128))
    assert "prefill 4 prompts x [64, 128, 256] tokens (G = 4)" in describe_programs(
        bucketed, True, {"rollout": (4, 4)}
    )
