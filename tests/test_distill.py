"""On-policy distillation: the per-token reverse-KL advantage, its gradient, the keys and their checks."""

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import kill_at_call, tiny_smollm2_config
from test_train_step import CFG, _grouped_batch  # 3 prompts x G = 2, one empty completion

from grpax.checkpoint.orbax import save_params
from grpax.errors import ConfigError
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig, checkpoint_config, to_hf_config
from grpax.rl.config import GRPOConfig
from grpax.rl.distill import distillation_advantages
from grpax.rl.losses import policy_loss
from grpax.rl.optim import make_lr_schedule, make_optimizer
from grpax.rl.teacher import read_teacher
from grpax.rl.train_config import TrainConfig, validate
from grpax.rl.train_step import TrainState, accumulate_gradients, compute_logprobs, make_train_step
from grpax.sampler.keys import SamplerConfig

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def student():
    return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def teacher_logprobs():
    """A real teacher's logprobs of the batch's tokens: another random model of the same vocabulary."""
    return compute_logprobs(init_params(CFG, jax.random.key(1)), _grouped_batch(), CFG, TEMPERATURE)


def test_the_per_token_advantage_and_loss_are_the_hand_computed_ones():
    adv = distillation_advantages(jnp.array([1.0, -1.0]), jnp.array([[-1.0, -2.0], [-0.5, 0.0]]),
                                  jnp.array([[-0.5, -3.0], [-1.5, 7.0]]), 0.5)  # fmt: skip
    # rkl = [[-0.5, 1.0], [1.0, -7.0]]: A_t = A_i - 0.5 rkl
    np.testing.assert_allclose(adv, [[1.25, 0.5], [-1.5, 2.5]])
    grpo = GRPOConfig(beta=0.0, distillation_coef=0.5, loss_agg_mode="token-mean")
    loss, aux = policy_loss(
        jnp.array([[-1.0, -2.0], [-0.5, jnp.nan]]),  # padding may hold anything
        None,
        None,
        jnp.array([1.0, -1.0]),
        jnp.array([[1, 1], [1, 0]]),
        grpo,
        teacher_logprobs=jnp.array([[-0.5, -3.0], [-1.5, 7.0]]),
    )
    # on-policy the ratio is 1: loss = -mean of the counted tokens' A_t = -(1.25 + 0.5 - 1.5) / 3
    assert float(loss) == pytest.approx(-0.25 / 3, abs=1e-7)
    assert float(aux["distill/reverse_kl"]) == pytest.approx((-0.5 + 1.0 + 1.0) / 3, abs=1e-7)
    assert float(aux["distill/teacher_logprob"]) == pytest.approx((-0.5 - 3.0 - 1.5) / 3, abs=1e-7)


@pytest.mark.parametrize("num_micro_batches", [3])  # whole groups of 2 rows, accumulated
def test_the_gradient_is_the_sampled_reverse_kl_gradient(student, teacher_logprobs, num_micro_batches):
    """With no reward signal the update's gradient is lambda E[sum_t sg(log pi - log pi_T) grad log pi]: the
    REINFORCE gradient of lambda KL(pi || pi_T) from the samples, written out here by hand."""
    coef, batch = 0.7, _grouped_batch()
    batch["advantages"] = np.zeros(6, np.float32)
    batch["teacher_logprobs"] = teacher_logprobs
    grpo = GRPOConfig(beta=0.0, distillation_coef=coef, temperature=TEMPERATURE, loss_agg_mode="token-mean")
    run = jax.jit(
        functools.partial(accumulate_gradients, cfg=CFG, grpo=grpo, num_micro_batches=num_micro_batches)
    )
    _, grads, aux = run(student, batch)
    mask = jnp.asarray(batch["completion_mask"], jnp.float32)

    def sampled_reverse_kl(params):
        logp = compute_logprobs(params, batch, CFG, TEMPERATURE)
        rkl = jax.lax.stop_gradient(logp - teacher_logprobs)
        return coef * jnp.sum(mask * rkl * logp) / jnp.sum(mask)

    want = jax.grad(sampled_reverse_kl)(student)
    assert max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)) > 1e-3  # a real gradient
    for got, exp in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, exp, atol=1e-6)
    logp = compute_logprobs(student, batch, CFG, TEMPERATURE)
    rkl = float(jnp.sum(mask * (logp - teacher_logprobs)) / jnp.sum(mask))
    assert float(aux["distill/reverse_kl"]) == pytest.approx(rkl, abs=1e-5)


