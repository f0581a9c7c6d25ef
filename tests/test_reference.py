"""FrozenParams: the reference params mapped from files give the same values as held in memory."""

import jax
import jax.numpy as jnp
import numpy as np

from grpax.rl.reference import FrozenParams, offload_folder


def _tree():
    rng = np.random.default_rng(0)
    return {
        "embed": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
        "layers": {"w": jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.bfloat16)},
        "scale": jnp.asarray(1.5, jnp.float32),
    }


def _fn(params, x):
    return (x @ params["embed"].T).sum() + params["layers"]["w"].astype(jnp.float32).sum() * params["scale"]


def test_mapped_params_equal_the_tree_and_their_folder_goes_on_close(tmp_path):
    tree = _tree()
    x = jnp.arange(3, dtype=jnp.float32)
    mapped = FrozenParams(tree, tmp_path / "ref")
    assert sorted(p.name for p in (tmp_path / "ref").iterdir()) == ["0.npy", "1.npy", "2.npy"]
    seen = mapped.apply(lambda p, x: jax.tree.map(lambda a: a, p), x)  # the leaves as the function gets them
    for got, want in zip(jax.tree.leaves(seen), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert float(mapped.apply(_fn, x)) == float(FrozenParams(tree).apply(_fn, x)) == float(_fn(tree, x))
    mapped.close()
    assert not (tmp_path / "ref").exists()


def test_a_killed_runs_folder_is_emptied_first(tmp_path):
    stale = tmp_path / "ref"
    stale.mkdir()
    (stale / "99.npy").write_bytes(b"left by a killed run")
    mapped = FrozenParams(_tree(), stale)
    assert not (stale / "99.npy").exists()
    mapped.close()


def test_offload_only_on_a_single_cpu_process(tmp_path):
    assert offload_folder(tmp_path) == tmp_path / ".reference"  # the test session is one CPU process
