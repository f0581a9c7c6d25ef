"""Every key of the GRPO, loss, rollout, LoRA and model config changes what it says (issue 40's general fix).

A key that is accepted, validated and documented but never reaches its use is a silent wrong result: RLOO once
trained as GRPO because the rollout called ``compute_advantages`` without the estimator. Here one tiny GRPO step
runs through the trainer's own pieces (``TrainConfig`` -> ``cfg.grpo()``, ``cfg.sampler_config``,
``cfg.model_keys()``, ``trainer._init_state``, ``Rollout``, ``make_update``) with each key changed once, in a
context where the key matters (e.g. the clip range needs a second update on the same batch, the rollout
correction a top-k filter), and the step's batch, metrics and updated weights must differ from the context's
own. Keys whose effect is by design invisible in the numbers (micro-batches, remat, the attention
implementation, retiring finished rows) must change the compiled update or the decode work instead. Where it is
cheap, the changed value is checked too: RLOO's G/(G-1), CISPO's loss, the TIS bound. ``reference_dtype`` and
``reference_memory`` change where and in what the reference is stored, never its logprobs
(tests/test_reference.py proves both); ``remat_policy=auto`` is resolved by the plan (tests/test_memory_plan.py).
"""

import contextlib
import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest

from grpax import sharding
from grpax.models.lora import LoraWeight
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig, load_hf_config, to_hf_config
from grpax.rl import trainer
from grpax.rl.config import GRPOConfig
from grpax.rl.policy import Policy
from grpax.rl.resume import RunPaths
from grpax.rl.rollout import Rollout
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import make_update

TINY = ModelConfig(
    vocab_size=64, hidden_dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    tie_word_embeddings=False,
)  # fmt: skip
STOPS = tuple(range(1, 9))  # 8 of 64 ids end a row: completions of varied lengths
# The context every key is changed in: 2 prompts x G = 4, up to 8 new tokens, a learning rate that moves the
# tiny model within a step, no warmup (the first update trains).
BASE = dict(
    model_name="", batch_size=2, max_prefill_predict_length=8, max_target_length=16, learning_rate=1e-2,
    warmup_ratio=0.0, num_batches=2,
)  # fmt: skip
TWO_UPDATES = {"num_iterations": 2}  # the ratio moves off 1 and Adam's moments mix two gradients
# The sampler's mu differs from pi_old: rollout correction matters. With a top-k filter every drawn token's
# weight pi_old / mu is the kept mass Z at its position (issue 40 item 5): here 56 of the tiny model's 64 ids
# keep 0.894-0.902 of the mass, so bounds in that band bite.
FILTERED = {"decode_sampling_top_k": 56}
CORRECTED = {**FILTERED, "vllm_importance_sampling_correction": True}
BANDED = {**CORRECTED, "vllm_importance_sampling_clip_min": 0.898}  # IcePop-like: some tokens outside
LORA = {"lora_rank": 4}


def _score(rows, out):
    """A reward that varies within each group (the completion's multiples of 3), or a constant for ``flat``
    rows (zero-std groups: DAPO's dynamic sampling)."""
    ids, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask) > 0
    total = np.array(
        [1.0 if row.get("flat") else float(np.sum(ids[i][mask[i]] % 3 == 0)) for i, row in enumerate(rows)]
    )
    return {"total": total}, np.zeros(len(rows))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(to_hf_config(TINY, "float32")))
    return folder


