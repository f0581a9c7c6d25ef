"""LoRA GRPO (``grpax.models.lora``, ``grpax.rl.policy``): adapters on a frozen base that is also the reference.

Tiny random Llamas on CPU: the adapted model at initialisation computes the base's logits exactly, the merged
weights compute what the adapters compute, a step changes only the adapters, the reference is the base, the toy
task is learned, a resume is bit-exact and refused on another base, and the PEFT export loads in ``peft``.
"""

import contextlib
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import kill_at_call, tiny_run_keys

from grpax.checkpoint.orbax import restore_params, save_params
from grpax.config import ConfigError, build_config
from grpax.models import lora as lora_lib
from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl import trainer
from grpax.rl.batch import Batch
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import optimizer_from_config
from grpax.rl.policy import Policy
from grpax.rl.resume import RunPaths
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import TrainState, accumulate_gradients, compute_logprobs, make_train_step
from grpax.rl.trainer import train


def _cfg(**kw):
    return ModelConfig(
        vocab_size=64,
        hidden_dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        tie_word_embeddings=False,
        **kw,
    )


def _trained_like(adapters, seed=3, std=0.05):
    """Adapters moved off their initialisation (B nonzero), as training would."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten(
        [x + std * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )


@pytest.mark.parametrize("scan_layers", [True, False])
def test_at_init_the_adapted_model_computes_the_base_logits_exactly(scan_layers):
    cfg = _cfg(scan_layers=scan_layers)
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    want, _ = forward(base, tokens, cfg)
    got, _ = forward(lora_lib.apply(base, adapters, lora), tokens, cfg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # B = 0: x@W + 0, bit for bit
    np.testing.assert_array_equal(
        np.asarray(forward(lora_lib.merge(base, adapters, lora), tokens, cfg)[0]), want
    )


def test_adapters_are_initialised_as_peft():
    cfg = _cfg()
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))["layers"]
    assert (
        lora.scale == 2.0 and lora_lib.LoraConfig(4, 8.0, use_rslora=True).scale == 4.0
    )  # alpha/r, /sqrt(r)
    # A [L, in..., r] ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)); B [L, r, out...] = 0
    shapes = {
        "wq": ((2, 32, 4), (2, 4, 4, 8)),
        "wk": ((2, 32, 4), (2, 4, 2, 8)),
        "wo": ((2, 4, 8, 4), (2, 4, 32)),
    }
    shapes |= {"w_gate": ((2, 32, 4), (2, 4, 48)), "w_down": ((2, 48, 4), (2, 4, 32))}
    for name, (a_shape, b_shape) in shapes.items():
        a, b = np.asarray(adapters[name]["a"]), np.asarray(adapters[name]["b"])
        assert a.shape == a_shape and b.shape == b_shape, name
        fan_in = 32 if name == "wo" else a_shape[1]
        assert np.abs(a).max() <= 1 / np.sqrt(fan_in) and np.abs(a).max() > 0.8 / np.sqrt(fan_in), name
        assert not b.any()
    axes = lora_lib.adapter_logical_axes(cfg, lora)["layers"]
    assert axes["wq"] == {"a": ("layers", "embed", None), "b": ("layers", None, "q_heads", "head_dim")}
    assert axes["wo"] == {"a": ("layers", "q_heads", "head_dim", None), "b": ("layers", None, "embed")}
    assert axes["w_down"] == {"a": ("layers", "mlp", None), "b": ("layers", None, "embed")}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_merged_weights_compute_what_the_adapters_compute(scan_layers):
    """float32: the merged weight W + s*A@B is rounded once to float32 and the forward then sums D = 32..48
    products per dot, where the adapted forward sums x@W and s*(x@A)@B separately. Both are float32 evaluations
    of the same real number, so they differ by a few ulps of the logits (|logits| < 3 here): 1e-5 is about
    30 float32 ulps at 3, 30 000 times below the adapters' own effect on the logits (> 0.3)."""
    cfg = _cfg(scan_layers=scan_layers)
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0, use_rslora=True)
    adapters = _trained_like(lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    applied, _ = forward(lora_lib.apply(base, adapters, lora), tokens, cfg)
    merged, _ = forward(lora_lib.merge(base, adapters, lora), tokens, cfg)
    plain, _ = forward(base, tokens, cfg)
    assert float(jnp.abs(applied).max()) < 3
    np.testing.assert_allclose(np.asarray(merged), np.asarray(applied), rtol=0, atol=1e-5)
    assert float(jnp.abs(applied - plain).max()) > 0.3
    # merge by hand for one weight: W + scale * A @ B
    w = np.asarray(base["layers"]["wq"] if scan_layers else base["layers"][1]["wq"])
    ad = adapters["layers"]["wq"] if scan_layers else adapters["layers"][1]["wq"]
    a, b = (np.asarray(ad[k], np.float64) for k in ("a", "b"))
    want = w + lora.scale * (
        np.einsum("ldr,lrnh->ldnh", a, b) if scan_layers else np.einsum("dr,rnh->dnh", a, b)
    )
    merged_w = lora_lib.merge(base, adapters, lora)["layers"]
    merged_w = merged_w["wq"] if scan_layers else merged_w[1]["wq"]
    np.testing.assert_allclose(np.asarray(merged_w), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_adapters_sampler_decodes_what_the_merged_sampler_decodes(scan_layers):
    """``lora_sampler=adapters`` (``lora.apply``: the XLA backend's prefill and decode on LoraWeight leaves,
    each layer sliced inside the decode step) against ``merged`` (``lora.merge``), greedy, float32: the same
    tokens, and logprobs within 1e-5 nats. Why 1e-5: the two forwards' logits differ by a few float32 ulps (one
    rounding of W + s A B against two sums; ``test_merged_weights_compute_what_the_adapters_compute`` bounds
    them by 1e-5 at |logits| < 3), a log-softmax adds at most twice its input's error, and the cached keys and
    values carry the same few-ulp differences into later steps (measured: 7e-7 and 5e-7 nats); the adapters' own
    effect on these logprobs is over 1000 times the bound (0.12-0.13 nats, checked)."""
    got, want, plain = sampler_rollouts(scan_layers)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    assert np.abs(got.logprobs - plain.logprobs).max() > 1000 * 1e-5


def sampler_rollouts(scan_layers: bool, base_dtype: str = ""):
    """Greedy rollouts of one LoRA policy (trained-like rank-4 adapters; QLoRA's base quantised to
    ``base_dtype``) by the adapters sampler, the merged sampler, and the base alone (the adapters off)."""
    from grpax.sampler.backend import select_backend
    from grpax.sampler.engine import generate
    from grpax.sampler.keys import SamplerConfig

    cfg = _cfg(scan_layers=scan_layers)
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = _trained_like(lora_lib.init_adapters(cfg, lora, jax.random.key(1)), std=0.1)
    merged_policy = Policy(lora, base, base_dtype=base_dtype, sampler="merged")
    adapters_policy = Policy(lora, base, base_dtype=base_dtype, sampler="adapters")
    assert Policy(lora, base).sampler == "merged"  # auto on CPU devices
    applied = adapters_policy.sampler_params(adapters)
    assert isinstance(
        applied["layers"]["wq"] if scan_layers else applied["layers"][0]["wq"], lora_lib.LoraWeight
    )
    sc = SamplerConfig(
        max_prompt_length=8, max_completion_length=12, greedy=True, decode_phase_length=6, backend="auto"
    )
    assert select_backend("auto", applied, cfg).name == "xla"  # the C++ kernels take plain weights only
    with pytest.raises(ValueError, match="plain weights only"):
        select_backend("cpu", applied, cfg)
    prompts = [[3, 9, 1, 4], [5, 2, 6, 5, 3, 5, 8], [9, 7]]
    key = jax.random.key(4)
    got = generate(applied, prompts, cfg, sc, key, num_generations=2)
    want = generate(merged_policy.sampler_params(adapters), prompts, cfg, sc, key, num_generations=2)
    plain = generate(adapters_policy.base, prompts, cfg, sc, key, num_generations=2)
    return got, want, plain


def _adapters_at(adapters, lora, base, ratio):
    """``adapters`` with B rescaled so that every adapted weight's |s B A| / |W| (Frobenius) is ``ratio``."""
    merged = lora_lib.merge(base, adapters, lora)["layers"]

    def scaled(name, pair):
        w = base["layers"][name]
        factor = ratio * jnp.linalg.norm(w) / jnp.linalg.norm(merged[name] - w)
        return {"a": pair["a"], "b": pair["b"] * factor}

    return {"layers": {name: scaled(name, pair) for name, pair in adapters["layers"].items()}}


def _effective_delta(weight, base_weight, dtype):
    """What a sampler's weight adds to the base's once cast to the compute ``dtype`` as the forward casts it
    (float32 [in, out]): a plain (merged) weight's rounded sum minus the rounded base, or a ``LoraWeight``'s
    s A B from its rounded adapters (kept apart from W, as the update computes it)."""
    if isinstance(weight, lora_lib.LoraWeight):
        w = weight.astype(dtype).reshape(weight.shape[0], -1)
        return weight.scale * (w.a.astype(jnp.float32) @ w.b.astype(jnp.float32))
    rounded = lambda x: x.astype(dtype).astype(jnp.float32).reshape(x.shape[0], -1)  # noqa: E731
    return rounded(weight) - rounded(base_weight)


@pytest.mark.parametrize("ratio", [7e-5, 7e-4])
def test_a_merged_bfloat16_sampler_loses_the_adapters_update_and_auto_picks_the_adapters(ratio):
    """Issue 40 item 3: with bfloat16 compute the merged sampler's weight is W + s B A rounded to bfloat16, whose
    ulp at |W| is far above a young adapter's s B A (|s B A| / |W| = ``ratio``): the update it samples with is
    mostly rounding error, while the adapters sampler keeps s B A apart from W, as the update does. Measured on
    layer 0's q projection: the error of the update each sampler applies, relative to s B A itself."""
    cfg = _cfg()
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = _adapters_at(
        _trained_like(lora_lib.init_adapters(cfg, lora, jax.random.key(1))), lora, base, ratio
    )
    layer0 = lambda x: jax.tree.map(lambda leaf: leaf[0], x)  # noqa: E731
    w = layer0(base["layers"]["wq"])
    exact = (layer0(lora_lib.merge(base, adapters, lora)["layers"]["wq"]) - w).reshape(w.shape[0], -1)

    def relative_error(sampler: str) -> float:
        policy = Policy(lora, base, sampler=sampler, model_cfg=cfg.replace(dtype="bfloat16"))
        weight = layer0(policy.sampler_params(adapters)["layers"]["wq"])
        delta = _effective_delta(weight, w, jnp.bfloat16)
        return float(jnp.linalg.norm(delta - exact) / jnp.linalg.norm(exact))

    merged, kept = relative_error("merged"), relative_error("adapters")
    # most of the update is lost: W is held rounded to bfloat16 (lora.frozen_base), and W + s B A rounds back
    # to it wherever |s B A| is under half an ulp (0.98 and 0.84 of it at these ratios; from a float32 W the
    # sum also flipped roundings, 7x and 2x the update)
    assert merged > 0.5, merged
    assert kept < 0.01, kept  # bfloat16's rounding of A and B only
    assert Policy(lora, base, model_cfg=cfg.replace(dtype="bfloat16")).sampler == "adapters"  # auto, 16-bit compute
    assert Policy(lora, base, model_cfg=cfg.replace(dtype="float16")).sampler == "adapters"
    assert Policy(lora, base, model_cfg=cfg.replace(dtype="float32")).sampler == "merged"  # auto on CPU in float32
    print(
        f"|sBA|/|W| = {ratio:g}: merged bf16 sampler's error {merged:.3g}x the update, adapters {kept:.3g}x"
    )


def test_a_misspelled_target_module_is_one_line():
    cfg = build_config(TrainConfig, ["lora_rank=4", "lora_target_modules=[q_proj,v_prj]"])
    with pytest.raises(ConfigError) as e:
        cfg.lora()
    msg = str(e.value)
    assert "\n" not in msg and "'v_prj'" in msg
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in msg
    # MaxText's SFT LoRA spellings are aliases
    maxtext = build_config(TrainConfig, ["lora.lora_rank=8", "lora.lora_alpha=16"])
    assert maxtext.lora() == lora_lib.LoraConfig(8, 16.0)
    assert build_config(TrainConfig, []).lora() is None  # lora_rank=0: the full fine-tune


def _batch(cfg, m=2, G=4, P=5, C=6, seed=0):
    rng = np.random.default_rng(seed)
    return Batch(
        prompt_ids=jnp.asarray(rng.integers(1, cfg.vocab_size, (m, P)), jnp.int32),
        prompt_mask=jnp.ones((m, P), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(1, cfg.vocab_size, (m * G, C)), jnp.int32),
        completion_mask=jnp.ones((m * G, C), jnp.int32),
        advantages=jnp.asarray(rng.normal(size=m * G), jnp.float32),
    )


def test_a_lora_step_changes_only_the_adapters_and_only_they_have_optimizer_state():
    cfg = _cfg()
    base = init_params(cfg, jax.random.key(0))
    base_copy = jax.tree.map(np.array, base)
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
    grpo = GRPOConfig(num_generations=4, beta=0.0, learning_rate=1e-2, warmup_ratio=0.0, weight_decay=0.0)
    optimizer, schedule = optimizer_from_config(grpo, 4)
    opt_state = optimizer.init(adapters)
    # AdamW's mu and nu mirror the adapters (plus scalar counts): nothing base-sized
    big = [x.shape for x in jax.tree.leaves(opt_state) if x.size > 4 * 48 * 2]
    assert all(any(s == a.shape for a in jax.tree.leaves(adapters)) for s in big)
    state = TrainState(params=adapters, opt_state=opt_state, step=jnp.zeros((), jnp.int32))
    step = make_train_step(cfg, grpo, optimizer, 1, schedule, lora=lora, base=base)
    before = jax.tree.map(np.array, adapters)
    for i in range(2):
        state, metrics = step(state, _batch(cfg, seed=i))
        assert not bool(metrics["nonfinite"])
    for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(base_copy), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # the frozen base: not donated, not changed
    changed = [
        not np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True)
    ]
    assert all(changed)  # every A and B moved (A from the second step on: its first gradient has B = 0)
    assert jax.tree.structure(state.params) == jax.tree.structure(before)


def test_the_reference_is_the_base_itself_with_the_adapters_off(tmp_path):
    """beta > 0 with LoRA: the reference pass reads the base's very arrays (no copy, no file) and its logprobs
    are the base model's, not the adapted policy's."""
    cfg = _cfg()
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = _trained_like(lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
    grpo = GRPOConfig(num_generations=4, beta=0.04)
    with contextlib.ExitStack() as closing:
        run = _run_cfg(tmp_path, beta=grpo.beta)
        ref = trainer._reference(run, base, cfg, RunPaths.of(run), closing, frozen=True)
        assert ref.folder is None and all(
            a is b for a, b in zip(jax.tree.leaves(ref._params), jax.tree.leaves(base), strict=True)
        )
        batch = _batch(cfg)
        ref_logprobs = ref.apply(compute_logprobs, batch, cfg, 1.0, 1)
    np.testing.assert_array_equal(
        np.asarray(ref_logprobs), np.asarray(compute_logprobs(base, batch, cfg, 1.0))
    )
    policy = compute_logprobs(lora_lib.apply(base, adapters, lora), batch, cfg, 1.0)
    assert float(jnp.abs(policy - ref_logprobs).max()) > 0.1


def _run_cfg(tmp_path, **kw):
    return TrainConfig(load_parameters_path=str(tmp_path), base_output_directory=str(tmp_path), **kw)


def test_resuming_on_another_base_is_refused_in_one_line():
    cfg = _cfg()
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    policy = Policy(lora, init_params(cfg, jax.random.key(0)), "/models/a/0/items")
    meta = policy.meta()
    assert (
        meta["lora"]["base_fingerprint"] == Policy(lora, init_params(cfg, jax.random.key(0))).base_fingerprint
    )
    policy.check_resume(meta, "run/checkpoints/actor/2")  # the same base: accepted
    other = Policy(lora, init_params(cfg, jax.random.key(1)), "/models/b/0/items")
    with pytest.raises(ConfigError) as e:
        other.check_resume(meta, "run/checkpoints/actor/2")
    assert (
        "\n" not in str(e.value)
        and "/models/a/0/items" in str(e.value)
        and "/models/b/0/items" in str(e.value)
    )
    with pytest.raises(ConfigError, match="holds LoRA adapters but lora_rank=0"):
        Policy().check_resume(meta, "run/checkpoints/actor/2")


def test_the_peft_export_loads_in_peft_and_computes_grpax_logits(tmp_path):
    """transformers + peft on the exported adapter folder == grpax's merged forward, on a tiny random Llama 3
    (GQA, head_dim != D / N, untied): 1e-4 is the bound test_model_parity holds grpax and transformers to in
    float32 for the base model alone."""
    torch = pytest.importorskip("torch")
    peft_lib = pytest.importorskip("peft")
    from test_model_parity import CONFIGS, _grpax, _hf_logits, _hf_model

    from grpax.checkpoint.peft import save_peft

    model = _hf_model(CONFIGS["gqa_untied_llama3"])
    base, cfg = _grpax(model, scan_layers=True)
    lora = lora_lib.LoraConfig(
        rank=4, alpha=16.0, target_modules=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj")
    )
    adapters = _trained_like(lora_lib.init_adapters(cfg, lora, jax.random.key(1)), std=0.2)
    meta = {"rank": 4, "alpha": 16.0, "target_modules": list(lora.target_modules), "use_rslora": False}
    assert save_peft(adapters, cfg, meta, tmp_path / "adapter") == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 30))
    plain = _hf_logits(model, tokens)
    adapted = peft_lib.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = adapted(torch.tensor(tokens)).logits.numpy()
    want = np.asarray(forward(lora_lib.merge(base, adapters, lora), tokens, cfg)[0])
    assert np.abs(got - want).max() <= 1e-4
    assert np.abs(plain - want).max() > 0.05  # the adapters matter


