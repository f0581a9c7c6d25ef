"""``training_compile_effort``: XLA's run-time effort of the update and the logprob passes.

A short run on a TPU (the README's job: its updates a few TFLOP) spends most of its wall time compiling: at half
XLA's effort on run time the update compiles 2-3x faster and runs 1.5-2x longer (docs/benchmarks.md). ``auto`` picks that effort for
such a run and only there; the sampler's programs keep the compiler's defaults (the rollout's tokens as before).
"""

import jax
import pytest
from conftest import tiny_run_keys

from grpax.config import ConfigError, build_config
from grpax.models.registry import ModelConfig, get_model_config
from grpax.rl import train_step, trainer
from grpax.rl.train_config import LOW_EFFORT_OPTIONS, SHORT_RUN_FLOPS, TrainConfig, validate

SMOLLM2 = get_model_config("smollm2-135m-Instruct")
# scripts/demo.sh's shape: 4 prompts x 4 completions of up to 448 tokens, 6 steps
DEMO = ["model_name=", "batch_size=4", "num_generations=4", "max_target_length=448", "num_batches=6"]
# what low gives with this JAX (a JAX without the float efforts, e.g. jax 0.11: no option, the compiler's default)
LOW = LOW_EFFORT_OPTIONS


def _options(keys, platform="tpu", chips=1, model=SMOLLM2):
    return build_config(TrainConfig, keys).training_compile_options(model, platform, chips)


def test_auto_is_the_low_effort_for_a_short_run_on_a_tpu_only():
    # the demo's updates: 6 x 134.5M params x (16 rows x 448 tokens) x 6 steps = 0.035 PFLOP, under 1 PFLOP
    assert 6 * SMOLLM2.num_params() * 16 * 448 * 6 < SHORT_RUN_FLOPS
    assert _options(DEMO) == LOW
    assert _options(DEMO, "cpu") == () and _options(DEMO, "gpu") == ()
    # 1 PFLOP: 6 * N * 7168 tokens * steps >= 1e15 from this many steps on
    steps = int(SHORT_RUN_FLOPS // (6 * SMOLLM2.num_params() * 16 * 448)) + 1
    longer = [*DEMO[:-1], f"num_batches={steps}"]
    assert _options(longer) == ()
    assert _options(longer, chips=2) == LOW  # per chip: half of it each
    assert _options([*longer, "num_iterations=2"], chips=2) == ()
    # explicit: the same on every platform
    assert _options([*DEMO, "training_compile_effort=full"]) == ()
    assert _options([*longer, "training_compile_effort=low"], "cpu") == LOW


def test_an_unknown_effort_is_refused_in_one_line():
    cfg = build_config(TrainConfig, [*DEMO, "load_parameters_path=x", "training_compile_effort=fast"])
    with pytest.raises(
        ConfigError, match=r"^training_compile_effort='fast': expected one of auto, full, low\. Did you mean"
    ):
        validate(cfg)


@pytest.mark.slow  # libtpu compiles the tiny job three times: about 20 s on 2 cores
def test_the_effort_compiles_other_training_programs_and_the_same_sampler(monkeypatch):
    """Compiled for a TPU v5e with libtpu's compiler (no TPU needed): at low effort the update and the reference
    pass are other programs (their temporaries differ), the prefill and decode the same; auto is low here."""
    pytest.importorskip("libtpu", reason="the tpu extra brings libtpu; CI installs it")
    if not LOW:
        pytest.skip(f"jax {jax.__version__} has no float efforts: low is the compiler's default")
    from grpax.plan import figures_cache
    from grpax.plan.compile_check import compile_job
    from grpax.plan.topology import get_topology

    monkeypatch.setattr(figures_cache, "read", lambda key: None)
    model = ModelConfig(
        vocab_size=512, hidden_dim=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=256,
        eos_token_ids=(1,),
    )  # fmt: skip
    devices = list(get_topology("v5e-1").devices)
    keys = ["model_name=", "batch_size=2", "num_generations=2", "max_prefill_predict_length=8",
            "max_target_length=24", "beta=0.04"]  # fmt: skip
    temps = {}
    for effort in ("full", "low", "auto"):
        cfg = build_config(TrainConfig, [*keys, f"training_compile_effort={effort}"])
        report = compile_job(cfg, devices, "v5e", 16 * 2**30, None, None, model_cfg=model)
        temps[effort] = {name: c.temporaries for name, c in report.functions.items()}
    full, low = temps["full"], temps["low"]
    assert full["update"] != low["update"] and full["reference logprobs"] != low["reference logprobs"]
    assert (full["prefill"], full["decode"]) == (low["prefill"], low["decode"])
    assert temps["auto"] == low


def test_the_run_compiles_its_update_and_logprob_passes_with_the_options(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """training_compile_effort=low on this CPU: the trainer builds its update and its reference pass with the
    options (XLA:CPU takes them) and the run trains."""
    built, programs = [], []
    make_run_update, logprobs_program = trainer.make_run_update, train_step.logprobs_program

    def spy_update(*args, **kwargs):
        built.append(kwargs["compiler_options"])
        return make_run_update(*args, **kwargs)

    def spy_program(options=()):
        programs.append(options)
        return logprobs_program(options)

    monkeypatch.setattr(trainer, "make_run_update", spy_update)
    monkeypatch.setattr(train_step, "logprobs_program", spy_program)
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, num_batches=1, num_test_batches=0)
    result = trainer.train(TrainConfig(**keys, training_compile_effort="low"))
    assert built == [LOW] and programs and set(programs) == {LOW}
    assert len(result["reward_history"]) == 1