@dataclasses.dataclass
class Step:
    batch: dict  # name -> np.ndarray (the update's Batch fields and the rollout's host rewards)
    metrics: dict  # the update's metrics and the rollout's host metrics (timings dropped)
    params: dict  # the trained tree after the update, flattened
    program: str  # the update's lowered program
    sampler_params: object  # what the rollout sampled with


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _step(checkpoint, stops=STOPS, **keys) -> Step:
    """One GRPO step of the tiny model with ``keys`` (``stops``: the ids that end a row), through the trainer's
    own builders."""
    cfg = TrainConfig(
        load_parameters_path=str(checkpoint),
        base_output_directory=str(checkpoint / "runs"),
        **{**BASE, **keys},
    )
    grpo = cfg.grpo()
    model_cfg = load_hf_config(checkpoint / "config.json", **cfg.model_keys())
    mesh, rollout_mesh = sharding.create_meshes(cfg.mesh())
    params = sharding.shard_params(init_params(model_cfg, jax.random.key(0)), model_cfg, mesh)
    policy = (
        Policy(cfg.lora(), params, "", cfg.lora_base_dtype, cfg.lora_sampler, model_cfg)
        if cfg.lora_rank
        else Policy()
    )
    closing = (
        contextlib.ExitStack()
    )  # the trainer's reference: LoRA's base itself, else a copy (donated state)
    frozen = policy.lora is not None
    reference = trainer._reference(
        cfg, policy.base if frozen else params, model_cfg, RunPaths.of(cfg), closing, frozen=frozen
    )
    trainable = policy.init_trainable(params, model_cfg, mesh, cfg.seed)
    state, train_step = trainer._init_state(cfg, grpo, trainable, model_cfg, mesh, policy)
    sampler_cfg = cfg.sampler_config(stops, 0)
    rollout = Rollout(
        model_cfg, sampler_cfg, grpo, _score, mesh=mesh, rollout_mesh=rollout_mesh, reference=reference,
        num_micro_batches=cfg.micro_batches,
    )  # fmt: skip
    sampler_params = policy.sampler_params(state.params)
    rollout.update_params(sampler_params, 0)
    rows = [{"prompt_ids": [9, 10, 11, 12, 13]}, {"prompt_ids": list(range(20, 28)), "flat": True}]
    flat_rows = itertools.repeat([{"prompt_ids": [30, 31, 32], "flat": True}] * cfg.batch_size)
    batch = rollout(rows, jax.random.key(1), extra_rows=flat_rows)
    host = batch.host
    device = batch.device()
    with jax.set_mesh(mesh):
        lowered = (train_step.func if policy.lora else train_step).lower(
            state, device, **({"base": policy.base} if policy.lora else {})
        )
        state, metrics = make_update(train_step, grpo.num_iterations)(state, batch)
    closing.close()
    host_metrics = {k: v for k, v in host.summary().items() if not k.startswith("time/")}
    return Step(
        batch={**_flat(device), "rewards": host.rewards["total"]},
        metrics={**{k: np.asarray(v) for k, v in metrics.items()}, **host_metrics},
        params=_flat(state.params),
        program=lowered.as_text(),
        sampler_params=sampler_params,
    )


def _differs(a: dict, b: dict) -> list[str]:
    """The names whose values (or shapes, or presence) differ between ``a`` and ``b``."""
    names = set(a) | set(b)
    return sorted(
        n
        for n in names
        if n not in a
        or n not in b
        or np.shape(a[n]) != np.shape(b[n])
        or not np.array_equal(np.asarray(a[n]), np.asarray(b[n]), equal_nan=True)
    )


# (key, value, the context it is changed in). The context's own step is the comparison.
OUTCOME_KEYS = [
    ("num_generations", 2, {}),
    ("num_iterations", 2, {}),
    ("beta", 0.0, {}),
    ("epsilon", 0.01, TWO_UPDATES),
    ("epsilon_high", 0.01, TWO_UPDATES),
    ("kl_estimator", "k1", TWO_UPDATES),
    ("kl_estimator", "k2", TWO_UPDATES),
    ("loss_agg_mode", "sequence-mean-token-mean", {}),
    ("loss_agg_mode", "sequence-mean-token-sum-norm", {}),
    ("scale_rewards", "batch", {}),
    ("scale_rewards", "none", {}),
    ("importance_sampling_level", "sequence", TWO_UPDATES),
    ("loss_type", "cispo", TWO_UPDATES),
    ("adv_estimator", "rloo", {}),
    ("max_staleness", 1, {}),
    ("vllm_importance_sampling_correction", True, FILTERED),
    ("vllm_importance_sampling_mode", "token_mask", BANDED),
    ("vllm_importance_sampling_mode", "sequence_truncate", BANDED),
    ("vllm_importance_sampling_mode", "sequence_mask", BANDED),
    ("vllm_importance_sampling_clip_max", 0.898, CORRECTED),
    ("vllm_importance_sampling_clip_min", 0.9, BANDED),
    ("mask_truncated_completions", True, {}),
    ("filter_zero_std_groups", True, {}),
    ("dynamic_sampling_max_batches", 2, {"filter_zero_std_groups": True}),
    ("overlong_buffer_length", 4, {}),
    ("overlong_penalty_factor", 3.0, {"overlong_buffer_length": 4}),
    ("temperature", 0.5, {}),
    ("learning_rate", 1e-3, {}),
    ("b1", 0.5, TWO_UPDATES),
    ("b2", 0.5, TWO_UPDATES),
    ("weight_decay", 0.0, {}),
    ("adam_eps", 0.1, {}),
    (
        "mu_dtype",
        "bfloat16",
        TWO_UPDATES,
    ),  # optax casts m after the update it computes: the next one reads it
    ("max_grad_norm", 0.0, TWO_UPDATES),
    ("warmup_ratio", 0.5, {}),
    ("lr_schedule", "linear", TWO_UPDATES),
    ("lr_schedule", "constant", TWO_UPDATES),
    ("end_lr_ratio", 0.5, TWO_UPDATES),
    ("learning_rate_schedule_steps", 8, TWO_UPDATES),
    ("decode_sampling_top_k", 4, {}),
    ("decode_sampling_nucleus_p", 0.5, {}),
    ("max_target_length", 12, {}),
    ("max_prefill_predict_length", 12, {"max_target_length": 20}),
    ("lora_rank", 4, {}),
    ("lora_alpha", 16.0, {**LORA, **TWO_UPDATES}),
    ("use_rslora", True, {**LORA, **TWO_UPDATES}),
    ("lora_target_modules", ("q_proj", "v_proj"), LORA),
    ("lora_base_dtype", "nf4", LORA),
    ("lora_base_dtype", "int8", LORA),
    ("weight_dtype", "bfloat16", {}),
    ("dtype", "bfloat16", {}),
    ("scan_layers", False, {}),
]
# Keys that by design leave the numbers as they are (to float rounding): the compiled update changes.
PROGRAM_KEYS = [
    ("num_micro_batches", 2, {}),
    ("micro_batch_size", 1, {}),
    ("remat_policy", "none", {}),
    ("remat_policy", "dots", {}),
    ("remat_policy", "minimal", {}),
    ("attention", "jax_nn", {}),
]


