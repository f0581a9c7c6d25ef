"""The paged KV cache's attention (grpax.models.attention.paged_attention) against the dense decode attention.

The XLA implementation gathers each sequence's pages; Pallas's ragged paged attention (TPU) runs here in its TPU
interpret mode. Both must give ``cached_attention``'s values for the same keys and values laid out densely.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.models import attention
from grpax.models.llama import decode_paged, forward, init_cache
from grpax.models.params import convert_layout, init_params
from grpax.models.registry import ModelConfig


def _paged_case(S, K, H, page_size, lengths, seed=0, dtype=jnp.float32):
    """Random keys/values of S sequences (``lengths`` tokens each) in a shuffled pool and in the dense layout."""
    rng = np.random.default_rng(seed)
    n = max(-(-int(max(lengths)) // page_size), 1)
    num_pages = 1 + S * n + 3  # page 0 is scratch; a few unused pages
    order = rng.permutation(np.arange(1, num_pages))[: S * n].reshape(S, n)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * K, H)).astype(np.float32)
    dense_k = np.zeros((S, K, H, n * page_size), np.float32)  # [B, K, H, S] and [B, K, S, H]
    dense_v = np.zeros((S, K, n * page_size, H), np.float32)
    for s in range(S):
        for p in range(n * page_size):
            entry = kv_pages[order[s, p // page_size], p % page_size]  # [2K, H]
            dense_k[s, :, :, p] = entry[0::2]
            dense_v[s, :, p, :] = entry[1::2]
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(kv_pages), jnp.asarray(order, jnp.int32), cast(dense_k), cast(dense_v)


@pytest.mark.parametrize("window, cap, scale", [(None, None, None), (3, 5.0, 0.2)])
def test_gathered_pages_attend_as_the_dense_cache(window, cap, scale):
    S, K, G, H, page_size = 4, 2, 3, 8, 4
    lengths = np.array([1, 4, 9, 13])
    kv_pages, table, dense_k, dense_v = _paged_case(S, K, H, page_size, lengths)
    q = jax.random.normal(jax.random.key(1), (S, K * G, H), jnp.float32)
    got = attention.paged_attention(q, kv_pages, table, jnp.asarray(lengths, jnp.int32), scale, cap, window)
    slots = np.arange(dense_k.shape[-1])[None]
    mask = slots < lengths[:, None]
    if window is not None:
        mask &= (lengths[:, None] - 1) - slots < window
    want = attention.cached_attention(q[:, None], dense_k, dense_v, jnp.asarray(mask)[:, None], scale, cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, 0]), atol=1e-6, rtol=1e-6)


def test_write_pages_puts_each_key_and_value_at_its_page_and_offset():
    kv_pages = jnp.zeros((5, 4, 4, 3))
    k = jnp.arange(2 * 2 * 3, dtype=jnp.float32).reshape(2, 2, 3)
    v = -k
    out = np.asarray(attention.write_pages(kv_pages, k, v, jnp.array([3, 5]), jnp.array([1, 0])))
    np.testing.assert_array_equal(out[3, 1, 0::2], k[0])
    np.testing.assert_array_equal(out[3, 1, 1::2], v[0])
    assert np.count_nonzero(out) == np.count_nonzero(out[3, 1])  # page 5 is past the pool: dropped


CFG = ModelConfig(
    vocab_size=61,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    layer_types=("local", "global"),
    sliding_window=3,
    query_pre_attn_scalar=12.0,
)


def test_paged_decode_equals_the_dense_cached_forward():
    """Token by token from a prefilled prompt, sequences at their own positions: decode_paged's logits are the
    model's dense-cache forward's (sliding window, GQA, a scores factor); an idle slot changes nothing."""
    params = convert_layout(
        jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, init_params(CFG, jax.random.key(0))),
        CFG,
        scan_layers=False,
    )
    prompts, steps, page_size = [[5, 9, 11, 3, 7], [1, 2]], 6, 4
    P = max(map(len, prompts))
    tokens = np.zeros((2, P), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    dense = init_cache(CFG, 2, P + steps, stacked=False)
    positions = jnp.broadcast_to(jnp.arange(P), (2, P))
    logits, dense = forward(params, jnp.asarray(tokens), CFG, positions=positions, cache=dense)
    n = -(-(P + steps) // page_size)
    table = np.array([[1 + 2 * i + b for i in range(n)] for b in range(2)] + [[0] * n], np.int32)  # 3rd: idle
    pages = [
        jnp.zeros((1 + 2 * n, page_size, 2 * CFG.num_kv_heads, CFG.head_dim)) for _ in range(CFG.num_layers)
    ]
    # the prompts' keys and values, copied from the dense cache into the pages
    for layer in range(CFG.num_layers):
        for b, p in enumerate(prompts):
            for t in range(len(p)):
                k = dense["k"][layer][b, :, :, t]
                v = dense["v"][layer][b, :, t, :]
                pages[layer] = attention.write_pages(
                    pages[layer],
                    k[None],
                    v[None],
                    jnp.array([table[b, t // page_size]]),
                    jnp.array([t % page_size]),
                )
    lengths = np.array([len(p) for p in prompts])
    nxt = np.asarray(logits)[np.arange(2), lengths - 1].argmax(-1)
    step = jax.jit(decode_paged, static_argnames=("cfg",))
    for i in range(steps):
        pos = lengths + i
        want, dense = forward(
            params,
            jnp.asarray(nxt, jnp.int32)[:, None],
            CFG,
            positions=jnp.asarray(pos)[:, None],
            cache=dense,
        )
        hidden, pages = step(
            params,
            jnp.asarray([*nxt, 7], jnp.int32),
            jnp.asarray([*pos, -1], jnp.int32),
            pages,
            jnp.asarray(table),
            cfg=CFG,
        )
        from grpax.models.llama import logits_from_hidden

        got = logits_from_hidden(params, hidden, CFG)
        np.testing.assert_allclose(np.asarray(got[:2]), np.asarray(want[:, 0]), atol=1e-4, rtol=1e-5)
        nxt = np.asarray(got[:2]).argmax(-1)
    assert all(float(jnp.abs(p[1:]).sum()) > 0 for p in pages)


def _interpret_ragged_kernel(monkeypatch):
    """Pallas's ragged paged attention kernel as it runs in the TPU interpret mode of jax 0.10.2: its one
    reshape of a VMEM ref (a transform that interpreter does not implement) is done on the loaded value."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    class Flat:  # ref.reshape(...)[idx] as value.reshape(...)[idx]
        def __init__(self, ref, shape):
            self.ref, self.shape, self.dtype = ref, shape, ref.dtype

        def __getitem__(self, idx):
            return self.ref[...].reshape(self.shape)[idx]

    class View:
        def __init__(self, ref):
            self.ref = ref

        def reshape(self, *shape):
            return Flat(self.ref, shape)

    wait = kernel.MultiPageAsyncCopyDescriptor.wait
    monkeypatch.setattr(kernel.MultiPageAsyncCopyDescriptor, "wait", lambda self: View(wait(self)))


