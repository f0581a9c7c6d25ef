"""grpax.prng: host-made keys equal jax.random's bit for bit, and make no program."""

import jax
import numpy as np
import pytest

from grpax import prng
from grpax.compiles import CompileLog

SEEDS = [0, 1, 42, 2**31 - 1, -1, -5, 2**32 - 1]
DATA = [0, 1, 7, 2**31, 2**32 - 1, 123456789]


def _data(k):
    return np.asarray(jax.random.key_data(k))


@pytest.mark.parametrize("seed", SEEDS)
def test_key_and_fold_in_equal_jax_random(seed):
    np.testing.assert_array_equal(_data(prng.key(seed)), _data(jax.random.key(seed)))
    for d in DATA:
        np.testing.assert_array_equal(
            _data(prng.fold_in(prng.key(seed), d)), _data(jax.random.fold_in(jax.random.key(seed), d))
        )
    # a key folded twice, and a key made by jax.random folded here
    twice = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 3), 11)
    np.testing.assert_array_equal(
        _data(prng.fold_in(prng.fold_in(jax.random.key(seed), 3), 11)), _data(twice)
    )


def test_the_same_draws_as_jax_keys():
    ours, theirs = prng.fold_in(prng.key(7), 2), jax.random.fold_in(jax.random.key(7), 2)
    np.testing.assert_array_equal(jax.random.uniform(ours, (5,)), jax.random.uniform(theirs, (5,)))


def test_no_program_is_compiled():
    with CompileLog() as programs:
        k = prng.key(123)
        for step in range(3):
            prng.fold_in(k, step)
    assert programs.programs == []


def test_out_of_range_refused():
    with pytest.raises(ValueError, match="data=-1"):
        prng.fold_in(prng.key(0), -1)
    with pytest.raises(ValueError, match="seed=4294967296"):
        prng.key(2**32)