def test_in_expectation_the_gradient_is_the_exact_reverse_kl_gradient():
    """Summed over every token x with weight pi(x), the per-sample gradients give grad KL(pi || pi_T) exactly:
    GKD's generalised JSD at beta = 1 (TRL's ``generalized_jsd_loss``: KL(student || teacher)), fully on-policy."""
    z, q = jnp.array([0.3, -1.0, 2.0, 0.5, -0.2, 1.1]), jnp.array([1.0, 0.2, -0.5, 0.9, 0.0, -2.0])
    logq = jax.nn.log_softmax(q)
    grpo = GRPOConfig(beta=0.0, distillation_coef=1.0)

    def sample_loss(z, x):
        logp = jax.nn.log_softmax(z)[x][None, None]
        loss, _ = policy_loss(
            logp, None, None, jnp.zeros(1), jnp.ones((1, 1)), grpo, teacher_logprobs=logq[x][None, None]
        )
        return loss

    p = jax.nn.softmax(z)
    expected = sum(p[x] * jax.grad(sample_loss)(z, x) for x in range(6))
    gkd = jax.grad(lambda z: jnp.sum(jax.nn.softmax(z) * (jax.nn.log_softmax(z) - logq)))(z)
    assert float(jnp.max(jnp.abs(gkd))) > 0.1
    np.testing.assert_allclose(expected, gkd, atol=1e-6)


def _step(params, grpo, batch):
    schedule = make_lr_schedule(1e-2, 10, schedule="constant")
    optimizer = make_optimizer(schedule, 10, weight_decay=0.0)
    step = make_train_step(CFG, grpo, optimizer, lr_schedule=schedule)
    copy = jax.tree.map(jnp.copy, params)
    return step(TrainState(params=copy, opt_state=optimizer.init(copy), step=jnp.zeros((), jnp.int32)), batch)


def test_coef_zero_is_grpo_bit_for_bit_and_coef_above_zero_changes_the_update(student, teacher_logprobs):
    grpo = GRPOConfig(beta=0.0, temperature=TEMPERATURE, max_grad_norm=0.0)
    with_teacher = {**_grouped_batch(), "teacher_logprobs": teacher_logprobs}
    plain, plain_metrics = _step(student, grpo, _grouped_batch())
    zero, zero_metrics = _step(student, grpo, with_teacher)  # coef 0: the teacher only feeds distill/*
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(zero.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert {
        k: v for k, v in zero_metrics.items() if not k.startswith("distill/")
    }.keys() == plain_metrics.keys()
    for k, v in plain_metrics.items():
        np.testing.assert_array_equal(zero_metrics[k], v, err_msg=k)
    assert float(zero_metrics["distill/reverse_kl"]) != 0.0
    distilled, metrics = _step(student, grpo.replace(distillation_coef=1.0), with_teacher)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(distilled.params), strict=True)
    ]
    assert all(changed) and float(metrics["loss"]) != float(plain_metrics["loss"])


def test_distillation_coef_without_its_teacher_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^distillation_coef=0.5 needs teacher_parameters_path=") as e:
        _validate(distillation_coef=0.5)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"teacher_parameters_path='t'.*set distillation_coef"):
        _validate(teacher_parameters_path="t")
    with pytest.raises(ConfigError, match=r"teacher_model_name='smollm2-136m'.*Did you mean"):
        _validate(distillation_coef=1.0, teacher_parameters_path="t", teacher_model_name="smollm2-136m")
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ConfigError, match=r"^distillation_coef="):
            TrainConfig(load_parameters_path="x", distillation_coef=bad)
    with pytest.raises(
        ConfigError, match=r"^reward_preset=none scores every completion 0.*distillation_coef > 0"
    ):
        _validate(reward_preset="none")
    _validate(reward_preset="none", distillation_coef=1.0, teacher_parameters_path="t")