@pytest.mark.parametrize("window, cap", [(None, None), (5, 20.0)])
def test_the_ragged_tpu_kernel_in_interpret_mode_equals_the_gathered_pages(monkeypatch, window, cap):
    """The TPU kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention) on the pool layout and the inputs
    the engine gives it: the XLA implementation's values. The kernel's block sizes are chosen so that the
    interpreter's masked-store bounds check (which compares every dimension with the first one) passes."""
    from jax.experimental.pallas import tpu as pltpu

    _interpret_ragged_kernel(monkeypatch)
    S, K, G, H, page_size = 4, 2, 2, 128, 16  # the kernel's tiles: H a multiple of 128
    lengths = np.array([1, 17, 33, 40])
    kv_pages, table, _, _ = _paged_case(S, K, H, page_size, lengths, seed=3)
    q = jax.random.normal(jax.random.key(2), (S, K * G, H), jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    want = attention.paged_attention(q, kv_pages, table, lengths, 0.1, cap, window, "xla")
    # kv pages, queries per block (what grpax passes the kernel off TPU chips)
    monkeypatch.setattr(attention, "_ragged_block_sizes", lambda *args: (2, G))
    with pltpu.force_tpu_interpret_mode():
        got = attention.paged_attention(q, kv_pages, table, lengths, 0.1, cap, window, "ragged_tpu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_the_ragged_tpu_kernel_is_chosen_only_for_heads_it_takes():
    """The kernel's tiles (head_dim a multiple of 128, 2K heads whole sublane tiles): Llama 3.1 8B's pools take
    it, SmolLM2-135M's (K=3, H=64) and the compile checks' tiny models (H=16) fall back to the gathered pages."""
    assert attention.ragged_tpu_takes(8, 128, jnp.bfloat16)  # llama3.1-8b
    assert attention.ragged_tpu_takes(2, 128, jnp.float32)  # this file's kernel test
    assert not attention.ragged_tpu_takes(3, 64, jnp.bfloat16)  # SmolLM2-135M
    assert not attention.ragged_tpu_takes(2, 16, jnp.float32)
    assert not attention.ragged_tpu_takes(5, 128, jnp.bfloat16)  # 10 heads: 5 bfloat16 tiles
    assert not attention.ragged_tpu_takes(1, 128, jnp.int8)  # 2 heads of a 4-packed dtype
