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


def _model(**family):
    from grpax.models.registry import ModelConfig

    return ModelConfig(
        vocab_size=128, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
        dtype="bfloat16", weight_dtype="float32", **family,
    )  # fmt: skip


_GEMMA2 = dict(
    family="gemma2", norm_offset=1.0, post_norms=True, mlp_activation="gelu_tanh", scale_embeddings=True,
    tie_word_embeddings=True, attn_logit_softcap=50.0, final_logit_softcap=30.0,
)  # fmt: skip


def _logprobs_both_ways(cfg):
    """Reference logprobs under bfloat16 compute from float32 weights and from ``round_as_read``'s copy of them."""
    from grpax.models.llama import round_as_read
    from grpax.models.params import init_params
    from grpax.rl.train_step import compute_logprobs

    # every weight with bits below bfloat16's: rounding them is not a no-op
    params = jax.tree.map(lambda x: x * 1.37 + 0.01, init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    batch = dict(
        prompt_ids=rng.integers(1, 128, (2, 8)).astype(np.int32),
        prompt_mask=np.ones((2, 8), np.int32),
        completion_ids=rng.integers(1, 128, (6, 12)).astype(np.int32),
        completion_mask=np.ones((6, 12), np.int32),
    )
    rounded = round_as_read(params, cfg)
    stored = np.asarray(compute_logprobs(params, batch, cfg, 0.9, 2))
    return params, rounded, stored, np.asarray(compute_logprobs(rounded, batch, cfg, 0.9, 2))


def test_the_reference_rounded_to_the_compute_dtype_gives_the_same_logprobs_bit_for_bit():
    for family in ({}, dict(family="qwen3", qk_norm=True), _GEMMA2):
        params, rounded, stored, read = _logprobs_both_ways(_model(**family))
        np.testing.assert_array_equal(read, stored)  # not close: equal
        assert np.abs(stored).min() > 0  # real logprobs, not a masked zero
        # float32 weights under bfloat16 compute: half the bytes, except Gemma's final norm (read in float32)
        kept = {"['final_norm']"} if family is _GEMMA2 else set()
        for (path, r), p in zip(
            jax.tree_util.tree_leaves_with_path(rounded), jax.tree.leaves(params), strict=True
        ):
            want = jnp.float32 if jax.tree_util.keystr(path) in kept else jnp.bfloat16
            assert r.dtype == want, jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(p.astype(want), np.float32))


def test_gemmas_final_norm_rounded_would_change_the_logprobs():
    """Why ``round_as_read`` keeps it: Gemma scales by 1 + w in float32, so a rounded w is another model."""
    cfg = _model(**_GEMMA2)
    params, rounded, stored, _ = _logprobs_both_ways(cfg)
    from grpax.rl.train_step import compute_logprobs

    rng = np.random.default_rng(0)
    batch = dict(
        prompt_ids=rng.integers(1, 128, (2, 8)).astype(np.int32),
        prompt_mask=np.ones((2, 8), np.int32),
        completion_ids=rng.integers(1, 128, (6, 12)).astype(np.int32),
        completion_mask=np.ones((6, 12), np.int32),
    )
    all_rounded = dict(rounded, final_norm=rounded["final_norm"].astype(jnp.bfloat16))
    assert not np.array_equal(np.asarray(compute_logprobs(all_rounded, batch, cfg, 0.9, 2)), stored)


def test_params_held_in_host_memory_are_on_the_devices_only_inside_apply():
    tree = _tree()
    x = jnp.arange(3, dtype=jnp.float32)
    held = FrozenParams(tree, host_memory=True)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(held._params)} == {"pinned_host"}
    kinds = held.apply(lambda p, x: jax.tree.map(lambda a: a.sharding.memory_kind, p), x)
    assert set(jax.tree.leaves(kinds)) == {"device"}
    assert float(held.apply(_fn, x)) == float(_fn(tree, x))
