"""Shared fixtures: a tiny random Llama with SmolLM2's real tokenizer, saved as a converted checkpoint; the
one lookup of the GSM8K copy that tests read."""

import json
import os
from pathlib import Path

# Tests and CI run on the CPU on purpose (CI has no accelerator; hardware=auto would pick one where attached):
# JAX_PLATFORMS=tpu python3 -m pytest ... runs them on a chip instead.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402 - after the platform is pinned
import pytest

from grpax.checkpoint.gguf import read_gguf
from grpax.checkpoint.orbax import save_params
from grpax.data.tokenizer import save_tokenizer
from grpax.models.params import init_params
from grpax.models.registry import get_model_config, to_hf_config

GSM8K_DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"

# Whether this CPU has AVX-512. XLA:CPU's float32 dots sum their terms in an order that depends on the vector
# width and on the row count: on AVX-512 CPUs (the Intel hosts the suite was written on, an AMD EPYC since) a
# row's logprobs did not depend on what else was multiplied with it and implementations agreed to 1e-5; on an
# AVX2 AMD EPYC the same tokens, with logprobs and logits further apart (each test names the difference it
# measured there). Tests keep their tight tolerance where this is true and take the measured one elsewhere.
CPU_HAS_AVX512 = Path("/proc/cpuinfo").is_file() and " avx512f" in Path("/proc/cpuinfo").read_text()


def gsm8k_dir() -> Path:
    """The GSM8K copy (train.jsonl, test.jsonl): $GRPAX_GSM8K_DIR, else <repo>/../shared/data/gsm8k.

    Fails the calling test (never skips it) when the files are not there, naming where it looked and the fix.
    """
    env = os.environ.get("GRPAX_GSM8K_DIR")
    folder = Path(env) if env else GSM8K_DEFAULT
    if not ((folder / "train.jsonl").is_file() and (folder / "test.jsonl").is_file()):
        where = f"GRPAX_GSM8K_DIR={env}" if env else f"{folder} (<repo>/../shared/data/gsm8k)"
        pytest.fail(
            f"GSM8K data not found: no train.jsonl and test.jsonl in {where}; "
            "set GRPAX_GSM8K_DIR=<folder holding them>",
            pytrace=False,
        )
    return folder


def tiny_run_keys(ckpt, out, **overrides) -> dict:
    """train_rl keys of a seconds-long run of ``tiny_checkpoint`` on the real GSM8K files (``gsm8k_dir``, looked
    up only when ``dataset_name`` is not among ``overrides``)."""
    keys = dict(
        model_name="",
        load_parameters_path=str(ckpt),
        base_output_directory=str(out),
        run_name="run",
        batch_size=2,
        num_generations=2,
        num_batches=3,
        max_target_length=272,
        num_test_batches=1,
        eval_batch_size=2,
        eval_before=False,
        checkpoint_period=2,
        learning_rate=1e-3,
        warmup_ratio=0.25,
        beta=0.04,
    )
    keys.update(overrides)
    if "dataset_name" not in keys:
        keys["dataset_name"] = str(gsm8k_dir())
    return keys


def kill_at_call(monkeypatch, n: int):
    """Makes the trainer's ``_one_step`` raise KeyboardInterrupt at its ``n``-th call (a Ctrl-C during that
    step); returns the real one, to put back before the run is started again."""
    from grpax.rl import trainer

    real_step, calls = trainer._one_step, {"n": 0}

    def dying_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "_one_step", dying_step)
    return real_step


def tiny_smollm2_config():
    """A 2-layer random model's config with SmolLM2's vocabulary (hidden 32, 2 heads, 1 kv head, mlp 64)."""
    return get_model_config(
        "smollm2-135m-Instruct",
        hidden_dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
    )


@pytest.fixture
def prefill_counts(monkeypatch) -> list[int]:
    """The prompt count N of every prefill call (``admit``'s prompts [N, P]) the engine makes during the test."""
    import grpax.sampler.engine as engine_module

    seen: list[int] = []
    compiled_admit = engine_module.compiled_admit

    def spy(backend):
        fn = compiled_admit(backend)

        def call(*args, **kwargs):
            seen.append(args[2].shape[0])
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(engine_module, "compiled_admit", spy)
    return seen


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer random model with SmolLM2's vocabulary and tokenizer, converted layout: <dir>/0/items."""
    folder = tmp_path_factory.mktemp("tiny")
    cfg = tiny_smollm2_config()
    save_params(init_params(cfg, jax.random.key(0)), folder / "0" / "items")
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
    save_tokenizer(read_gguf().tokenizer(), folder)
    return folder / "0" / "items"


# XLA:CPU maps each compiled kernel's code and data as their own memory mappings while its executable lives, and
# jitted functions cached for the process (``grpax.sampler.program_set.compiled``, JAX's own caches) keep every program
# a test compiled. Over the suite that passed Linux's limit of 65,530 mappings per process (``vm.max_map_count``),
# where LLVM's allocation failed and the next compile crashed the run with a segmentation fault (CI, at the 581st
# test; tests/test_engine.py alone reaches 45,000). Past FREE_AT mappings a test's teardown frees the compiled
# programs (as the end of every file does); past FAIL_AT after that it fails with the cause named instead of a
# crash later.
FREE_AT, FAIL_AT = 20_000, 50_000


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def free_compiled_programs() -> None:
    """Drops every compiled program of this process (the engine's jitted functions and JAX's caches)."""
    import gc

    from grpax.sampler import program_set

    program_set.clear_compiled()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _free_each_files_programs():
    """After each test file (so that a file that keeps a server thread running starts with few mappings)."""
    yield
    free_compiled_programs()


@pytest.fixture(autouse=True)
def _mappings_below_the_limit():
    yield
    if not os.path.exists("/proc/self/maps") or _mappings() <= FREE_AT:
        return
    free_compiled_programs()
    count = _mappings()
    if count > FAIL_AT:
        pytest.fail(
            f"{count} memory mappings in the test process after freeing the compiled programs (Linux's limit is "
            "vm.max_map_count, 65,530 by default): find what still holds them (jax.live_arrays, a cached jit)"
        )


# The session's exit status, kept for ``pytest_unconfigure``.
_EXIT_STATUS = [0]


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS[0] = int(exitstatus)


def pytest_unconfigure(config):
    """Leaves with pytest's own exit status once its summary is written, skipping the interpreter's teardown: a
    daemon thread still inside XLA or libtpu C++ code when Python finalises aborts the process ("terminate called
    ... exception not rethrown", seen once after a run of 270 passing tests), which would turn a green run red.
    The cause is not yet found (noted in the closing note)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[0])