def test_reward_preset_none_scores_every_completion_zero():
    """The preset of pure on-policy distillation: a right, a wrong and an unformatted answer all score 0, where
    the default preset tells them apart."""
    from grpax.tasks.gsm8k_rewards import get_reward_config, score_completions

    completions = [
        "<reasoning>2 + 2</reasoning><answer>4</answer>",
        "<reasoning>2 + 3</reasoning><answer>5</answer>",
        "four",
    ]
    none = score_completions(["q"] * 3, completions, ["4"] * 3, get_reward_config("none"))["total"]
    assert none == [0.0, 0.0, 0.0]
    default = score_completions(["q"] * 3, completions, ["4"] * 3, get_reward_config("maxtext"))["total"]
    assert len(set(default)) == 3
    # the step's accuracy is still the answer's: only the first is right (not the top tier of 0 points)
    from grpax.tasks import build_task

    task = build_task(TrainConfig(load_parameters_path="x", reward_preset="none", prompt_preset="maxtext"))
    rows = [{"question": "q", "gold": "4"}] * 3
    scores = score_completions(["q"] * 3, completions, ["4"] * 3, get_reward_config("none"))
    assert task.step_correct(rows, completions, scores) == [True, False, False]


def _validate(**keys):
    validate(TrainConfig(load_parameters_path="x", **keys))


def _checkpoint(folder, cfg, seed=0, tokenizer=True):
    from grpax.checkpoint.gguf import read_gguf
    from grpax.data.tokenizer import save_tokenizer

    save_params(init_params(cfg, jax.random.key(seed)), folder / "0" / "items")
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
    if tokenizer:
        save_tokenizer(read_gguf().tokenizer(), folder)
    return folder / "0" / "items"


def _keys(student, teacher, **more):
    return TrainConfig(
        model_name="", load_parameters_path=str(student), teacher_parameters_path=str(teacher),
        distillation_coef=1.0, max_target_length=272, **more,
    )  # fmt: skip


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tiny_checkpoint, tmp_path):
    other = dataclasses.replace(tiny_smollm2_config(), vocab_size=1024)
    teacher = _checkpoint(tmp_path / "small_vocab", other, tokenizer=False)
    cfg = _keys(tiny_checkpoint, teacher)
    student, source = checkpoint_config(str(tiny_checkpoint))
    with pytest.raises(ConfigError) as e:
        read_teacher(cfg, student, source)
    msg = str(e.value)
    assert "vocab_size 1024 vs 49152" in msg and str(tmp_path / "small_vocab") in msg
    assert str(source) in msg and "\n" not in msg


def test_a_teacher_unlike_its_registered_name_is_refused_naming_the_fix(tiny_checkpoint, tmp_path):
    """teacher_model_name=smollm2-135m for a tiny checkpoint: its shapes named, the fix a name or none."""
    teacher = _checkpoint(tmp_path / "tiny", tiny_smollm2_config(), seed=1)
    student, source = checkpoint_config(str(tiny_checkpoint))
    with pytest.raises(ConfigError) as e:
        read_teacher(_keys(tiny_checkpoint, teacher, teacher_model_name="smollm2-135m"), student, source)
    msg = str(e.value)
    assert msg.startswith(f"the teacher {tmp_path / 'tiny' / 'config.json'} does not match smollm2-135m (")
    assert "\n" not in msg
    assert "num_layers: " in msg and "pass teacher_model_name=" in msg


