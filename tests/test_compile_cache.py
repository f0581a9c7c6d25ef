"""JAX's persistent compilation cache (``jax_cache_dir``), XLA's optimization level (``xla_optimization_level``)
and compiling the GRPO update once per run.

The key's folder by default, moved, and off; every command that compiles sets it before its first compilation;
a second process finds the first one's programs on disk; the update compiled by the pre-run fit check
(``compile_check.compile_job``) is a cache hit when the trainer calls it, and the trainer's update is one
program over two steps (its step counter placed as the update returns it).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache, monitoring

from grpax import sharding
from grpax.cli.common import compilation_cache_dir, enable_compilation_cache, set_optimization_level
from grpax.cli.main import main
from grpax.config import build_config
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.plan.compile_check import compile_job
from grpax.rl.batch import Batch
from grpax.rl.train_config import TrainConfig
from grpax.rl.trainer import _init_state
from grpax.sharding import mesh_context

TINY = ModelConfig(
    vocab_size=256, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
    eos_token_ids=(1,),
)  # fmt: skip
HITS, MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


@pytest.fixture
def jax_cache():
    """Restores JAX's cache settings after the test (and forgets the folder JAX opened)."""
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    compilation_cache.reset_cache()


@pytest.fixture
def events():
    """Names of the JAX monitoring events recorded during the test."""
    seen: list[str] = []
    listener = lambda name, **kwargs: seen.append(name)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    yield seen
    monitoring.unregister_event_listener(listener)


def test_cache_folder_default_key_and_off(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache_dir("auto") == str(tmp_path / "xdg" / "grpax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache_dir("auto") == str(tmp_path / "home" / ".cache" / "grpax" / "jax")
    assert compilation_cache_dir("~/elsewhere") == str(tmp_path / "home" / "elsewhere")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/from/env")  # JAX's own variable wins over auto only
    assert compilation_cache_dir("auto") == "/from/env"
    assert compilation_cache_dir("/moved") == "/moved"
    assert compilation_cache_dir("") is None


@pytest.mark.parametrize("command", ["generate", "evaluate", "train_rl"])
def test_commands_set_the_cache_before_they_run(command, monkeypatch, tmp_path, jax_cache):
    """Each compiling command sets the folder (default, moved, off) before its run: here the run itself fails
    at once (no checkpoint), after the cache was set."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    keys = [command, "hardware=cpu", f"load_parameters_path={tmp_path / 'missing'}"]
    assert main(keys) == 2
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xdg" / "grpax" / "jax")
    assert (tmp_path / "xdg" / "grpax" / "jax").is_dir()
    assert main([*keys, f"jax_cache_dir={tmp_path / 'moved'}"]) == 2
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "moved")
    assert main([*keys, "jax_cache_dir="]) == 2
    assert jax.config.jax_compilation_cache_dir is None


@pytest.fixture
def optimization_level():
    """Restores JAX's optimization level after the test (the key sets it for the whole process)."""
    before = jax.config.jax_optimization_level
    yield
    jax.config.update("jax_optimization_level", before)
    jax.clear_caches()


@pytest.mark.parametrize("command", ["generate", "evaluate", "train_rl", "serve"])
def test_commands_set_the_optimization_level_before_they_run(command, tmp_path, optimization_level, capsys):
    """Each compiling command sets XLA's level from its key before its run (here the run fails at once: no
    checkpoint); auto leaves JAX's own; a value that is no level is refused in one line naming the key."""
    keys = [command, "hardware=cpu", "jax_cache_dir=", f"load_parameters_path={tmp_path / 'missing'}"]
    jax.config.update("jax_optimization_level", "O2")  # as $JAX_OPTIMIZATION_LEVEL would: auto keeps it
    assert main(keys) == 2
    assert jax.config.jax_optimization_level == "O2"
    assert main([*keys, "xla_optimization_level=O1"]) == 2
    assert jax.config.jax_optimization_level == "O1"
    capsys.readouterr()
    assert main([*keys, "xla_optimization_level=fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "xla_optimization_level='fast'" in err and "O0, O1, O2, O3" in err


def test_the_level_reaches_the_compiler_and_the_kept_figures(optimization_level):
    """A program compiled for a TPU v5e (libtpu's compiler, no TPU needed) at O0 is another program than at the
    compiler's default: its temporaries and its text differ; the fit check's kept figures are keyed apart."""
    pytest.importorskip("libtpu", reason="the tpu extra brings libtpu; CI installs it")
    from grpax.plan import figures_cache
    from grpax.plan.topology import get_topology

    devices = list(get_topology("v5e-1").devices)
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("x",)), jax.sharding.PartitionSpec())

    def loss(w, x):  # a scanned tanh MLP's squared norm: its gradient keeps activations for the backward
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi) * 1.5 + h, None), x, w)
        return jnp.sum(h**2)

    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=replicated) for s in ((4, 256, 256), (64, 256))]
    grad = jax.jit(jax.grad(loss))
    compiled, keys = {}, {}
    for level in ("auto", "O0"):
        set_optimization_level(level)
        jax.clear_caches()
        lowered = grad.lower(*args)
        keys[level] = figures_cache.program_key(lowered, devices)
        compiled[level] = lowered.compile()
    assert compiled["O0"].as_text() != compiled["auto"].as_text()
    temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temps["O0"] != temps["auto"], temps
    assert keys["O0"] != keys["auto"]
    effort = getattr(jax.config, "jax_exec_time_optimization_effort", None)
    if effort is not None:  # JAX's other effort setting (this JAX has it): keyed apart too
        jax.config.update("jax_exec_time_optimization_effort", -1.0)
        try:
            assert figures_cache.program_key(grad.lower(*args), devices) != keys["O0"]
        finally:
            jax.config.update("jax_exec_time_optimization_effort", effort)


