"""Rollouts ahead of the update (``max_staleness``, ``grpax.rl.ahead``): the same batches as the synchronous loop
at 0, the staleness the key allows, learning one step off-policy, one line (no hang) when the thread fails, and a
resume that samples every prompt exactly once."""

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import kill_at_call, tiny_run_keys
from test_learning import TOY_MODEL, V, toy_rows, toy_scorer, toy_task

from grpax.config import ConfigError
from grpax.data.iterator import PromptIterator
from grpax.models.params import init_params
from grpax.rl import trainer
from grpax.rl.ahead import AheadRollouts, RolloutWorkerError
from grpax.rl.config import GRPOConfig
from grpax.rl.optim import optimizer_from_config
from grpax.rl.rollout import Rollout
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import TrainState, make_train_step, make_update
from grpax.rl.trainer import step_metrics, train
from grpax.sampler.keys import SamplerConfig

TOY = TOY_MODEL
SAMPLER = SamplerConfig(max_prompt_length=8, max_completion_length=4, temperature=1.0, pad_token_id=0)


def _toy_run(
    tmp_path, num_steps, max_staleness, *, scorer=None, asynchronous=True, timeout_s=600.0, overlap=False,
    sampler=SAMPLER,
):  # fmt: skip
    """``num_steps`` GRPO steps on the toy task: the trainer's loop shape, with the rollouts produced by
    ``AheadRollouts`` (``asynchronous``) or sampled in line as ``max_staleness=0`` does. Returns the metrics
    and the batches' policy versions."""
    grpo = GRPOConfig(
        num_generations=8,
        beta=0.0,
        learning_rate=1e-2,
        warmup_ratio=0.0,
        lr_schedule="constant",
        max_grad_norm=1.0,
        weight_decay=0.0,
        temperature=1.0,
        max_staleness=max_staleness,
    )
    optimizer, schedule = optimizer_from_config(grpo, num_steps)
    params = init_params(TOY, jax.random.key(0))
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    update = make_update(make_train_step(TOY, grpo, optimizer, 1, schedule), grpo.num_iterations)
    rollout = Rollout(TOY, sampler, grpo, scorer or toy_scorer(toy_task(tmp_path)))
    rng = np.random.default_rng(0)
    rows = toy_rows([rng.integers(1, V, size=rng.integers(3, 8)).tolist() for _ in range(64)])
    iterator = PromptIterator(rows, batch_size=8, seed=0)
    ahead = None
    if asynchronous:
        ahead = AheadRollouts(
            rollout, iterator, lambda s: jax.random.key(s), max_staleness, 0, num_steps, timeout_s=timeout_s,
            overlap=overlap,
        )  # fmt: skip
        ahead.publish(state.params, 0)
    history, versions = [], []
    try:
        for step in range(num_steps):
            if ahead is None:
                rollout.update_params(state.params, step)
                batch = rollout(next(iterator), jax.random.key(step), extra_rows=iterator)
            else:
                batch = ahead.get(step)
            state, update_metrics = update(state, batch)
            if ahead is not None:
                ahead.publish(state.params, step + 1)
            history.append(step_metrics(batch, update_metrics, {"time/train_s": 1.0, "time/step_s": 1.0}))
            versions.append(batch.host.policy_version)
    finally:
        if ahead is not None:
            ahead.close()
    return history, versions


def _nan_as_text(metrics):
    """``metrics`` without timings, NaN (e.g. ``kl`` at beta=0) as the text 'nan' so that == compares it."""
    return {
        k: "nan" if isinstance(v, float) and np.isnan(v) else v
        for k, v in metrics.items()
        if not k.startswith("time/")
    }


def test_max_staleness_0_through_the_thread_equals_the_synchronous_loop(tmp_path):
    threaded, versions = _toy_run(tmp_path, 3, 0, asynchronous=True)
    inline, _ = _toy_run(tmp_path, 3, 0, asynchronous=False)
    assert versions == [0, 1, 2]
    assert [_nan_as_text(m) for m in threaded] == [_nan_as_text(m) for m in inline]  # to the last bit