def test_a_teacher_of_another_tokenizer_is_refused_naming_both(tiny_checkpoint, tmp_path):
    teacher = _checkpoint(tmp_path / "swapped", tiny_smollm2_config(), seed=1)
    path = tmp_path / "swapped" / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (1000, 1001))  # two ordinary tokens swap their ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    student, source = checkpoint_config(str(tiny_checkpoint))
    with pytest.raises(ConfigError, match="different tokenizers") as e:
        read_teacher(_keys(tiny_checkpoint, teacher), student, source)
    assert str(tmp_path / "swapped") in str(e.value)
    same = _checkpoint(tmp_path / "same", tiny_smollm2_config(), seed=1)
    assert read_teacher(_keys(tiny_checkpoint, same), student, source).vocab_size == 49152
    # another file of the same table (written with another indentation): compared by its tokens, accepted
    path = tmp_path / "same" / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=1))
    assert read_teacher(_keys(tiny_checkpoint, same), student, source).vocab_size == 49152


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    """Another random model of the student's shapes, vocabulary and tokenizer (``tiny_checkpoint``'s)."""
    return _checkpoint(tmp_path_factory.mktemp("teacher"), tiny_smollm2_config(), seed=1)


@pytest.mark.slow
def test_a_distillation_run_logs_its_metrics_and_resumes_bit_exactly(
    tiny_checkpoint, tiny_teacher, tmp_path, monkeypatch
):
    from conftest import tiny_run_keys

    from grpax.checkpoint.orbax import restore_params
    from grpax.rl import trainer

    def config(out):
        keys = tiny_run_keys(
            tiny_checkpoint,
            out,
            teacher_parameters_path=str(tiny_teacher),
            distillation_coef=1.0,
            num_test_batches=0,
        )
        return TrainConfig(**keys)

    def records(run_dir):
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if not k.startswith(("time", "compile/", "tokens_per_s"))}
            for r in lines
        ]

    full = trainer.train(config(tmp_path / "a"))
    first = records(tmp_path / "a" / "run")
    assert len(first) == 3 and all(
        math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0 for r in first
    )
    assert all(r["distill/teacher_logprob"] < 0 for r in first)
    timings = json.loads((tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert timings["time/teacher_s"] > 0
    assert not (tmp_path / "a" / "run" / ".teacher").exists()  # the mapped copy goes with the run

    real_step = kill_at_call(monkeypatch, 3)  # a Ctrl-C during step 3, after the step-2 checkpoint
    with pytest.raises(KeyboardInterrupt):
        trainer.train(config(tmp_path / "b"))
    monkeypatch.setattr(trainer, "_one_step", real_step)
    resumed = trainer.train(config(tmp_path / "b"))
    for a, b in zip(
        jax.tree.leaves(restore_params(full["actor_path"])),
        jax.tree.leaves(restore_params(resumed["actor_path"])),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert records(tmp_path / "b" / "run") == first


PLAN = dict(
    model_name="llama3.2-1b-Instruct", batch_size=4, num_generations=4, max_prefill_predict_length=128,
    max_target_length=384, beta=0.04, weight_dtype="bfloat16", dtype="bfloat16", remat_policy="full",
    num_batches=10, reference_memory="device",
)  # fmt: skip


def test_the_memory_plan_holds_the_teacher_and_the_step_count_its_pass():
    """llama3.1-8b-Instruct teaching llama3.2-1b-Instruct on one H200: the teacher's params (bfloat16, as the
    forward reads them) resident beside the student's, its pass's temporaries a phase, its forward in the count."""
    from grpax.config import build_config
    from grpax.models.registry import get_model_config
    from grpax.plan.memory_estimate import GPUS, estimate_job
    from grpax.plan.step_cost import grouped_forward_flops

    def plan(**keys):
        return estimate_job(
            build_config(TrainConfig, [f"{k}={v}" for k, v in {**PLAN, **keys}.items()]),
            GPUS["h200"],
            1,
            "h200-1",
        )

    alone = plan()
    taught = plan(distillation_coef=1.0, teacher_model_name="llama3.1-8b-Instruct")
    teacher = get_model_config("llama3.1-8b-Instruct")
    assert taught.resident["teacher params"] == teacher.num_params() * 2  # 16.06 GB in bfloat16
    assert {k: v for k, v in taught.resident.items() if k != "teacher params"} == alone.resident
    assert taught.peak >= alone.peak + teacher.num_params() * 2
    assert taught.phases["teacher logprobs"] > alone.phases["reference logprobs"]  # the 8B's temporaries
    names = [p.name for p in taught.flops]
    assert names[-2:] == ["teacher logprobs", "update"] and "teacher logprobs" not in [
        p.name for p in alone.flops
    ]
    shape = build_job_shape(PLAN)
    assert taught.flops[-2].flops == pytest.approx(sum(grouped_forward_flops(teacher, shape)))
    with pytest.raises(
        ConfigError,
        match=r"the teacher qwen3-8b and the student llama3.2-1b-Instruct .*\(vocab_size 151936 vs 128256\)",
    ):
        plan(distillation_coef=1.0, teacher_model_name="qwen3-8b")


def build_job_shape(keys):
    from grpax.plan.step_cost import StepShape

    P, C = keys["max_prefill_predict_length"], keys["max_target_length"] - keys["max_prefill_predict_length"]
    return StepShape(
        keys["batch_size"], keys["num_generations"], P, C, 1, 1, True, False,
        sampler=SamplerConfig(decode_phase_length=0),
    )  # fmt: skip


TINY = ModelConfig(
    vocab_size=64, hidden_dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    tie_word_embeddings=False,
)  # fmt: skip


def _exact_reverse_kl(student, teacher, batch, temperature):
    """KL(pi_student || pi_teacher) over the whole vocabulary, averaged over ``batch``'s completion positions."""
    from grpax.models.llama import logits_from_hidden
    from grpax.rl.train_step import completion_hidden

    def logp(params):
        hidden, _ = completion_hidden(params, batch, TINY)
        return jax.nn.log_softmax(logits_from_hidden(params, hidden, TINY) / temperature, axis=-1)

    ls, lt, mask = logp(student), logp(teacher), batch.completion_mask.astype(jnp.float32)
    return float(jnp.sum(mask * jnp.sum(jnp.exp(ls) * (ls - lt), axis=-1)) / jnp.sum(mask))


@pytest.mark.slow
def test_pure_distillation_lowers_the_students_reverse_kl_to_the_teacher():
    """No reward at all (every completion scores 0): a tiny student trained only by the teacher's per-token
    advantage moves toward a sharper teacher: the exact reverse KL on the first batch's sequences falls at every
    fifth step (0.194 -> 0.107 in 25 steps when written; at learning_rate 3e-2 it first rose to 0.36: Adam's
    steps moved the hidden states faster than the head)."""
    from grpax import sharding
    from grpax.rl.rollout import Rollout
    from grpax.rl.train_step import make_run_update, make_update

    def no_reward(rows, out):
        return {"total": np.zeros(len(rows))}, np.zeros(len(rows))

    keys = dict(beta=0.0, distillation_coef=1.0, learning_rate=3e-3, warmup_ratio=0.0, max_grad_norm=1.0,
                lr_schedule="constant", num_generations=8)  # fmt: skip
    cfg = TrainConfig(load_parameters_path="x", model_name="", batch_size=4, max_prefill_predict_length=8,
                      max_target_length=16, teacher_parameters_path="t", **keys)  # fmt: skip
    grpo = cfg.grpo()
    mesh, rollout_mesh = sharding.create_meshes(cfg.mesh())
    params = sharding.shard_params(init_params(TINY, jax.random.key(0)), TINY, mesh)
    # the teacher: the student's own weights with its head scaled up, a sharper distribution of the same ranking
    teacher = jax.tree.map(jnp.copy, params)  # not the donated arrays
    teacher["lm_head"] = teacher["lm_head"] * 6.0
    optimizer, _, step = make_run_update(grpo, TINY, 100, 1, cfg.max_completion_length)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    rollout = Rollout(TINY, cfg.sampler_config((1,), 0), grpo, no_reward, mesh=mesh, rollout_mesh=rollout_mesh,
                      teacher=teacher)  # fmt: skip
    update, rows = (
        make_update(step, 1),
        [{"prompt_ids": list(range(10 + 5 * i, 15 + 5 * i))} for i in range(4)],
    )
    held, kls = None, []
    for i in range(26):
        rollout.update_params(state.params, i)
        batch = rollout(rows, jax.random.key(i))
        assert not batch.host.advantages.any()  # GRPO's part is exactly 0: only the teacher teaches
        held = batch.device() if held is None else held
        if i % 5 == 0:
            kls.append(_exact_reverse_kl(state.params, teacher, held, cfg.temperature))
        state, metrics = update(state, batch)
        assert math.isfinite(float(metrics["distill/reverse_kl"]))
    assert np.all(np.diff(kls) < 0) and kls[-1] < 0.7 * kls[0], kls


def test_compile_topology_compiles_the_teachers_pass_beside_the_students(tmp_path, capsys, monkeypatch):
    """A 4-layer teacher of a 2-layer student's vocabulary on v5e:2x2: its params (fsdp=4, float32, rounded as
    read: float32 compute) are a resident row counted by hand, its logprob pass a compiled program and a counted
    phase of the step."""
    import re

    from grpax.cli.main import main

    pytest.importorskip("libtpu", reason="the tpu extra brings libtpu")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    student = ModelConfig(vocab_size=512, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          mlp_dim=128, eos_token_ids=(1,))  # fmt: skip
    teacher = dataclasses.replace(student, num_layers=4)
    for name, cfg in (("student", student), ("teacher", teacher)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
    keys = dict(model_name="", load_parameters_path=tmp_path / "student", compile_topology="v5e:2x2", batch_size=4,
                num_generations=2, max_prefill_predict_length=32, max_target_length=64, hardware="tpu",
                distillation_coef=1.0, teacher_parameters_path=tmp_path / "teacher", beta=0.0)  # fmt: skip
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 0
    out = capsys.readouterr().out

    def row(name):
        match = re.search(rf"^  {re.escape(name)}\s+[\d.]+ GiB\s+([\d,]+) bytes$", out, re.M)
        assert match, f"no row {name!r} in:\n{out}"
        return int(match.group(1).replace(",", ""))

    V, D, L, N, K, H, F = 512, 64, 4, 4, 2, 16, 128
    matrices = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    assert row("teacher params") == 4 * (matrices // 4 + L * 2 * D + D)  # float32, each matrix split 4 ways
    assert row("teacher logprobs temporaries") > 0
    assert re.search(r"^  teacher logprobs +[\d.]+ TFLOP", out, re.M), out


def test_convert_checkpoint_if_possible_converts_the_teacher_too(tmp_path, monkeypatch):
    """Without teacher_parameters_path the teacher's registered name is converted into
    base_output_directory/teacher/0/items (once), beside the student's base; without a name it is refused."""
    from grpax.checkpoint import convert
    from grpax.config import build_config
    from grpax.rl.trainer import converted_base

    calls = []

    def to_native(**kwargs):
        calls.append(kwargs)
        (Path(kwargs["base_output_directory"]) / "0" / "items").mkdir(parents=True)

    monkeypatch.setattr(convert, "to_native", to_native)
    keys = [
        f"base_output_directory={tmp_path}", "convert_checkpoint_if_possible=true", "hf_access_token=hf_secret",
        "distillation_coef=1.0", "teacher_model_name=smollm2-360m-Instruct",
    ]  # fmt: skip
    cfg = build_config(TrainConfig, keys)
    validate(cfg)
    for _ in range(2):
        got = converted_base(cfg)
        assert got.load_parameters_path == str(tmp_path / "0" / "items")
        assert got.teacher_parameters_path == str(tmp_path / "teacher" / "0" / "items")
    assert [(c["model_name"], c["base_output_directory"], c["hf_access_token"]) for c in calls] == [
        ("smollm2-135m-Instruct", str(tmp_path), "hf_secret"),
        ("smollm2-360m-Instruct", str(tmp_path / "teacher"), "hf_secret"),
    ]
    with pytest.raises(
        ConfigError, match="^distillation_coef=1.0 needs teacher_parameters_path=.*teacher_model_name"
    ):
        validate(build_config(TrainConfig, keys[:-1]))


def test_teacher_memory_auto_holds_the_teacher_in_host_memory_only_when_the_devices_cannot():
    """teacher_memory: in host memory the teacher leaves the resident rows, is on the devices during its own
    pass (its phase counts its bytes), and is copied there each step (a counted phase at the host link's
    bandwidth); auto moves it there only when the plan leaves the margin no other way, after the reference."""
    import dataclasses

    from grpax.config import build_config
    from grpax.models.registry import get_model_config
    from grpax.plan import memory_plan
    from grpax.plan.compile_check import TEACHER_COPY_PHASE, TEACHER_ON_HOST_ROW
    from grpax.plan.memory_estimate import GPUS, estimate_job

    h200 = GPUS["h200"]
    keys = {**PLAN, "distillation_coef": 1.0, "teacher_model_name": "llama3.1-8b-Instruct"}

    def cfg(**more):
        return build_config(TrainConfig, [f"{k}={v}" for k, v in {**keys, **more}.items()])

    def plan(c):
        return estimate_job(c, h200, 1, "h200-1")

    teacher_bytes = get_model_config("llama3.1-8b-Instruct").num_params() * 2
    device, host = plan(cfg(teacher_memory="device")), plan(cfg(teacher_memory="pinned_host"))
    assert device.resident["teacher params"] == teacher_bytes and "teacher params" not in host.resident
    assert host.resident[TEACHER_ON_HOST_ROW] == 0
    assert host.phases["teacher logprobs"] == device.phases["teacher logprobs"] + teacher_bytes
    assert sum(host.resident.values()) == sum(device.resident.values()) - teacher_bytes
    names = [p.name for p in host.flops]
    assert names[-3:] == [TEACHER_COPY_PHASE, "teacher logprobs", "update"]
    copy = host.flops[-3]
    assert (copy.bytes_per_chip, copy.seconds) == (teacher_bytes, pytest.approx(teacher_bytes / 64e9))
    assert TEACHER_COPY_PHASE not in [p.name for p in device.flops]

    def on(peak):  # an H200 whose memory leaves the margin beside ``peak`` bytes
        return dataclasses.replace(h200, hbm_bytes=int(peak / (1 - memory_plan.MARGIN)) + 1)

    auto = cfg(reference_memory="auto")
    assert auto.teacher_memory == "auto"  # the default
    peaks = {
        (ref, teacher): plan(dataclasses.replace(auto, reference_memory=ref, teacher_memory=teacher)).peak
        for ref in ("device", "pinned_host")
        for teacher in ("device", "pinned_host")
    }
    chosen = [
        (c.reference_memory, c.teacher_memory)
        for c in (memory_plan.choose(auto, on(p), 1, "gpu") for p in (peaks["device", "device"],
                  peaks["pinned_host", "device"], peaks["pinned_host", "pinned_host"]))
    ]  # fmt: skip
    assert chosen == [("device", "device"), ("pinned_host", "device"), ("pinned_host", "pinned_host")]
    assert memory_plan.describe(auto, dataclasses.replace(auto, reference_memory="device", teacher_memory="pinned_host")) == (
        "reference_memory=auto -> device, teacher_memory=auto -> pinned_host"
    )  # fmt: skip
    # no teacher: nothing to place; a key set by hand is kept
    assert {c.teacher_memory for c in memory_plan.candidates(cfg(distillation_coef=0.0))} == {"device"}
    assert {c.teacher_memory for c in memory_plan.candidates(cfg(teacher_memory="device"))} == {"device"}
    tries = memory_plan.fallbacks(
        auto, dataclasses.replace(auto, reference_memory="device", teacher_memory="device")
    )
    assert [(c.reference_memory, c.teacher_memory) for c in tries] == [
        ("pinned_host", "device"), ("pinned_host", "pinned_host")
    ]  # fmt: skip
    from grpax.rl.train_config import validate

    keys = {**PLAN, "load_parameters_path": "x", "teacher_memory": "host"}
    with pytest.raises(
        ConfigError, match=r"^teacher_memory='host': expected one of auto, device, pinned_host"
    ):
        validate(build_config(TrainConfig, [f"{k}={v}" for k, v in keys.items()]))


@pytest.mark.slow  # two 2-step distillation runs: about 30 s on 2 cores
def test_a_teacher_in_host_memory_teaches_as_one_on_the_devices(
    tiny_checkpoint, tiny_teacher, tmp_path, monkeypatch
):
    """teacher_memory=pinned_host: the loaded teacher is held in the host's pinned memory (no mapped files) and
    copied to the devices for its pass; the run's metrics are those of the teacher on the devices, value for
    value."""
    from conftest import tiny_run_keys

    from grpax.rl import trainer

    loaded, load_teacher = [], trainer.load_teacher

    def spy(*args, **kwargs):
        loaded.append(load_teacher(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(trainer, "load_teacher", spy)

    def run(out, memory):
        keys = tiny_run_keys(
            tiny_checkpoint, out, teacher_parameters_path=str(tiny_teacher), distillation_coef=1.0,
            num_test_batches=0, num_batches=2, teacher_memory=memory,
        )  # fmt: skip
        result = trainer.train(TrainConfig(**keys))
        lines = (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        skip = ("time", "compile/", "tokens_per_s")
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(skip)} for x in lines]

    on_host = run(tmp_path / "a", "pinned_host")
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(loaded[0]._params)}
    assert kinds == {"pinned_host"} and loaded[0].folder is None
    on_device = run(tmp_path / "b", "device")
    assert loaded[1].folder is not None  # this CPU process maps a teacher on the devices from files
    assert len(on_host) == 2 and on_host == on_device


@pytest.fixture(scope="module")
def tiny_moe_student(tmp_path_factory):
    """A tiny mixture-of-experts student of SmolLM2's vocabulary and tokenizer (4 experts, 2 a token)."""
    cfg = dataclasses.replace(
        tiny_smollm2_config(), family="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
        moe_mlp_dim=32, norm_topk_prob=True,
    )  # fmt: skip
    return _checkpoint(tmp_path_factory.mktemp("moe_student"), cfg, seed=2)


# Each with the teacher beside its own keys (issue 56: LoRA students, off-policy rollouts with rollout correction,
# multi-turn masks and MoE students keep working).
WITH_A_TEACHER = {
    "lora": dict(lora_rank=4),
    "ahead, corrected": dict(max_staleness=1, vllm_importance_sampling_correction=True),
    "multi-turn": dict(environment="calculator", max_prefill_predict_length=448, max_target_length=464),
    "moe": dict(student="moe", router_replay="replay"),
}


@pytest.mark.slow  # a 2-step distillation run each: 15-40 s on 2 cores
@pytest.mark.parametrize("case", WITH_A_TEACHER)
def test_distillation_beside_lora_rollouts_ahead_multi_turn_and_moe(
    case, tiny_checkpoint, tiny_teacher, tiny_moe_student, tmp_path
):
    """The teacher's pass and its advantage term run with each of these modes: every step's reverse KL is finite
    and not 0, the teacher's logprobs are < 0, and the update's gradient is not 0."""
    from conftest import tiny_run_keys

    from grpax.rl import trainer

    keys = dict(WITH_A_TEACHER[case])
    student = tiny_moe_student if keys.pop("student", "") == "moe" else tiny_checkpoint
    run = tiny_run_keys(
        student, tmp_path, teacher_parameters_path=str(tiny_teacher), distillation_coef=1.0, num_batches=2,
        num_test_batches=0, **keys,
    )  # fmt: skip
    result = trainer.train(TrainConfig(**run))
    lines = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "distill/reverse_kl" in r]
    assert len(steps) == 2, lines
    for r in steps:
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0
        assert r["distill/teacher_logprob"] < 0 and math.isfinite(r["loss"])
    if case == "multi-turn":
        assert all(r["multi_turn/turns"] >= 1 for r in steps)
    if case == "ahead, corrected":
        assert all("mismatch/is_ratio_min" in r for r in steps)
    assert all(r["grad_norm"] > 0 for r in steps)