def test_an_unwritable_folder_turns_the_cache_off(tmp_path, jax_cache, caplog):
    (tmp_path / "file").write_text("")
    assert enable_compilation_cache(str(tmp_path / "file" / "jax")) is None
    assert jax.config.jax_compilation_cache_dir is None
    assert "no compilation cache" in caplog.text


_PROGRAM = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    from grpax.cli.common import enable_compilation_cache
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    enable_compilation_cache(sys.argv[1])
    def f(x):
        for _ in range(20):
            x = jnp.tanh(x @ x.T) + jnp.sin(x)
        return x.sum()
    start = time.perf_counter()
    jax.jit(f).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile()
    print(events.count("/jax/compilation_cache/cache_hits"), events.count("/jax/compilation_cache/cache_misses"),
          time.perf_counter() - start)
    """
)


def _run(folder: str, cwd: Path) -> tuple[int, int, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, folder], capture_output=True, text=True, check=True, cwd=cwd
    )
    hits, misses, seconds = out.stdout.split()
    return int(hits), int(misses), float(seconds)


def test_a_second_process_finds_the_first_ones_programs(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    folder = tmp_path / "cache"
    assert _run(str(folder), repo)[:2] == (0, 1)
    written = sorted(p.name for p in folder.iterdir())
    assert written  # the program, on disk
    assert _run(str(folder), repo)[:2] == (1, 0)  # read back: no compilation
    assert sorted(p.name for p in folder.iterdir()) == written
    assert _run("", repo)[:2] == (0, 0)  # off: the cache is not consulted


def _job():
    cfg = build_config(
        TrainConfig,
        ["model_name=", "batch_size=2", "num_generations=2", "max_prefill_predict_length=8",
         "max_target_length=24", "beta=0.04", "num_batches=3"],
    )  # fmt: skip
    mesh = sharding.create_mesh(cfg.mesh(), jax.devices())
    shardings = sharding.param_shardings(TINY, mesh)
    params = jax.jit(lambda k: init_params(TINY, k), out_shardings=shardings)(jax.random.key(0))
    rng = np.random.default_rng(0)
    P, B, Lp, C = 2, 4, 8, 16
    batch = Batch(
        prompt_ids=rng.integers(2, 256, (P, Lp), dtype=np.int32),
        prompt_mask=np.ones((P, Lp), np.int32),
        completion_ids=rng.integers(2, 256, (B, C), dtype=np.int32),
        completion_mask=np.ones((B, C), np.int32),
        advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32),
        rollout_logprobs=np.full((B, C), -5.0, np.float32),
        truncated=np.zeros((B,), bool),
        ref_logprobs=np.full((B, C), -5.0, np.float32),
    )
    return cfg, mesh, params, sharding.shard_global_batch(batch, mesh)  # as the rollout places it


@pytest.mark.slow  # compiles the whole job (update, reference, prefill, decode): about a minute on 2 cores
def test_the_runs_update_is_the_fit_checks_executable(tmp_path, jax_cache, events):
    """``compile_job`` (the pre-run fit check) compiles the update from abstract arrays; the trainer's first
    update of the same job then calls that executable (the same jitted function, ``make_run_update``): no
    compile, and no read of the persistent cache either; its second update runs the same program."""
    from grpax.compiles import CompileLog

    cfg, mesh, params, batch = _job()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    enable_compilation_cache(str(tmp_path / "cache"))
    compile_job(cfg, jax.devices(), "cpu", 2**40, None, None, model_cfg=TINY)
    state, train_step = _init_state(cfg, cfg.grpo(), params, TINY, mesh)
    events.clear()
    with CompileLog() as log, mesh_context(mesh):
        state, _ = train_step(state, batch)
        jax.block_until_ready(state)
        assert (events.count(HITS), events.count(MISSES)) == (0, 0)
        state, metrics = train_step(state, batch)
    assert "step" not in [p.name for p in log.programs], log.programs
    assert not bool(metrics["nonfinite"])
    # One program for every step: an unplaced step counter (jnp.zeros) compiled the update again at step 2.
    assert train_step._cache_size() == 1


def test_the_runs_fit_check_compiles_the_evaluations_programs_too(monkeypatch):
    """``compile_job(evaluation=True)`` (the run's own check) compiles the sampler's and the evaluation's
    programs besides the update and the reference pass, with the same memory table: with the fixed program set
    the evaluation's prefill (one completion per question) and its decode are the rollout's (prefill_group = G),
    compiled once. (The figures cache is off here: with it the second check would compile nothing at all.)"""
    from grpax.compiles import CompileLog
    from grpax.plan import figures_cache

    monkeypatch.setattr(figures_cache, "read", lambda key: None)

    cfg = build_config(
        TrainConfig,
        ["model_name=", "batch_size=2", "num_generations=2", "max_prefill_predict_length=8",
         "max_target_length=24", "beta=0.04", "eval_batch_size=4", "sampler_programs=fixed"],
    )  # fmt: skip
    with CompileLog() as log:
        with log.phase("job"):
            job = compile_job(cfg, jax.devices(), "cpu", 2**40, None, None, model_cfg=TINY)
        jax.clear_caches()
        with log.phase("run's check"):
            run = compile_job(cfg, jax.devices(), "cpu", 2**40, None, None, model_cfg=TINY, evaluation=True)
    assert list(run.functions) == list(job.functions) == ["update", "reference logprobs", "prefill", "decode"]
    assert run.phases == job.phases
    names = [p.name for p in log.programs if p.phase == "run's check"]
    assert names.count("admit") == 1 and names.count("decode") == 1 and names.count("step") == 1