def test_each_batch_is_as_stale_as_the_key_allows(tmp_path):
    history, versions = _toy_run(tmp_path, 5, 2)
    assert versions == [0, 0, 0, 1, 2]  # batch j: the params after max(0, j - 2) updates
    # pi_old is the sampling params' (recomputed by the trainer): the clipped ratio pi_theta / pi_old is 1 on a
    # fresh batch and moves, with clipping, once the batch is stale. The mismatch metrics compare pi_old with
    # the sampler (issue 40 item 2: they once compared the current policy, reporting staleness as a
    # sampler/trainer disagreement): both score the sampling version, so they agree to float32 rounding on
    # every batch, stale or not, and the rollout correction's weight stays ~1.
    assert history[0]["ratio_mean"] == 1.0 and history[0]["clip_region_frac"] == 0.0
    for m in history[1:]:
        assert m["clip_region_frac"] > 0.0 and m["ratio_mean"] != 1.0
        assert m["mismatch/kl"] < 1e-8 and m["mismatch/logprob_diff_max"] < 1e-4
        assert abs(m["mismatch/is_ratio_mean"] - 1.0) < 1e-4


def _overlapping_run(tmp_path):
    import dataclasses

    sampler = dataclasses.replace(
        SAMPLER, max_completion_length=10, stop_token_ids=(1, 2), pad_token_id=1, decode_steps_per_call=1
    )
    return _toy_run(tmp_path, 4, 1, overlap=True, sampler=sampler)


def test_overlapping_batches_sample_the_tail_with_the_next_version(tmp_path):
    """overlap: when half a batch's rows have ended, the next version is swapped into the running engine and the
    next batch's prompts queued; the tail's tokens record the newer version. A batch sampled by one version
    only: pi_old equals the sampler's logprobs to float32 rounding."""
    history, versions = _overlapping_run(tmp_path)
    assert versions == [0, 0, 1, 2]  # each batch's first tokens: the pinned versions
    newer = [m["rollout/newer_version_token_fraction"] for m in history]
    assert max(newer) > 0.0 and max(newer) < 0.5, newer  # a tail, not the whole batch
    for m in history:
        if m["rollout/newer_version_token_fraction"] == 0.0:
            assert m["mismatch/logprob_diff_max"] < 1e-4, m["mismatch/logprob_diff_max"]


def test_overlapping_batches_score_each_tail_token_as_its_version_sampled_it(tmp_path):
    # At the swap the engine recomputes the running sequences' KV under the newer params (Engine.update_params),
    # so the tail's tokens are exactly the newer version's: pi_old per token version equals the sampler's
    # logprobs on every batch (without the recompute: 0.08 and 0.19 nats max on the batches with a tail).
    history, _ = _overlapping_run(tmp_path)
    assert max(m["rollout/newer_version_token_fraction"] for m in history) > 0.0
    assert max(m["rollout/recomputed_kv_tokens"] for m in history) > 0.0  # the swaps' cost, logged
    for m in history:
        assert m["mismatch/logprob_diff_max"] < 1e-4, m["mismatch/logprob_diff_max"]