def test_lora_grpo_raises_reward_on_the_toy_task(tmp_path):
    """tests/test_learning.py's count-on task with the embeddings and the head frozen: the adapters alone take
    the mean reward from under 0.25 to over 0.6, as the full fine-tune does.

    The base's head and embeddings are scaled up from the init's std 0.02 (to 0.5 and 1.0), as a trained
    model's are: with the init's head every logit stays within about +-0.6 nats, so no adapter can make the right
    token likely (measured: 0.06 -> 0.06); with the head at std 0.2 the adapters plateau near 0.5 (0.44-0.55 over
    lr 0.005-0.02, rank 8-32, 50-80 steps); at std 0.5, 0.02 -> 0.65 (the MLP's three modules alone: 0.74).
    """
    curve, kls = toy_lora_run(tmp_path, lora_lib.LoraConfig(rank=16, alpha=32.0))
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    print(
        f"LoRA toy reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}, kl {kls[0]:.2e} -> {kls[-1]:.3f}"
    )
    assert first < 0.25
    assert (
        kls[0] < 1e-6 < kls[-1]
    )  # the reference is the base: KL 0 at the start, growing as the adapters learn
    assert last > 0.6, curve


def toy_lora_run(tmp_path, lora, base_dtype: str = "", num_steps: int = 50):
    """50 GRPO steps of tests/test_learning.py's count-on task trained by adapters only (``lora``; QLoRA's base
    quantised to ``base_dtype``); returns the per-step mean rewards and KLs. The base's head and embeddings are
    scaled up as the docstring above explains; the reference is ``Policy.base``."""
    from test_learning import V, toy_rows, toy_scorer, toy_task

    from grpax.models.quantize import QuantizedWeight
    from grpax.rl.rollout import Rollout
    from grpax.rl.train_step import make_update
    from grpax.rl.trainer import step_metrics
    from grpax.sampler.keys import SamplerConfig

    cfg = ModelConfig(
        vocab_size=V, hidden_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    grpo = GRPOConfig(
        num_generations=8, beta=0.04, learning_rate=1e-2, warmup_ratio=0.0, lr_schedule="constant",
        max_grad_norm=1.0, weight_decay=0.0, temperature=1.0,
    )  # fmt: skip
    base = init_params(cfg, jax.random.key(0))
    base = {**base, "lm_head": base["lm_head"] * 25, "embed": base["embed"] * 50}
    policy = Policy(lora, base, base_dtype=base_dtype)
    assert isinstance(policy.base["layers"]["wq"], QuantizedWeight) == bool(base_dtype)  # QLoRA: all seven
    optimizer, schedule = optimizer_from_config(grpo, num_steps)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
    state = TrainState(params=adapters, opt_state=optimizer.init(adapters), step=jnp.zeros((), jnp.int32))
    step = make_train_step(cfg, grpo, optimizer, 1, schedule, lora=lora, base=policy.base)
    update = make_update(step, grpo.num_iterations)
    sampler_cfg = SamplerConfig(max_prompt_length=8, max_completion_length=4, temperature=1.0, pad_token_id=0)
    rollout = Rollout(cfg, sampler_cfg, grpo, toy_scorer(toy_task(tmp_path)), reference=policy.base)
    rng = np.random.default_rng(0)
    curve, kls = [], []
    for i in range(num_steps):
        prompts = [rng.integers(1, V, size=rng.integers(3, 8)).tolist() for _ in range(8)]
        rollout.update_params(policy.sampler_params(state.params), i)
        batch = rollout(toy_rows(prompts), jax.random.key(i))
        state, update_metrics = update(state, batch)
        metrics = step_metrics(batch, update_metrics, {"time/train_s": 1.0, "time/step_s": 1.0})
        assert not metrics["nonfinite"]
        curve.append(metrics["rewards/total/mean"])
        kls.append(metrics["kl"])
    return curve, kls


def test_lora_gradients_are_the_full_gradient_projected():
    """dL/dB = s A^T dL/dW and dL/dA = s dL/dW B^T, with dL/dW the full fine-tune's gradient at the merged
    weights: the update trains the adapters by the chain rule, nothing else."""
    cfg = _cfg()
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0)
    adapters = _trained_like(lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
    grpo = GRPOConfig(num_generations=4, beta=0.0)
    batch = _batch(cfg)
    _, g_full, _ = jax.jit(lambda p: accumulate_gradients(p, batch, cfg, grpo))(
        lora_lib.merge(base, adapters, lora)
    )
    _, g_lora, _ = jax.jit(lambda a: accumulate_gradients(a, batch, cfg, grpo, 1, lora, base))(adapters)
    for name in lora.weights:
        g_w = np.asarray(g_full["layers"][name], np.float64)
        a = np.asarray(adapters["layers"][name]["a"], np.float64)
        b = np.asarray(adapters["layers"][name]["b"], np.float64)
        L, r = a.shape[0], a.shape[-1]
        a2, b2 = a.reshape(L, -1, r), b.reshape(L, r, -1)
        g2 = g_w.reshape(L, a2.shape[1], b2.shape[2])
        want_b = lora.scale * np.einsum("lir,lio->lro", a2, g2)
        want_a = lora.scale * np.einsum("lio,lro->lir", g2, b2)
        got_b = np.asarray(g_lora["layers"][name]["b"]).reshape(want_b.shape)
        got_a = np.asarray(g_lora["layers"][name]["a"]).reshape(want_a.shape)
        # float32 sums of the same products in another order: 1e-6 of the largest entry
        np.testing.assert_allclose(got_b, want_b, rtol=0, atol=1e-6 * np.abs(want_b).max())
        np.testing.assert_allclose(got_a, want_a, rtol=0, atol=1e-6 * np.abs(want_a).max())


@pytest.mark.slow
def test_lora_run_resumes_bit_exact_refuses_another_base_and_exports(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """``grpax train_rl ... lora_rank=4`` end to end: the checkpoint holds only the adapters, their optimizer
    state and the base's record; a run killed after step 2 and resumed ends with the same adapters, metrics
    and evaluation; other weights at the base's path are refused (resume and merged export); the merged and
    the PEFT exports compute the same logits in transformers."""
    shutil.copytree(tiny_checkpoint.parents[1], tmp_path / "base")
    ckpt = tmp_path / "base" / "0" / "items"
    from test_tasks_train import _data

    data = _data(tmp_path)  # six "Write the word ..." rows; rewarded by length, so the groups have spread
    (tmp_path / "length.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"
    )
    keys = dict(
        lora_rank=4,
        lora_alpha=8.0,
        learning_rate=1e-2,
        dataset_name=str(data),
        task="custom",
        prompt_field="instruction",
        answer_field="target",
        prompt_preset="plain",
        reward_functions_path=str(tmp_path / "length.py"),
        reward_functions=("length",),
    )
    full = train(TrainConfig(**tiny_run_keys(ckpt, tmp_path / "a", **keys)))
    step_dir = Path(full["actor_path"]).parent
    meta = json.loads((step_dir / "train_meta" / "metadata").read_text())
    assert meta["lora"]["base_path"] == str(ckpt) and meta["lora"]["rank"] == 4
    adapters = restore_params(full["actor_path"])
    assert set(adapters) == {"layers"} and set(adapters["layers"]["wq"]) == {"a", "b"}
    assert np.abs(np.asarray(adapters["layers"]["wq"]["b"])).max() > 0  # trained

    real_step = kill_at_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**tiny_run_keys(ckpt, tmp_path / "b", **keys)))
    monkeypatch.setattr(trainer, "_one_step", real_step)
    resumed = train(TrainConfig(**tiny_run_keys(ckpt, tmp_path / "b", **keys)))
    for a, b in zip(
        jax.tree.leaves(adapters), jax.tree.leaves(restore_params(resumed["actor_path"])), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed["reward_history"] == full["reward_history"]
    assert resumed["after"]["mean_reward"] == full["after"]["mean_reward"]

    from grpax.cli.main import main

    # Other weights at the base's path (a re-conversion): the resume and the merged export are refused.
    params = restore_params(ckpt)
    shutil.rmtree(ckpt)
    save_params(jax.tree.map(lambda x: x * 1.01, params), ckpt)
    with pytest.raises(ConfigError, match="adapters trained on the base") as e:
        train(TrainConfig(**tiny_run_keys(ckpt, tmp_path / "b", num_batches=4, **keys)))
    assert "\n" not in str(e.value)
    argv = ["to_huggingface", f"load_parameters_path={full['actor_path']}"]
    assert main([*argv, f"base_output_directory={tmp_path / 'x'}"]) == 2
    assert "trained on other weights" in capsys.readouterr().err
    shutil.rmtree(ckpt)
    save_params(params, ckpt)

    # Exports: the merged model, and the PEFT folder on the exported base, give the same logits.
    torch = pytest.importorskip("torch")
    peft_lib = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base_hf, merged_hf, peft_dir = tmp_path / "base_hf", tmp_path / "merged_hf", tmp_path / "peft"
    assert (
        main(
            [
                "to_huggingface",
                f"load_parameters_path={ckpt}",
                f"base_output_directory={base_hf}",
                "weight_dtype=float32",
            ]
        )
        == 0
    )
    for out, mode in ((merged_hf, "merged"), (peft_dir, "peft")):
        argv = [
            "to_huggingface",
            f"load_parameters_path={full['actor_path']}",
            f"base_output_directory={out}",
        ]
        assert main([*argv, "weight_dtype=float32", f"lora_export={mode}"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in peft_dir.iterdir()}
    tokens = torch.tensor(np.random.RandomState(0).randint(0, 1000, (2, 12)))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_hf).eval()(tokens).logits.numpy()
        base = AutoModelForCausalLM.from_pretrained(base_hf).eval()
        plain = base(tokens).logits.numpy()
        adapted = peft_lib.PeftModel.from_pretrained(base, str(peft_dir)).eval()(tokens).logits.numpy()
    assert np.abs(merged - adapted).max() <= 1e-4
    assert np.abs(merged - plain).max() > 1e-3  # the adapters were trained and exported


@pytest.mark.parametrize(
    "keys, named",
    [
        (["lora_alpha=32"], "lora_alpha=32.0 shapes LoRA adapters"),
        (["lora_target_modules=[q_proj]"], "lora_target_modules=['q_proj'] shapes"),
        (["use_rslora=true"], "use_rslora=True shapes"),
        (["lora_sampler=adapters"], "lora_sampler='adapters' shapes"),
        (["lora_alpha=32", "use_rslora=true"], "lora_alpha=32.0, use_rslora=True shape LoRA adapters"),
    ],
)
def test_lora_keys_without_lora_rank_are_refused_in_one_line(tmp_path, keys, named):
    """Issue 45: they were accepted silently with lora_rank=0 (a full fine-tune ran)."""
    from grpax.rl.train_config import validate

    cfg = build_config(TrainConfig, [f"load_parameters_path={tmp_path}", *keys])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith(named), message
    assert "but lora_rank=0 trains all the weights (the full fine-tune): set lora_rank > 0" in message
    validate(build_config(TrainConfig, [f"load_parameters_path={tmp_path}", "lora_rank=4", *keys]))


def test_duplicate_target_modules_and_a_rank_above_a_layers_width_are_refused():
    with pytest.raises(ConfigError, match=r"names 'q_proj' twice: name each module once"):
        lora_lib.LoraConfig(4, 8.0, ("q_proj", "v_proj", "q_proj"))
    cfg = _cfg()  # D 32, N*H 32, K*H 16, F 48: v_proj is 32 -> 16
    lora_lib.check_rank(lora_lib.LoraConfig(16, 8.0), cfg, "config.json")
    with pytest.raises(ConfigError) as e:
        lora_lib.check_rank(lora_lib.LoraConfig(17, 8.0), cfg, "config.json")
    assert str(e.value) == (
        "lora_rank=17 exceeds the width of k_proj (32 -> 16 in config.json): its update A @ B has rank at most "
        "16, so lora_rank <= 16 (or drop k_proj from lora_target_modules)"
    )
    lora_lib.check_rank(lora_lib.LoraConfig(32, 8.0, ("q_proj", "o_proj")), cfg, "config.json")


def test_a_rank_above_the_width_stops_train_rl_before_the_model_loads(tiny_checkpoint, tmp_path, capsys):
    from grpax.cli.main import main

    keys = tiny_run_keys(tiny_checkpoint, tmp_path, dataset_name="unused", lora_rank=64)
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 2
    err = capsys.readouterr().err
    assert "lora_rank=64 exceeds the width of k_proj (32 -> 16 in " in err, err
    assert not (tmp_path / "run").exists()


def test_a_resume_with_another_lora_alpha_or_use_rslora_is_refused(tmp_path):
    """Issue 45: a resume with lora_alpha 32 -> 512 rescaled the trained adapters 16x with only an INFO line;
    refused now by the run's config.json (before the model loads) and by the step's train_meta."""
    from grpax.rl.resume import check_resume, write_config

    saved = TrainConfig(**tiny_run_keys(tmp_path / "ckpt", tmp_path, dataset_name="unused", lora_rank=4))
    paths = RunPaths.of(saved)
    paths.run_dir.mkdir(parents=True)
    write_config(paths, saved)
    for change, listed in (
        ({"lora_alpha": 128.0}, "lora_alpha=8.0 (now 128.0)"),
        ({"use_rslora": True}, "use_rslora=False (now True)"),
    ):
        cfg = TrainConfig(
            **tiny_run_keys(tmp_path / "ckpt", tmp_path, dataset_name="unused", lora_rank=4, **change)
        )
        with pytest.raises(
            ConfigError, match=rf"was started with {re.escape(listed)}; a resumed run cannot change"
        ):
            check_resume(cfg, paths, 2)

    cfg = _cfg()
    base = init_params(cfg, jax.random.key(0))
    meta = Policy(lora_lib.LoraConfig(rank=4, alpha=8.0), base, "/models/a/0/items").meta()
    Policy(lora_lib.LoraConfig(rank=4, alpha=8.0), base, "/models/a/0/items").check_resume(meta, "actor/2")
    with pytest.raises(ConfigError) as e:
        Policy(lora_lib.LoraConfig(rank=4, alpha=128.0, use_rslora=True), base).check_resume(meta, "actor/2")
    assert str(e.value).startswith(
        "actor/2 holds adapters trained with lora_alpha=8.0 (now 128.0), use_rslora=False (now True): these set"
    )