def _name(case) -> str:
    key, value, context = case
    return f"{key}={value}" + (f" [{','.join(f'{k}={v}' for k, v in context.items())}]" if context else "")


@pytest.fixture(scope="module")
def steps(checkpoint):
    """Each context's own step, computed once."""
    cache = {}

    def get(**keys):
        name = json.dumps(keys, sort_keys=True, default=str)
        if name not in cache:
            cache[name] = _step(checkpoint, **keys)
        return cache[name]

    return get


@pytest.mark.slow  # ~60 compiled steps: the sweep runs with the slow suite; the checks of values below run always
@pytest.mark.parametrize("case", OUTCOME_KEYS, ids=_name)
def test_each_key_changes_the_step(case, steps):
    key, value, context = case
    assert value != GRPOConfig.__dataclass_fields__.get(key, TrainConfig.__dataclass_fields__[key]).default
    before, after = steps(**context), steps(**{**context, key: value})
    changed = _differs(before.batch, after.batch) + _differs(before.metrics, after.metrics)
    changed += _differs(before.params, after.params)
    assert changed, f"{key}={value!r} changed nothing in the batch, the metrics or the updated weights"


@pytest.mark.slow
@pytest.mark.parametrize("case", PROGRAM_KEYS, ids=_name)
def test_each_key_without_a_numeric_effect_changes_the_compiled_update(case, steps):
    key, value, context = case
    before, after = steps(**context), steps(**{**context, key: value})
    assert before.program != after.program, f"{key}={value!r} compiled the same update"
    for name in ("loss", "policy_loss", "kl", "grad_norm"):  # and the numbers stay what they were
        np.testing.assert_allclose(after.metrics[name], before.metrics[name], rtol=1e-4, atol=1e-6)


def test_retiring_finished_rows_changes_the_decode_work_not_the_rollout(steps):
    # Three decode phases of 64 steps and one stop id of 64: some rows end in the first phase, some run on, so
    # the second phase retires the finished ones.
    context = {"max_target_length": 8 + 130, "stops": (1,)}
    retired, full = steps(**context), steps(**context, decode_retire_rows=False)
    assert _differs(retired.batch, full.batch) == []  # the same tokens, logprobs and rewards
    assert retired.metrics["decode/row_steps"] < full.metrics["decode/row_steps"]
    assert retired.metrics["decode/past_eos_fraction"] < full.metrics["decode/past_eos_fraction"]


def test_lora_sampler_changes_what_the_rollout_samples_with(steps):
    merged, adapters = steps(**LORA, lora_sampler="merged"), steps(**LORA, lora_sampler="adapters")
    is_lora = lambda x: isinstance(x, LoraWeight)  # noqa: E731
    assert not any(is_lora(x) for x in jax.tree.leaves(merged.sampler_params, is_leaf=is_lora))
    assert any(is_lora(x) for x in jax.tree.leaves(adapters.sampler_params, is_leaf=is_lora))