@pytest.mark.slow
def test_one_step_off_policy_learns_the_toy_task(tmp_path):
    history, versions = _toy_run(tmp_path, 50, 1)
    assert versions == [0] + list(range(49))
    curve = [m["rewards/total/mean"] for m in history]
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    print(f"toy reward with max_staleness=1: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.25
    assert last > 0.6, curve


def test_a_failing_rollout_thread_stops_the_run_with_one_line(tmp_path):
    real = toy_scorer(toy_task(tmp_path))
    calls = {"n": 0}

    def failing(rows, out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sandbox gone")
        return real(rows, out)

    # The failure itself, not a wait for the hang timeout (that message is another: see the next test).
    with pytest.raises(
        RolloutWorkerError, match=r"^step 2: the rollout failed \(RuntimeError: sandbox gone\)"
    ):
        _toy_run(tmp_path, 3, 1, scorer=failing)


def test_a_hung_rollout_thread_is_one_line_after_the_timeout(tmp_path):
    real = toy_scorer(toy_task(tmp_path))
    calls = {"n": 0}

    def hanging(rows, out):
        calls["n"] += 1
        if calls["n"] == 2:
            time.sleep(30)
        return real(rows, out)

    with pytest.raises(RolloutWorkerError, match=r"^step 2: no rollout for 3 s"):
        _toy_run(tmp_path, 3, 1, scorer=hanging, timeout_s=3.0)


def test_negative_max_staleness_is_one_line():
    with pytest.raises(ConfigError, match=r"^max_staleness=-1: expected >= 0"):
        GRPOConfig(max_staleness=-1)


def test_the_correction_defaults_on_off_policy_only():
    assert GRPOConfig().rollout_is_mode is None
    assert GRPOConfig(max_staleness=1).rollout_is_mode == "token_truncate"
    assert GRPOConfig(max_staleness=1, vllm_importance_sampling_correction=False).rollout_is_mode is None
    assert GRPOConfig(vllm_importance_sampling_correction=True).rollout_is_mode == "token_truncate"


def _questions_of_each_rollout(monkeypatch):
    """Records the questions of every ``Rollout.__call__`` (rows sampled), in call order."""
    seen = []
    real = Rollout.__call__

    def spy(self, rows, key, extra_rows=None):
        seen.append([row["question"] for row in rows])
        return real(self, rows, key, extra_rows)

    monkeypatch.setattr(Rollout, "__call__", spy)
    return seen


@pytest.mark.slow
def test_a_killed_run_ahead_resumes_with_every_prompt_once(tiny_checkpoint, tmp_path, monkeypatch):
    keys = dict(num_batches=4, checkpoint_period=1, num_test_batches=0, max_staleness=1)
    sync_seen = _questions_of_each_rollout(monkeypatch)
    train(TrainConfig(**tiny_run_keys(tiny_checkpoint, tmp_path / "sync", **{**keys, "max_staleness": 0})))
    order = list(sync_seen)  # the synchronous run's prompts, step by step
    assert len(order) == 4

    # The same run ahead, killed during step 3's update (step 4's rollout may already be in flight).
    seen = _questions_of_each_rollout(monkeypatch)
    real_one_step = kill_at_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**tiny_run_keys(tiny_checkpoint, tmp_path / "ahead", **keys)))
    run = tmp_path / "ahead" / "run"
    killed = list(seen)
    assert killed[:2] == order[:2] and len(killed) >= 3  # step 3's batch was sampled before the kill
    monkeypatch.setattr(trainer, "_one_step", real_one_step)
    seen.clear()
    train(TrainConfig(**tiny_run_keys(tiny_checkpoint, tmp_path / "ahead", **keys)))
    # Steps 1-2 trained before the kill, 3-4 after: each of the synchronous run's prompts exactly once, in order.
    assert killed[:2] + seen == order, (killed, seen)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    staleness = {r["step"]: r["staleness"] for r in records if "staleness" in r}
    assert staleness == {
        1: 0.0,
        2: 1.0,
        3: 0.0,
        4: 1.0,
    }  # a resumed run's first batch uses the resumed params


def test_several_processes_refuse_max_staleness(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^max_staleness=1 runs in single-process jobs only"):
        train(TrainConfig(**tiny_run_keys(tiny_checkpoint, tmp_path, max_staleness=1)))
    assert not Path(tmp_path / "run" / "checkpoints").exists()


def test_publish_copies_only_the_trained_params():
    # With LoRA the next update donates the adapters only: publish copies them and builds the sampler's params
    # from the copy; the frozen base (a whole model) is shared with the sampler, never copied.
    import threading

    base, adapters = jnp.arange(4.0), {"lora_a": jnp.ones(3)}
    received, got = [], threading.Event()

    class Recorder:  # the thread's rollout: records the params it is given, then stops the thread
        def update_params(self, params, version):
            received.append((params, version))
            got.set()
            raise RuntimeError("recorded")

    ahead = AheadRollouts(Recorder(), iter([]), jax.random.key, 1, 0, 3)
    ahead.publish(adapters, 0, lambda trainable: {"base": base, **trainable})
    assert got.wait(timeout=30)
    ahead.close()
    ((params, version),) = received
    assert version == 0 and params["base"] is base  # shared, not copied
    assert params["lora_a"] is not adapters["lora_a"]  # a copy: the caller's array is donated next
    np.testing.assert_array_equal(params["lora_a"], adapters["lora_a"])
