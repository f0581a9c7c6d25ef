"""The decode step's layers scanned over one pool of every layer's pages (``XlaBackend.scan_layers``, TPU chips):
the unrolled decode's tokens and logprobs exactly, and chosen where the params are stacked on TPU chips only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpax.models.params import abstract_params, convert_layout, init_params
from grpax.models.registry import ModelConfig
from grpax.plan.topology import get_topology
from grpax.sampler import engine, program_set
from grpax.sampler.backend import XlaBackend, select_backend
from grpax.sampler.engine import generate
from grpax.sampler.keys import SamplerConfig

CFG = ModelConfig(
    vocab_size=61, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
    rope_theta=10000.0,
)  # fmt: skip
PROMPTS = [[5, 9, 11, 3, 7, 21, 30] * 10, [1, 2], [40, 41, 42, 43, 44], [17] * 70]


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)  # peaked, varied distributions


def _generate(params, monkeypatch, scan: bool, **keys):
    chosen = select_backend
    monkeypatch.setattr(
        engine, "select_backend", lambda *a, **k: dataclasses.replace(chosen(*a, **k), scan_layers=scan)
    )
    program_set.clear_compiled()
    sc = SamplerConfig(
        max_prompt_length=128, max_completion_length=40, temperature=0.9, pad_token_id=0, backend="xla",
        page_size=8, stop_token_ids=(3, 12, 33), **keys,
    )  # fmt: skip
    try:
        return generate(params, PROMPTS, CFG, sc, jax.random.key(3), num_generations=3)
    finally:
        program_set.clear_compiled()


@pytest.mark.parametrize(
    "keys", [dict(programs="fixed"), dict(programs="adaptive", max_num_seqs=4), dict(greedy=True)]
)
def test_the_scanned_decode_samples_the_unrolled_decodes_tokens(params, monkeypatch, keys):
    """The same rows, masks and logprobs (to the bit) with the layers scanned over one pool as unrolled over
    per-layer pools: the fixed program set, the adaptive one with sequences queued for slots (pages reused),
    and greedy rows."""
    unrolled = _generate(params, monkeypatch, False, **keys)
    scanned = _generate(params, monkeypatch, True, **keys)
    assert unrolled.completion_mask.sum() > 3 * len(PROMPTS) * 5  # the rows decoded a while
    np.testing.assert_array_equal(scanned.completion_ids, unrolled.completion_ids)
    np.testing.assert_array_equal(scanned.completion_mask, unrolled.completion_mask)
    np.testing.assert_array_equal(scanned.logprobs, unrolled.logprobs)


def test_one_pool_holds_every_layers_pages():
    """``init_pages`` with ``scan_layers``: one pool of L x num_pages pages, the same bytes as L pools."""
    listed = XlaBackend().init_pages(CFG, 5, 8, jnp.float32)
    one = XlaBackend(scan_layers=True).init_pages(CFG, 5, 8, jnp.float32)
    assert len(listed) == CFG.num_layers and len(one) == 1
    assert one[0].shape == (CFG.num_layers * 5, 8, 2 * CFG.num_kv_heads, CFG.head_dim)
    assert one[0].nbytes == sum(x.nbytes for x in listed)


def _on_chip(tree):
    devices = get_topology("v5e-1").devices  # the TPU compiler's devices (libtpu), no TPU needed
    sharding = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def test_the_decode_is_scanned_where_stacked_params_are_on_tpu_chips(params):
    """Stacked params on TPU chips: scanned; listed ones, params on the CPU, or local (sliding-window) layers:
    unrolled."""
    stacked = _on_chip(abstract_params(CFG))
    assert select_backend("xla", stacked, CFG, concrete=False).scan_layers
    assert select_backend("auto", stacked, CFG, concrete=False).scan_layers
    listed = _on_chip(
        jax.eval_shape(lambda p: convert_layout(p, CFG, scan_layers=False), abstract_params(CFG))
    )
    assert not select_backend("xla", listed, CFG, concrete=False).scan_layers
    assert not select_backend("xla", params, CFG).scan_layers  # this CPU
    gemma_like = dataclasses.replace(CFG, layer_types=("local", "global", "local"), sliding_window=4)
    assert not select_backend("xla", stacked, gemma_like, concrete=False).scan_layers