def test_rloo_trains_with_the_leave_one_out_baseline(steps):
    """Issue 40 item 1: with G = 4 and scale_rewards=none RLOO's advantages are 4/3 of GRPO's, in the batch the
    update reads, and so is the policy loss (on-policy, token-mean: -mean of the tokens' advantages)."""
    grpo, rloo = steps(scale_rewards="none"), steps(scale_rewards="none", adv_estimator="rloo")
    assert np.abs(grpo.batch[".advantages"]).max() > 0
    np.testing.assert_allclose(rloo.batch[".advantages"], grpo.batch[".advantages"] * 4 / 3, rtol=1e-6)
    np.testing.assert_allclose(rloo.metrics["policy_loss"], grpo.metrics["policy_loss"] * 4 / 3, rtol=1e-5)


def test_cispo_and_the_tis_weight_take_their_values(steps):
    """CISPO's on-policy loss is -sum(A logp) / tokens (the weight sg(clip(1)) = 1), against PPO's -sum(A) /
    tokens. Under a top-k filter each drawn token's weight pi_old / mu is the kept mass Z <= 1 (issue 40 item
    5), so a floor C_min inside the band of Z truncates some tokens' weights and none exceeds 1."""
    ppo, cispo = steps(), steps(loss_type="cispo")
    mask = cispo.batch[".completion_mask"] > 0
    adv = np.broadcast_to(cispo.batch[".advantages"][:, None], mask.shape)
    tokens = mask.sum()
    np.testing.assert_allclose(ppo.metrics["policy_loss"], -adv[mask].sum() / tokens, rtol=1e-5, atol=1e-7)
    logp = cispo.batch[".rollout_logprobs"]  # on-policy, float32, no filter: the update's logprobs to ~1e-5
    expected = -(adv * logp)[mask].sum() / tokens
    np.testing.assert_allclose(cispo.metrics["policy_loss"], expected, rtol=1e-3, atol=1e-4)
    tis = steps(**BANDED)
    assert tis.metrics["mismatch/is_ratio_max"] <= 1 + 1e-5  # the raw ratio: Z, at most 1 (float32 rounding)
    assert tis.metrics["mismatch/is_ratio_min"] < 0.898
    assert 0 < tis.metrics["mismatch/is_truncated_frac"] < 1


def test_the_kv_memory_keys_size_the_samplers_page_pool(checkpoint, monkeypatch):
    """page_size, num_pages, max_num_seqs, slot_count_step and sampler_programs reach the rollout engine: its
    pool's pages and their size (the default: one page of 32 tokens per row of 16 tokens, and the scratch page),
    its decode slots and their ladder (what the ladder changes: tests/test_engine.py), its program set (auto on
    this CPU: adaptive; what fixed changes: tests/test_program_set.py), and the rollout is the same tokens."""
    from grpax.sampler import engine

    pools, ladders = [], []
    real_engine = engine.Engine

    def recording(*args, **kwargs):
        built = real_engine(*args, **kwargs)
        pools.append((built.pool.num_pages, built.sc.page_size, built.table_width, built.num_slots))
        ladders.append((built.sc.slot_count_step, built.fixed))
        return built

    monkeypatch.setattr(engine, "Engine", recording)
    default = _step(checkpoint)
    paged = _step(checkpoint, page_size=4, num_pages=24)
    slots = _step(checkpoint, max_num_seqs=5, slot_count_step=1)
    fixed = _step(checkpoint, sampler_programs="fixed")
    # 2 prompts x G = 4: 8 rows of max_target_length=16 tokens, a page of 32 each or 4 pages of 4 (24 pages: the
    # pool holds 5 full-length rows, the rest taken as real lengths allow); max_num_seqs=5: 5 slots decode the
    # 8 rows (the rest wait for a slot), a page each and the scratch page
    assert pools == [(1 + 8 * 1, 32, 1, 8), (24, 4, 4, 8), (1 + 5 * 1, 32, 1, 5), (1 + 8 * 1, 32, 1, 8)]
    # slot_count_step: the engine's ladder of decode slot counts; sampler_programs: its program set
    assert ladders == [(0, False), (0, False), (1, False), (0, True)]
    np.testing.assert_array_equal(fixed.batch[".completion_ids"], default.batch[".completion_ids"])
    np.testing.assert_array_equal(paged.batch[".completion_ids"], default.batch[".completion_ids"])
    np.testing.assert_array_equal(slots.batch[".completion_ids"], default.batch[".completion_ids"])
