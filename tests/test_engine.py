"""The KV-cache rollout engine against a full forward recompute (grpax.sampler.engine)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CPU_HAS_AVX512, gsm8k_dir

from grpax.backends.cpu import build
from grpax.models.llama import forward, init_cache
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.sampler import sampling
from grpax.sampler.engine import Engine, generate
from grpax.sampler.keys import SamplerConfig, slot_counts
from grpax.sampler.requests import prepare_prompts

CFG = ModelConfig(
    vocab_size=61,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    rope_theta=10000.0,
)
PROMPTS = [[5, 9, 11, 3, 7, 21, 30], [1, 2], [40, 41, 42, 43, 44], [17]]
C = 12


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0))
    # std 0.02 gives near-uniform logits (argmax ties); std ~0.3 makes the distributions peaked and varied
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)


# The sampler on the CPU backend (its kernels, where they build and JAX runs on CPU) and on the XLA backend must
# both match the full forward.
CPU_BACKEND = jax.default_backend() == "cpu" and build.available()
BACKENDS = [pytest.param("cpu", marks=pytest.mark.skipif(not CPU_BACKEND, reason="no CPU backend")), "xla"]


def _sc(**kw):
    base = dict(max_prompt_length=16, max_completion_length=C, greedy=True, pad_token_id=0)
    return SamplerConfig(**{**base, **kw})


def _full_logits(params, prompt, completion):
    """float32 [len(completion), V]: logits predicting each completion token, from one uncached forward."""
    seq = jnp.asarray([list(prompt) + list(completion)], jnp.int32)
    logits, _ = forward(params, seq, CFG)
    return np.asarray(logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)])


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_cached_decode_equals_full_forward(params, backend):
    out = generate(params, PROMPTS, CFG, _sc(backend=backend), jax.random.key(0))
    assert out.completion_ids.shape == (4, C) and out.completion_ids.dtype == np.int32
    np.testing.assert_array_equal(out.completion_mask, 1)
    assert out.finish_reason == ["length"] * 4
    for i, prompt in enumerate(PROMPTS):
        ref = _full_logits(params, prompt, out.completion_ids[i])
        np.testing.assert_array_equal(out.completion_ids[i], ref.argmax(-1))
        expected = np.take_along_axis(_log_softmax(ref), out.completion_ids[i][:, None], -1)[:, 0]
        np.testing.assert_allclose(out.logprobs[i], expected, atol=1e-4)
    assert len(set(map(tuple, out.completion_ids.tolist()))) > 1  # the rows really differ


def test_stacked_cache_decode_equals_full_forward(params):
    # The model's scanned layers over a stacked cache [L, B, ...] (the sampler unrolls them): token by token,
    # each row at its own position, the logits of one uncached forward.
    prompts, steps = [[5, 9, 11], [1]], 6
    cache = init_cache(CFG, 2, 3 + steps)
    tokens = np.zeros((2, 3), np.int32)
    tokens[0], tokens[1, :1] = prompts[0], prompts[1]
    positions = jnp.broadcast_to(jnp.arange(3), (2, 3))
    logits, cache = forward(params, jnp.asarray(tokens), CFG, positions=positions, cache=cache)
    lengths = np.array([3, 1])
    nxt = np.asarray(logits)[np.arange(2), lengths - 1].argmax(-1)
    seqs = [list(p) for p in prompts]
    for step in range(steps):
        for b in range(2):
            seqs[b].append(int(nxt[b]))
        pos = jnp.asarray(lengths + step)[:, None]
        logits, cache = forward(params, jnp.asarray(nxt, jnp.int32)[:, None], CFG, positions=pos, cache=cache)
        for b in range(2):
            ref = _full_logits(params, prompts[b], seqs[b][len(prompts[b]) :] + [0])[-1]
            np.testing.assert_allclose(np.asarray(logits[b, 0]), ref, atol=1e-4, rtol=1e-5)
        nxt = np.asarray(logits[:, 0]).argmax(-1)


def test_xla_prefill_scans_stacked_layers_like_unrolled_ones(params):
    # The XLA backend's prefill scans stacked layers (one compiled layer; the TPU compiler spent most of an hour
    # on 70B's 80 unrolled ones) and unrolls a layer list: the same last hidden states and per-layer cache.
    from grpax.models.params import convert_layout
    from grpax.sampler.backend import XlaBackend

    tokens = np.zeros((2, 5), np.int32)
    tokens[0], tokens[1, :2] = [5, 9, 11, 3, 7], [1, 2]
    lengths = jnp.asarray([5, 2], jnp.int32)

    def prefill(p):
        def fn(p, t, n):
            return XlaBackend().prefill(p, t, n, init_cache(CFG, 2, 5, stacked=False), CFG, None)

        return jax.jit(fn)(p, jnp.asarray(tokens), lengths), jax.make_jaxpr(fn)(p, tokens, lengths)

    (last, cache), jaxpr = prefill(params)
    (ref_last, ref_cache), ref_jaxpr = prefill(convert_layout(params, CFG, scan_layers=False))
    assert "scan" in str(jaxpr) and "scan" not in str(ref_jaxpr)
    assert len(cache["k"]) == len(cache["v"]) == CFG.num_layers
    np.testing.assert_allclose(np.asarray(last), np.asarray(ref_last), atol=1e-6, rtol=1e-6)
    # The two programs may sum a layer's products in different orders (XLA fuses a scan's body and unrolled
    # layers differently): within 16 float32 ulps of each buffer's largest value (measured: 5 ulps, layer 1).
    for got, ref in zip(cache["k"] + cache["v"], ref_cache["k"] + ref_cache["v"], strict=True):
        assert got.shape == ref.shape
        ref = np.asarray(ref)
        atol = 16 * np.finfo(np.float32).eps * np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(got), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_logprobs_equal_full_forward_at_temperature(params, backend):
    sc = _sc(greedy=False, temperature=0.7, backend=backend)
    out = generate(params, PROMPTS, CFG, sc, jax.random.key(4))
    for i, prompt in enumerate(PROMPTS):
        ref = _log_softmax(_full_logits(params, prompt, out.completion_ids[i]) / 0.7)
        expected = np.take_along_axis(ref, out.completion_ids[i][:, None], -1)[:, 0]
        np.testing.assert_allclose(out.logprobs[i], expected, atol=1e-4)
    # at temperature 0.7 sampling departs from greedy somewhere
    greedy = generate(params, PROMPTS, CFG, _sc(), jax.random.key(4))
    assert (out.completion_ids != greedy.completion_ids).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.6)])
def test_filtered_sampling_reports_the_filtered_distributions_logprobs(params, backend, top_k, top_p):
    """With top-k / top-p the sampler's logprobs are the behaviour policy's: log_softmax over the kept tokens
    (each draw is one of them), larger than the unfiltered ones by -log(kept mass)."""
    sc = _sc(greedy=False, temperature=1.2, top_k=top_k, top_p=top_p, backend=backend)
    out = generate(params, PROMPTS, CFG, sc, jax.random.key(7))
    gaps = []
    for i, prompt in enumerate(PROMPTS):
        n = int(out.lengths[i])
        scaled = _full_logits(params, prompt, out.completion_ids[i][:n]) / 1.2  # [n, V]
        order = np.sort(scaled, axis=-1)[:, ::-1]
        if top_k:
            kept = scaled >= order[:, top_k - 1 : top_k]
        else:  # the nucleus: tokens whose strictly-more-likely mass is < top_p
            probs = np.exp(_log_softmax(scaled))
            kept = np.array([[probs[t][probs[t] > p].sum() < top_p for p in probs[t]] for t in range(n)])
        filtered = np.where(kept, scaled, -np.inf)
        chosen = out.completion_ids[i][:n]
        assert kept[np.arange(n), chosen].all()  # every draw is a kept token
        expected = np.take_along_axis(_log_softmax(filtered), chosen[:, None], -1)[:, 0]
        np.testing.assert_allclose(out.logprobs[i, :n], expected, atol=1e-4)
        unfiltered = np.take_along_axis(_log_softmax(scaled), chosen[:, None], -1)[:, 0]
        gaps += list(out.logprobs[i, :n] - unfiltered)
    assert min(gaps) >= -1e-5 and max(gaps) > 1e-2  # -log(kept mass) >= 0, and the filter did drop mass


def test_the_gpus_top_k_threshold_samples_the_same_rollout(monkeypatch):
    # A GPU finds top-k's threshold from block maxima (sampling._kth_largest_by_blocks), CPU and TPU by lax.top_k:
    # run the blocks on this CPU in the sort's place and the rollout is the same, token for token, bit for bit.
    cfg = dataclasses.replace(CFG, vocab_size=4096)  # 128 blocks of 32: the blocks path engages at k = 20
    params = jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, init_params(cfg, jax.random.key(1)))
    sc = _sc(greedy=False, temperature=1.0, top_k=20, backend="xla")
    expected = generate(params, PROMPTS, cfg, sc, jax.random.key(3))
    calls = []

    def by_blocks(logits, top_k):
        calls.append(top_k)
        return sampling._kth_largest_by_blocks(logits, top_k)

    monkeypatch.setattr(sampling, "_kth_largest_by_sort", by_blocks)
    jax.clear_caches()  # the sampler's programs traced again, with the blocks
    try:
        got = generate(params, PROMPTS, cfg, sc, jax.random.key(3))
    finally:
        jax.clear_caches()  # and again without them, for the tests after this one
    assert calls  # the blocks ran
    np.testing.assert_array_equal(got.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(got.logprobs, expected.logprobs)
    assert len(set(expected.completion_ids.ravel().tolist())) > 20  # sampled, not one token over and over


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_do_not_depend_on_the_batch(params, backend):
    sc = _sc(greedy=False, temperature=1.0, backend=backend)
    full = generate(params, PROMPTS, CFG, sc, jax.random.key(7))
    # row 0 alone and with companions of other lengths
    alone = generate(params, PROMPTS[:1], CFG, sc, jax.random.key(7))
    other = generate(params, [PROMPTS[0], [3] * 15, [8]], CFG, sc, jax.random.key(7))
    np.testing.assert_array_equal(alone.completion_ids[0], full.completion_ids[0])
    np.testing.assert_array_equal(other.completion_ids[0], full.completion_ids[0])
    np.testing.assert_allclose(other.logprobs[0], full.logprobs[0], atol=1e-5)
    # greedy rows are independent of their row index too
    g = generate(params, PROMPTS, CFG, _sc(backend=backend), jax.random.key(0))
    g_rev = generate(params, PROMPTS[::-1], CFG, _sc(backend=backend), jax.random.key(0))
    np.testing.assert_array_equal(g.completion_ids, g_rev.completion_ids[::-1])


def test_stop_tokens_mask_and_finish_reason(params):
    free = generate(params, PROMPTS, CFG, _sc(), jax.random.key(0))
    # stop at two ids seen in row 0 (positions 3 and 6 unless they appear earlier) with pad == one stop id
    row = free.completion_ids[0].tolist()
    stops = (row[3], row[6])
    sc = _sc(stop_token_ids=stops, pad_token_id=stops[0])
    out = generate(params, PROMPTS, CFG, sc, jax.random.key(0))
    for i in range(len(PROMPTS)):
        ids = free.completion_ids[i].tolist()
        first = next((t for t, tok in enumerate(ids) if tok in stops), None)
        n = C if first is None else first + 1
        assert out.lengths[i] == n
        np.testing.assert_array_equal(out.completion_mask[i], [1] * n + [0] * (C - n))
        np.testing.assert_array_equal(out.completion_ids[i, :n], ids[:n])
        np.testing.assert_array_equal(out.completion_ids[i, n:], stops[0])
        np.testing.assert_array_equal(out.logprobs[i, n:], 0.0)
        assert out.finish_reason[i] == ("length" if first is None else "stop")
    assert out.lengths[0] <= 4 and out.finish_reason[0] == "stop"


def test_all_rows_stopping_ends_early_with_length_cutoff(params):
    free = generate(params, PROMPTS, CFG, _sc(), jax.random.key(0))
    firsts = tuple(int(t) for t in free.completion_ids[:, 0])  # every row stops at its first token
    out = generate(params, PROMPTS, CFG, _sc(stop_token_ids=firsts), jax.random.key(0))
    np.testing.assert_array_equal(out.lengths, 1)
    assert out.finish_reason == ["stop"] * 4
    np.testing.assert_array_equal(out.completion_mask[:, 1:], 0)


def test_seeds(params):
    sc = _sc(greedy=False, temperature=1.0, top_k=20, top_p=0.95)
    a = generate(params, [PROMPTS[0]] * 4, CFG, sc, jax.random.key(1))
    b = generate(params, [PROMPTS[0]] * 4, CFG, sc, jax.random.key(1))
    c = generate(params, [PROMPTS[0]] * 4, CFG, sc, jax.random.key(2))
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.completion_ids != c.completion_ids).any()
    assert len(set(map(tuple, a.completion_ids.tolist()))) == 4  # the G completions of one prompt differ


def test_prompt_padding_and_truncation(params, caplog):
    sc = _sc(max_prompt_length=6)
    out = generate(params, PROMPTS, CFG, sc, jax.random.key(0))
    assert out.prompt_ids.shape == (4, 6)
    np.testing.assert_array_equal(out.prompt_ids[0], PROMPTS[0][-6:])  # left truncation keeps the end
    np.testing.assert_array_equal(out.prompt_ids[1], [0, 0, 0, 0, 1, 2])
    np.testing.assert_array_equal(out.prompt_mask[1], [0, 0, 0, 0, 1, 1])
    assert "longer than max_prompt_length=6 (key max_prefill_predict_length)" in caplog.text
    kept, idx = prepare_prompts(PROMPTS, dataclasses.replace(sc, truncation="drop"))
    assert idx == [1, 2, 3] and kept == PROMPTS[1:]


def test_buckets():
    sc = SamplerConfig(max_prompt_length=200)
    assert sc.buckets() == (64, 128, 192, 200)
    assert sc.bucket_for(1) == 64 and sc.bucket_for(65) == 128 and sc.bucket_for(193) == 200
    assert SamplerConfig(max_prompt_length=100, prompt_length_buckets=(48, 96)).buckets() == (48, 96, 100)
    with pytest.raises(ValueError, match="truncation"):
        SamplerConfig(truncation="right")


def _transformers_from_gguf(path):
    """transformers' own GGUF reader (``load_gguf_checkpoint``) into a float32 ``LlamaForCausalLM``.

    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` does the same but requires ``accelerate``,
    which is not a test dependency.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM(LlamaConfig(**load_gguf_checkpoint(path, return_tensors=False)["config"]))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False
    )
    assert missing == ["lm_head.weight"] and not unexpected  # lm_head is tied to the embedding
    return model.float().eval()


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_generate():
    """SmolLM2-135M-Instruct (GGUF, float32): 64 greedy tokens on real GSM8K prompts equal transformers'."""
    import json

    import torch

    from grpax.checkpoint.gguf import default_gguf_path, read_gguf
    from grpax.checkpoint.hf import load_params_from_tensors
    from grpax.models.registry import from_hf_config

    path = default_gguf_path()
    source = read_gguf(path)
    cfg = from_hf_config(source.hf_config)
    params = load_params_from_tensors(source.get_tensor, source.has_tensor, cfg)
    tokenizer = source.tokenizer()
    with open(gsm8k_dir() / "test.jsonl") as f:
        questions = [json.loads(next(f))["question"] for _ in range(3)]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]
    stops = (2,)  # <|im_end|>, SmolLM2-Instruct's eos
    sc = SamplerConfig(
        max_prompt_length=256, max_completion_length=64, greedy=True, stop_token_ids=stops, pad_token_id=2
    )
    out = generate(params, prompts, cfg, sc, jax.random.key(0))

    hf = _transformers_from_gguf(path)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=list(stops),
                pad_token_id=2,
            )
        ref_new = ref[0, len(prompt) :].tolist()
        ours = out.completion_ids[i, : out.lengths[i]].tolist()
        assert ours == ref_new, (i, tokenizer.decode(ours), tokenizer.decode(ref_new))
    assert max(out.lengths) >= 32  # the comparison covers real text, not an immediate stop


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_generations_equals_repeated_prompts(params, backend):
    # One prefill per prompt, its cache copied to G rows, must sample exactly what G copies of the prompt do.
    G = 3
    sc = _sc(greedy=False, temperature=0.8, top_k=20, backend=backend)
    grouped = generate(params, PROMPTS, CFG, sc, jax.random.key(7), num_generations=G)
    repeated = generate(params, [p for p in PROMPTS for _ in range(G)], CFG, sc, jax.random.key(7))
    np.testing.assert_array_equal(grouped.completion_ids, repeated.completion_ids)
    np.testing.assert_array_equal(grouped.completion_mask, repeated.completion_mask)
    np.testing.assert_allclose(grouped.logprobs, repeated.logprobs, atol=1e-5)
    # Each prompt once (row i answers prompt i // G); the repeated call has each G times.
    np.testing.assert_array_equal(grouped.prompt_ids, repeated.prompt_ids[::G])
    np.testing.assert_array_equal(grouped.prompt_mask, repeated.prompt_mask[::G])
    np.testing.assert_array_equal(grouped.prompt_indices, np.arange(len(PROMPTS)))
    assert grouped.finish_reason == repeated.finish_reason
    assert len({tuple(r) for r in grouped.completion_ids[:G]}) > 1  # the G samples of a prompt differ


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_phases_give_the_same_rollouts(params, backend):
    # Phases of 5 steps (caches of P + 5, + 10, + 12 slots, grown between) against one phase on P + C slots;
    # P = 7 = the longest prompt, so that row fills the last slot of each phase's cache.
    base = _sc(greedy=False, temperature=0.9, max_prompt_length=7, backend=backend)
    phased = generate(
        params, PROMPTS, CFG, dataclasses.replace(base, decode_phase_length=5), jax.random.key(3), 2
    )
    single = generate(
        params, PROMPTS, CFG, dataclasses.replace(base, decode_phase_length=0), jax.random.key(3), 2
    )
    np.testing.assert_array_equal(phased.completion_ids, single.completion_ids)
    np.testing.assert_array_equal(phased.completion_mask, single.completion_mask)
    np.testing.assert_allclose(phased.logprobs, single.logprobs, atol=1e-5, rtol=0)
    greedy = generate(
        params,
        PROMPTS,
        CFG,
        _sc(decode_phase_length=5, max_prompt_length=7, backend=backend),
        jax.random.key(0),
    )
    for i, prompt in enumerate(PROMPTS):  # the phased decode is exact
        ref = _full_logits(params, prompt, greedy.completion_ids[i])
        np.testing.assert_array_equal(greedy.completion_ids[i], ref.argmax(-1))


@pytest.mark.skipif(not CPU_BACKEND, reason="no CPU backend")
@pytest.mark.parametrize("cache_dtype", [None, "float32", "bfloat16"])
def test_bfloat16_model_and_cache_dtypes_run_on_both_backends(cache_dtype):
    # Regressions: a bf16 x bf16 -> f32 batched dot XLA:CPU rejects (the padded prefill), and a float32 cache
    # turning a bf16 model's residual stream to float32 (the stacked-layer scan then fails on its carry type).
    cfg = CFG.replace(dtype="bfloat16")
    p = init_params(cfg, jax.random.key(0))
    sc = _sc(cache_dtype=cache_dtype, backend="xla")
    padded = generate(p, PROMPTS, cfg, sc, jax.random.key(0))
    packed = generate(p, PROMPTS, cfg, dataclasses.replace(sc, backend="cpu"), jax.random.key(0))
    assert np.isfinite(padded.logprobs).all() and (padded.logprobs <= 0).all()
    np.testing.assert_array_equal(padded.completion_mask, 1)
    # the first token comes from the prefill alone: both prefills agree on it
    np.testing.assert_array_equal(padded.completion_ids[:, 0], packed.completion_ids[:, 0])
    cache = init_cache(cfg, 2, 8, cache_dtype)  # stacked: the scanned layers' carry keeps bfloat16
    hidden, _ = forward(p, jnp.ones((2, 3), jnp.int32), cfg, cache=cache, return_hidden=True)
    assert hidden.dtype == jnp.bfloat16


def _same(a, b, exact_logprobs=True):
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    _same_logprobs(a.logprobs, b.logprobs, exact_logprobs)
    assert a.finish_reason == b.finish_reason


def _same_logprobs(a, b, exact=True):
    """Bit for bit where a row's logprobs do not depend on the rows beside it (an AVX-512 CPU: every row the same
    whatever else was in flight); else float32 rounding of products of other row counts: a GPU's matmul kernel
    is chosen by the row count (an H200, the static engine's retirement: at most 9.5e-7), and an AVX2 CPU's
    XLA ops (3.1e-5 of -0.416 at most, the CPU kernels 1.3e-5; as tests/test_program_set.py's 4.0e-5)."""
    on_cpu = jax.default_backend() == "cpu"
    if exact and on_cpu and CPU_HAS_AVX512:
        np.testing.assert_array_equal(a, b)
    elif on_cpu and not CPU_HAS_AVX512:
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=4e-5)
    else:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


# Rows that end between step 2 and 40 (the default sampling of the tests below).
LONG_TAILED = dict(greedy=False, temperature=0.9, top_k=50, stop_token_ids=(0,), max_completion_length=40)


@pytest.mark.parametrize("backend", BACKENDS)
def test_few_slots_and_pages_refilled_as_rows_end_give_the_same_rollout(params, backend):
    """24 rows through 5 decode slots, pages of 4 tokens, calls of 3 steps: slots are refilled as rows end and
    pages taken and freed; from a pool that holds 2 full-length rows the newest row is preempted (and restarted)
    when the pool runs short. Every row samples what it samples with all rows in flight at once, bit for bit:
    its tokens depend on nothing else in flight."""
    prompts = [*PROMPTS, [3, 4, 5], [8, 8]]
    sc = _sc(**LONG_TAILED, backend=backend)
    full = generate(params, prompts, CFG, sc, jax.random.key(3), 4)
    lengths = full.lengths
    assert lengths.min() <= 3 and lengths.max() == 40 and (lengths == 40).sum() < 6  # rows end far apart
    useful = int((lengths - 1).sum())  # decode steps the rows need: their first token comes from the prefill
    for rows_of_pages in (3, 2):  # the pool: this many full-length rows (14 pages of 4 tokens each)
        narrow = dataclasses.replace(
            sc, max_num_seqs=5, page_size=4, num_pages=1 + 14 * rows_of_pages, decode_steps_per_call=3
        )
        engine = Engine(params, CFG, narrow)
        request = engine.submit(prompts, jax.random.key(3), 4)
        engine.run(request)
        out = request.output(sc.pad_token_id, sc.bucket_for(7), sc.max_completion_length)
        _same(out, full)
        assert engine.pool.num_free == engine.pool.num_pages - 1  # every page back (page 0 is scratch)
        assert engine.stats["prefills"] > 1
        if rows_of_pages == 3:  # the slots stayed full while rows waited
            assert engine.stats["preempted"] == 0
            # all 24 at once on their slots to the longest row's end: a long tail (with retire_rows the slot
            # ladder takes the all-at-once run down to ~1.1x useful as well)
            assert out.decode_row_steps < 1.15 * useful < 24 * 39
        else:
            assert engine.stats["preempted"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_retired_slots_give_the_same_rollout_with_less_decode_work(params, backend):
    # With nothing waiting, the running rows move to the smallest halving of the 24 slots that holds them.
    prompts = [*PROMPTS, [3, 4, 5], [8, 8]]
    sc = _sc(**LONG_TAILED, backend=backend)
    retired = generate(params, prompts, CFG, sc, jax.random.key(3), 4)
    full = generate(params, prompts, CFG, dataclasses.replace(sc, retire_rows=False), jax.random.key(3), 4)
    _same(retired, full)
    assert full.decode_row_steps == 24 * 39  # every slot runs every step until the longest row ends
    # A call returns as soon as the running rows fit the next smaller slot count, so each decode step runs on the
    # smallest count of 24's ladder that holds the rows still decoding at it (row i: steps 1..length_i - 1).
    assert slot_counts(24) == [24, 21, 18, 15, 12, 9, 6, 3]
    running = [int((full.lengths > t).sum()) for t in range(1, int(full.lengths.max()))]
    fewest = [min(b for b in slot_counts(24) if b >= r) for r in running]
    assert retired.decode_row_steps == sum(fewest) < 0.7 * full.decode_row_steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_count_step_one_leaves_no_slot_idle_in_the_tail(params, backend):
    # slot_count_step=1: a count for every number of running rows, so each decode step runs on exactly the rows
    # still decoding (no row-step past a row's end); the default ladder (q = 3 for 24 slots) idles up to 2 slots.
    prompts = [*PROMPTS, [3, 4, 5], [8, 8]]
    sc = _sc(**LONG_TAILED, backend=backend)
    ladder = generate(params, prompts, CFG, sc, jax.random.key(3), 4)
    exact = generate(params, prompts, CFG, dataclasses.replace(sc, slot_count_step=1), jax.random.key(3), 4)
    _same(exact, ladder)
    assert slot_counts(24, 1) == list(range(24, 0, -1)) and slot_counts(24, 5) == [24, 20, 15, 10, 5]
    assert exact.decode_row_steps == int((exact.lengths - 1).sum()) < ladder.decode_row_steps


def test_a_row_does_not_depend_on_what_else_is_in_flight(params):
    """A request submitted while another one runs (sharing its slots and pool, admitted between decode calls)
    samples what it samples alone; so does the first one."""
    sc = _sc(**LONG_TAILED, max_num_seqs=6, page_size=4, decode_steps_per_call=2)
    alone_a = generate(params, PROMPTS, CFG, sc, jax.random.key(1), 2)
    alone_b = generate(params, [[9, 9, 9], [4]], CFG, sc, jax.random.key(2), 3)
    engine = Engine(params, CFG, sc)
    a = engine.submit(PROMPTS, jax.random.key(1), 2)
    engine.step()
    engine.step()
    b = engine.submit([[9, 9, 9], [4]], jax.random.key(2), 3)
    engine.run()
    assert a.done and b.done
    _same(a.output(0), alone_a)
    _same(b.output(0), alone_b)


def test_update_params_swaps_the_weights_between_calls_and_records_each_tokens_version(params):
    """New weights on a running engine: queued and running rows are kept, tokens sampled after the swap record
    the new version, and (greedy, the same values under a new version) the rollout is unchanged: the same
    tokens, the logprobs to float32 rounding (the running rows' KV recomputed by a prefill, summed in another
    order than the decode steps that wrote it)."""
    sc = _sc(max_num_seqs=2, decode_steps_per_call=2)
    before = generate(params, PROMPTS, CFG, sc, jax.random.key(0))
    engine = Engine(params, CFG, sc, version=3)
    request = engine.submit(PROMPTS, jax.random.key(0))
    engine.step()
    engine.update_params(jax.tree.map(jnp.copy, params), 4)
    engine.run(request)
    out = request.output(0)
    _same(out, before, exact_logprobs=False)
    assert engine.stats["recomputed_tokens"] > 0
    versions = out.policy_versions
    assert versions[0, 0] == 3 and versions[0, -1] == 4  # a row running at the swap has both
    assert (versions[2:] == 4).all()  # rows that waited for a slot sampled every token with the new weights
    assert (np.diff(versions, axis=1) >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_swap_recomputes_the_kv_so_each_token_is_its_versions(params, backend):
    """New weights mid-sequence (AReaL's interruptible generation): the running and ready sequences' keys and
    values are recomputed under them before they decode on, so every token's sampler logprob is its recorded
    version's full forward (without the recompute the tail attended the old weights' KV: off by up to 0.23 nats);
    the recomputed tokens are counted: every prefilled sequence's context at the swap."""
    sc = _sc(greedy=False, temperature=0.7, max_num_seqs=3, page_size=4, decode_steps_per_call=2)
    sc = dataclasses.replace(sc, backend=backend)
    newer = jax.tree.map(lambda x: x * 1.1 if x.ndim >= 2 else x, params)
    engine = Engine(params, CFG, sc, version=0)
    request = engine.submit(PROMPTS, jax.random.key(5), 2)  # 8 rows in 3 slots: running, ready and queued
    engine.step()
    engine.step()
    in_flight = [seq for seq in request.sequences if seq.state in ("running", "ready")]
    context = sum(len(seq.prompt) + seq.n - 1 for seq in in_flight)
    engine.update_params(newer, 1)
    engine.run(request)
    assert engine.stats["recomputed_tokens"] == context > 0  # a ready one's when it takes a slot
    out = request.output(0, width=C)
    assert {0, 1} <= set(np.unique(out.policy_versions).tolist())
    both = 0
    for b, seq in enumerate(request.sequences):
        n, versions = out.lengths[b], out.policy_versions[b, : out.lengths[b]]
        both += len(set(versions)) == 2
        for version, p in ((0, params), (1, newer)):
            ref = _log_softmax(_full_logits(p, seq.prompt, out.completion_ids[b, :n]) / 0.7)
            expected = np.take_along_axis(ref, out.completion_ids[b, :n, None], -1)[:, 0]
            at = versions == version
            np.testing.assert_allclose(out.logprobs[b, :n][at], expected[at], atol=1e-4)
    assert both >= 2  # rows running at the swap sampled with both versions


def test_a_pool_too_small_for_one_row_is_one_line(params):
    with pytest.raises(ValueError, match=r"num_pages=3 holds no sequence of .* pass at least 8"):
        Engine(params, CFG, _sc(page_size=4, num_pages=3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_program_takes_the_pool_donated_so_no_cache_outlives_its_call(params, backend, monkeypatch):
    # The static engine's retiring decode held the prefill's cache beside every later phase's (the main job's
    # evaluation peaked 0.2-0.5 GB higher) until it donated it. The paged engine's prefill writes into the pool
    # and its decode updates it: both take the pool donated, so every pool a call was given is gone after it
    # (updated in place, not copied), and the prefill's dense cache is a temporary of its program.
    from grpax.sampler import engine

    given = []

    def recording(compiled):
        def wrap(backend_obj):
            fn = compiled(backend_obj)

            def run(prepared, pages, *args, **kwargs):
                given.extend(jax.tree.leaves(pages))
                return fn(prepared, pages, *args, **kwargs)

            return run

        return wrap

    monkeypatch.setattr(engine, "compiled_admit", recording(engine.compiled_admit))
    monkeypatch.setattr(engine, "compiled_decode", recording(engine.compiled_decode))
    sc = _sc(**LONG_TAILED, max_num_seqs=4, page_size=4, decode_steps_per_call=3, backend=backend)
    out = generate(params, PROMPTS, CFG, sc, jax.random.key(3), 2)
    assert len(given) > 2 * CFG.num_layers  # several calls, one pool per layer each
    assert all(leaf.is_deleted() for leaf in given)
    full = generate(params, PROMPTS, CFG, dataclasses.replace(sc, max_num_seqs=0), jax.random.key(3), 2)
    _same(out, full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engines_pool_is_the_one_the_planner_sizes(params, backend):
    """``Engine`` allocates the pool ``paging.pool_pages`` counts and ``paging.abstract_pool`` describes (what
    ``abstract_programs`` compiles and the planner's table row sizes): for several num_pages, page_size,
    max_num_seqs and cache dtypes, its arrays have those shapes, dtypes and bytes, hand-counted."""
    from grpax.sampler import paging
    from grpax.sharding import per_chip_bytes

    L, K, H, pages_per_row = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, -(-(16 + C) // 4)
    for keys, pages in [
        (dict(page_size=4), 1 + 6 * pages_per_row),  # every slot (num_slots=6) holds P + C = 28 tokens
        (dict(page_size=4, max_num_seqs=3), 1 + 3 * pages_per_row),  # max_num_seqs slots
        (dict(page_size=8, num_pages=11, cache_dtype="bfloat16"), 11),  # num_pages as given
        (dict(page_size=2, num_pages=40), 40),
    ]:
        sc = _sc(backend=backend, **keys)
        built = Engine(params, CFG, sc, num_slots=6)
        assert built.pool.num_pages == paging.pool_pages(sc, built.num_slots) == pages, keys
        planned = paging.abstract_pool(params, CFG, sc, built.backend, pages)
        real = jax.tree.leaves(built.pages)
        assert [(x.shape, x.dtype) for x in real] == [(x.shape, x.dtype) for x in jax.tree.leaves(planned)]
        itemsize = 2 if "cache_dtype" in keys else 4
        hand = L * pages * sc.page_size * 2 * K * H * itemsize  # k and v of every page, every layer
        assert sum(x.nbytes for x in real) == per_chip_bytes(planned) == hand, keys


# Per-request settings (Engine.submit): each rule's keyword arguments; the engine's own rule is temperature 1.0.
RULES = [
    dict(temperature=0.7),
    dict(greedy=True),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(),
]


def test_a_row_in_a_batch_of_mixed_rules_samples_what_a_batch_all_of_its_rule_samples(params):
    """Requests of five sampling rules share one engine (one prefill, the same decode calls): each row gets the
    tokens it gets when its whole batch uses its rule (same key, same row ids): bit for bit against such a batch
    (through the same per-row program), and token for token against ``generate`` with the rule as the engine's
    (its static program; the logprobs there may differ in the last float32 bit: XLA fuses a static temperature's
    scaling differently). ``tests/test_sampling.py`` compares the two programs' sampling on many more rules."""
    sc = _sc(greedy=False, temperature=1.0, num_pages=64)  # room for every row at once
    engine = Engine(params, CFG, sc, num_slots=len(RULES) * len(PROMPTS))
    mixed = [engine.submit(PROMPTS, jax.random.key(10 + i), **rule) for i, rule in enumerate(RULES)]
    engine.run()
    assert engine.stats["prefills"] == 1  # every request's prompts in one prefill, then the same decode calls
    outs = [request.output(0) for request in mixed]
    uniform = Engine(params, CFG, sc, num_slots=len(PROMPTS))
    for i, (rule, out) in enumerate(zip(RULES, outs, strict=True)):
        request = uniform.submit(PROMPTS, jax.random.key(10 + i), **rule)
        uniform.run()
        _same(out, request.output(0))
    # temperature 1.3 with top-k 5: the static program scales by a constant and takes lax.top_k's threshold
    static = generate(params, PROMPTS, CFG, _sc(greedy=False, **RULES[2]), jax.random.key(12))
    np.testing.assert_array_equal(outs[2].completion_ids, static.completion_ids)
    np.testing.assert_allclose(outs[2].logprobs, static.logprobs, rtol=0, atol=2e-6)
    # the rules really sample differently: the greedy rows are the full forward's argmax, the others depart
    greedy = outs[1].completion_ids
    for i, prompt in enumerate(PROMPTS):
        np.testing.assert_array_equal(greedy[i], _full_logits(params, prompt, greedy[i]).argmax(-1))
    assert all((out.completion_ids != greedy).any() for out in outs[:1] + outs[2:])
    # the top-k 5 rows drew among their 5 most likely tokens, with the logprobs of those 5 renormalised
    for i, prompt in enumerate(PROMPTS):
        chosen = outs[2].completion_ids[i]
        scaled = _full_logits(params, prompt, chosen) / 1.3
        kept = scaled >= np.sort(scaled, axis=-1)[:, -5:-4]
        assert kept[np.arange(C), chosen].all()
        filtered = _log_softmax(np.where(kept, scaled, -np.inf))
        np.testing.assert_allclose(outs[2].logprobs[i], filtered[np.arange(C), chosen], atol=1e-4)


def test_each_request_ends_at_its_own_max_completion_length_in_a_shared_batch(params):
    """A request of 5 tokens per row and one of the engine's 12, with the same key, decode together: the short
    rows end at 5 ("length"), each the first 5 tokens (and logprobs) of its 12-token twin; the others run to 12,
    the rollout ``generate`` samples."""
    sc = _sc(greedy=False, temperature=1.0)
    engine = Engine(params, CFG, sc, num_slots=2 * len(PROMPTS))
    short = engine.submit(PROMPTS, jax.random.key(3), max_completion_length=5)
    full = engine.submit(PROMPTS, jax.random.key(3))
    engine.run()
    a, b = short.output(0), full.output(0)
    assert a.completion_ids.shape == (4, 5) and b.completion_ids.shape == (4, C)
    np.testing.assert_array_equal(a.lengths, 5)
    np.testing.assert_array_equal(b.lengths, C)
    assert a.finish_reason == b.finish_reason == ["length"] * 4
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids[:, :5])
    _same_logprobs(a.logprobs, b.logprobs[:, :5])
    _same(b, generate(params, PROMPTS, CFG, sc, jax.random.key(3)))


def test_new_sampling_rules_and_length_limits_compile_nothing(params):
    """Rules and limits are data: after one request of a rule other than the engine's, requests of new
    temperatures, top-k / top-p, greedy and shorter limits run the programs already compiled."""
    engine = Engine(params, CFG, _sc(greedy=False, temperature=1.0), num_slots=len(PROMPTS))
    engine.run(engine.submit(PROMPTS, jax.random.key(0), temperature=0.5))
    compiles = []

    def count(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        rules = [
            dict(temperature=0.8),
            dict(greedy=True),
            dict(temperature=1.7, top_k=3, top_p=0.9),
            dict(temperature=0.3, top_p=0.5, max_completion_length=4),
        ]
        for i, rule in enumerate(rules):
            request = engine.submit(PROMPTS, jax.random.key(i), **rule)
            engine.run(request)
            assert request.done
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []


def test_max_prefill_prompts_admits_a_step_in_calls_of_that_many_with_the_same_rollout(
    params, prefill_counts
):
    """max_prefill_prompts=1: the 4 prompts enter in 4 one-prompt prefills of the same step (no prefill of 4 or
    2 prompts), and the rollout is the uncapped engine's."""
    seen = prefill_counts
    outs = []
    for cap in (0, 1):
        engine = Engine(params, CFG, _sc(max_prefill_prompts=cap, num_pages=40), num_slots=len(PROMPTS))
        request = engine.submit(PROMPTS, jax.random.key(3))
        engine.step()
        assert not engine.waiting()  # every prompt entered in the first step
        engine.run(request)
        outs.append(request.output(0, engine.prompt_width(PROMPTS), C))
    assert seen == [4, 1, 1, 1, 1]
    _same(*outs)
    with pytest.raises(ValueError, match="max_prefill_prompts=-1 must be >= 0"):
        _sc(max_prefill_prompts=-1)


def test_rules_as_data_runs_the_default_rules_rows_on_the_other_rules_program(params):
    """rules_as_data: rows of the engine's own rule and rows of another rule share one program per shape (the
    adaptive set's default compiles a second, static one), with the same tokens as that static program."""
    compiles = []

    def count(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    outs = []
    for as_data in (False, True):
        sc = _sc(greedy=False, temperature=1.0, programs="adaptive", rules_as_data=as_data)
        engine = Engine(params, CFG, sc, num_slots=len(PROMPTS))
        engine.run(engine.submit(PROMPTS, jax.random.key(0), temperature=0.5))
        jax.monitoring.register_event_duration_secs_listener(count)
        try:
            request = engine.submit(PROMPTS, jax.random.key(1))  # the engine's own rule
            engine.run(request)
        finally:
            jax.monitoring.unregister_event_duration_listener(count)
        outs.append((request.output(0, engine.prompt_width(PROMPTS), C), len(compiles)))
    (static, compiled_static), (as_data, compiled_as_data) = outs
    assert compiled_static >= 2 and compiled_as_data == compiled_static  # the static prefill and decode only
    np.testing.assert_array_equal(static.completion_ids, as_data.completion_ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(max_completion_length=C + 1),
            f"max_completion_length={C + 1}: expected an integer in 1..{C} tokens",
        ),
        (dict(max_completion_length=0), f"max_completion_length=0: expected an integer in 1..{C} tokens"),
        (dict(max_completion_length=2.5), f"max_completion_length=2.5: expected an integer in 1..{C} tokens"),
        (dict(temperature=0.0), "temperature=0.0 must be > 0 (use greedy=true for argmax)"),
        (dict(temperature=-1.0), "temperature=-1.0 must be > 0 (use greedy=true for argmax)"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(top_k=-1), "top_k=-1 must be >= 0"),
        (dict(top_k=2.5), "top_k=2.5 must be an integer"),
        (dict(prompt_indices=[0]), f"prompt_indices has 1 entries for {len(PROMPTS)} prompts"),
    ],
)
def test_bad_per_request_settings_are_refused_in_one_line_and_queue_nothing(params, kwargs, message):
    engine = Engine(params, CFG, _sc(greedy=False), num_slots=4)
    with pytest.raises(ValueError) as e:
        engine.submit(PROMPTS, jax.random.key(0), **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert not engine.busy


@pytest.mark.parametrize("backend", BACKENDS)
def test_hbm_utilization_sizes_the_pool_from_device_memory(params, backend, monkeypatch):
    """hbm_utilization (the key hbm_utilization_vllm): the pool takes the pages that fit in the fraction of the
    device's memory left after the params (hand count: 2 layers x page_size 4 x 2 x 2 kv heads x head_dim 8 x 4
    bytes = 1 KiB a page), at most the num_pages=0 pool; the same rollouts; a fraction that leaves less than one
    sequence, and a device that reports no memory size (this CPU), are refused naming the key and the fix."""
    import gc
    import weakref

    import grpax.sampler.paging as paging

    monkeypatch.setattr(paging, "LIVE_ENGINES", weakref.WeakSet())  # no other test's engines
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    page = 2 * 4 * 2 * 2 * 8 * 4
    sc = _sc(page_size=4, max_num_seqs=3, hbm_utilization=0.5, backend=backend)
    with pytest.raises(ValueError, match=r"hbm_utilization_vllm=0.5: the cpu devices report no memory size; size "
                       r"the KV pool with num_pages instead"):  # fmt: skip
        Engine(params, CFG, sc)
    full = generate(params, PROMPTS, CFG, dataclasses.replace(sc, hbm_utilization=0.0), jax.random.key(3))
    for room_pages, expected in ((12.5, 12), (1000, 1 + 3 * 7)):  # 7 pages of 4 hold 16 + 12 tokens
        limit = int((weights + room_pages * page) / 0.5)
        monkeypatch.setattr(paging, "bytes_limit", lambda device, limit=limit: limit)
        engine = Engine(params, CFG, sc)
        assert engine.pool.num_pages == expected
        request = engine.submit(PROMPTS, jax.random.key(3))
        engine.run(request)
        _same(request.output(sc.pad_token_id, sc.bucket_for(7), C), full)
    del engine, request
    gc.collect()
    # an engine alive holds its pool: the next one's room leaves it out (a kept rollout engine, an evaluation's)
    monkeypatch.setattr(paging, "bytes_limit", lambda device: int((weights + 30.5 * page) / 0.5))
    kept = Engine(params, CFG, sc)
    assert kept.pool.num_pages == 1 + 3 * 7 and Engine(params, CFG, sc).pool.num_pages == 8  # 30.5 - 22 pages
    del kept
    gc.collect()
    monkeypatch.setattr(paging, "bytes_limit", lambda device: int((weights + 7.9 * page) / 0.5))
    with pytest.raises(ValueError, match=r"hbm_utilization_vllm=0.5: the KV pool gets 0.00 GiB per device after "
                       r"the params, 7 pages of 4 tokens, fewer than one sequence of 28 tokens needs \(8\); raise "
                       r"it, or pass num_pages"):  # fmt: skip
        Engine(params, CFG, sc)
    with pytest.raises(
        ValueError, match="num_pages=30 and hbm_utilization=0.5 both size the KV pool: pass one"
    ):
        dataclasses.replace(sc, num_pages=30)


def test_the_largest_prefill_is_the_groups_that_fill_the_decode_slots(params, monkeypatch):
    """prefill_prompts: with max_num_seqs slots the engine starts the groups that fill them, so its largest
    prefill (and the one abstract_programs compiles and the planner sizes) is that many prompts, not the batch."""
    import grpax.sampler.engine as engine_module
    from grpax.sampler.backend import select_backend
    from grpax.sampler.keys import prefill_prompts
    from grpax.sampler.program_set import abstract_programs

    sc = _sc(backend="xla")
    assert prefill_prompts(sc, 8, 2) == 8 and prefill_prompts(sc, 5, 3) == 8  # every prompt, a power of two
    assert prefill_prompts(dataclasses.replace(sc, max_num_seqs=4), 8, 2) == 2  # two groups of 2 fill 4 slots
    assert (
        prefill_prompts(dataclasses.replace(sc, max_num_seqs=5), 4, 2) == 4
    )  # a third group starts in slot 5
    # pages beyond the default pool: the admission's reserve for the running rows' growth never binds here
    narrow = dataclasses.replace(sc, max_num_seqs=5, num_pages=64)
    seen = []
    real = engine_module.compiled_admit

    def spy(backend):
        fn = real(backend)
        return lambda *args, **kwargs: seen.append(args[2].shape[0]) or fn(*args, **kwargs)

    monkeypatch.setattr(engine_module, "compiled_admit", spy)
    engine = Engine(params, CFG, narrow)
    engine.run(engine.submit(PROMPTS, jax.random.key(0), 2))  # 4 prompts x 2 in 5 slots
    assert max(seen) == prefill_prompts(narrow, len(PROMPTS), 2) == 4
    backend = select_backend("xla", params, CFG, None, True)
    programs = abstract_programs(params, CFG, narrow, backend, 16, 2)
    assert programs["prefill"][1][2].shape == (4, narrow.max_prompt_length)  # not 16 prompts


def test_a_memory_fraction_on_a_device_without_a_memory_size_is_refused_before_the_model_loads(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """hbm_utilization_vllm on this CPU (no bytes_limit) stopped train_rl only when its engine was built, after
    the model's load; now before it (the load is never reached), in the same words."""
    from conftest import tiny_run_keys

    from grpax.errors import ConfigError
    from grpax.rl import trainer
    from grpax.rl.train_config import TrainConfig

    monkeypatch.setattr(trainer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = TrainConfig(**tiny_run_keys(tiny_checkpoint, tmp_path / "out", hbm_utilization_vllm=0.5))
    with pytest.raises(
        ConfigError, match=r"^hbm_utilization_vllm=0.5: the cpu devices report no memory size; "
    ):
        trainer.train(cfg)


def test_generate_sizes_its_slots_and_pool_from_its_rows_not_a_larger_max_num_seqs(params, monkeypatch):
    # grpax generate max_num_seqs=100000 batch_size=4 allocated 100000 slots' pages (the OOM killer, no message)
    import grpax.sampler.scheduler as scheduler

    pools = []
    real = scheduler.PagePool
    monkeypatch.setattr(scheduler, "PagePool", lambda n: pools.append(n) or real(n))
    prompts = [[3, 4, 5], [6, 7]]
    wide = generate(params, prompts, CFG, _sc(max_num_seqs=100_000), jax.random.key(1), 2)
    assert pools == [1 + 4 * _sc().pages_per_sequence()]  # 2 prompts x 2 completions
    exact = generate(params, prompts, CFG, _sc(), jax.random.key(1), 2)
    np.testing.assert_array_equal(wide.completion_ids, exact.completion_ids)


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            dict(max_num_seqs=100_000),
            r"^max_num_seqs=100000: the KV pool of 100000 decode slots of 28 tokens needs \d+ MiB, more than the 4 MiB",
        ),
        (
            dict(num_pages=10**9),
            r"^num_pages=1000000000: the KV pool needs [\d.]+ GiB, more than the 4 MiB",
        ),
    ],
)
def test_a_pool_the_host_cannot_hold_is_refused_in_one_line_before_it_is_allocated(
    params, monkeypatch, keys, message
):
    import grpax.sampler.engine as engine_module
    import grpax.sampler.paging as paging

    monkeypatch.setattr(paging, "available_host_bytes", lambda: 4 << 20)
    monkeypatch.setattr(engine_module, "compiled_zeros", lambda *a: pytest.fail("the pool was allocated"))
    for held in (params, jax.tree.map(np.asarray, params)):  # on the device, or numpy (a server's load)
        with pytest.raises(ValueError, match=message) as e:
            Engine(held, CFG, _sc(**keys))
        assert "\n" not in str(e.value) and "of host memory available; pass " in str(e.value)
