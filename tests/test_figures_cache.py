"""grpax.plan.figures_cache: a second fit check of the same program takes its figures from the cache folder and
compiles nothing; another program, other devices or no cache folder compile."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from grpax.compiles import CompileLog
from grpax.plan import compile_check, figures_cache


@pytest.fixture
def cache_dir(tmp_path):
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    yield tmp_path / "jax"
    jax.config.update("jax_compilation_cache_dir", saved)


def _args(n):
    return (jax.ShapeDtypeStruct((n, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))


@jax.jit
def _matmul(x, w):
    return jnp.tanh(x @ w).sum(axis=0)


def test_the_same_program_is_not_compiled_twice(cache_dir):
    with CompileLog() as first:
        c1, exe = compile_check._compile("a matmul", 1, _matmul, *_args(16))
    assert exe is not None and [p.name for p in first.programs] == ["_matmul"]
    assert len(list((cache_dir / figures_cache.FOLDER).glob("*.json"))) == 1
    with CompileLog() as second:
        c2, exe2 = compile_check._compile("the matmul again", 1, _matmul, *_args(16))
    assert exe2 is None and second.programs == []
    assert c2.name == "the matmul again"
    same = ("arguments", "outputs", "aliased", "temporaries", "over_hbm", "collectives")
    assert {f: getattr(c2, f) for f in same} == {f: getattr(c1, f) for f in same}
    assert c1.arguments == (16 * 64 + 64 * 32) * 4  # the real figures were kept
    with CompileLog() as other:  # another shape: another program
        c3, _ = compile_check._compile("a larger matmul", 1, _matmul, *_args(32))
    assert [p.name for p in other.programs] == ["_matmul"] and c3.arguments > c1.arguments


def test_other_devices_make_another_key():
    lowered = _matmul.lower(*_args(16))
    cpu = jax.devices()

    @dataclasses.dataclass
    class Fake:
        platform: str = "tpu"
        device_kind: str = "TPU v5 lite"

    assert figures_cache.program_key(lowered, cpu) == figures_cache.program_key(lowered, cpu)
    assert figures_cache.program_key(lowered, cpu) != figures_cache.program_key(lowered, [Fake()])


def test_no_cache_folder_keeps_nothing_and_a_damaged_file_is_ignored(cache_dir):
    key = figures_cache.program_key(_matmul.lower(*_args(8)), jax.devices())
    (cache_dir / figures_cache.FOLDER).mkdir(parents=True)
    (cache_dir / figures_cache.FOLDER / f"{key}.json").write_text("{not json")
    assert figures_cache.read(key) is None
    jax.config.update("jax_compilation_cache_dir", None)
    with CompileLog() as log:
        compile_check._compile("uncached", 1, _matmul, *_args(8))
    assert [p.name for p in log.programs] == ["_matmul"]
    assert figures_cache.read(key) is None
