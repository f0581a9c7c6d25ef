"""train_rl and evaluate with the user's task: a reward file written here, a JSONL with its own column names,
a tiny random model. Its rewards reach the metrics and the advantages; a broken function stops the run
before the update with one line and the last checkpoint kept."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import restore_params
from grpax.cli.main import main
from grpax.rl import rollout as rollout_module
from grpax.rl.advantages import compute_advantages
from grpax.rl.rollout import Rollout

REWARDS = """
def short(prompts, completions, tmvp_config, **kwargs):
    # MaxText's signature, unchanged: the run's config is tmvp_config
    return [1.0 if len(c) < tmvp_config.max_target_length // 4 else 0.0 for c in completions]

def mentions_target(prompts, completions, target, difficulty, **kwargs):
    # dataset columns by keyword: 'target' (the answer_field) and 'difficulty' (any other column)
    return [float(t.lower() in c.lower()) + 0.1 * d for c, t, d in zip(completions, target, difficulty)]
"""

ROWS = [
    {"instruction": f"Write the word {w}.", "target": w, "difficulty": d}
    for w, d in [("cat", 1), ("dog", 2), ("sun", 3), ("sky", 1), ("sea", 2), ("red", 3)]
]


def _data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    for split, rows in (("train", ROWS[:4]), ("test", ROWS[4:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return folder


def _keys(ckpt, tmp_path, **overrides):
    keys = tiny_run_keys(
        ckpt,
        tmp_path / "out",
        dataset_name=str(_data(tmp_path)),
        task="custom",
        prompt_field="instruction",
        answer_field="target",
        prompt_preset="plain",
        reward_functions_path=str(tmp_path / "rewards.py"),
        reward_functions="[short,mentions_target]",
        reward_weights="[2.0,0.5]",
        accuracy_reward="mentions_target",
        num_batches=1,
        checkpoint_period=1,
    )
    keys.update(overrides)
    return [f"{k}={v}" for k, v in keys.items()]


@pytest.mark.slow
def test_user_task_trains_and_evaluates(tiny_checkpoint, tmp_path, monkeypatch):
    seen = {}
    real_call, real_advantages = Rollout.__call__, rollout_module.compute_advantages

    def spy_call(self, *args, **kwargs):
        batch = real_call(self, *args, **kwargs)
        seen["scores"] = batch.host.rewards
        return batch

    def spy_advantages(rewards, *args, **kwargs):
        seen["rewards"] = np.asarray(rewards)
        seen["advantages"] = real_advantages(rewards, *args, **kwargs)
        return seen["advantages"]

    monkeypatch.setattr(Rollout, "__call__", spy_call)
    monkeypatch.setattr(rollout_module, "compute_advantages", spy_advantages)
    assert main(["train_rl", *_keys(tiny_checkpoint, tmp_path)]) == 0

    scores = seen["scores"]
    rows = [ROWS[i] for i in range(4)]  # batch_size 2 of the 4 training rows, each twice (G = 2)
    assert set(scores) >= {"short", "mentions_target", "total"}
    # mentions_target is at least 0.1 * difficulty of its row (the column arrived by keyword)
    assert all(round((v * 10) % 10) in {r["difficulty"] for r in rows} for v in scores["mentions_target"])
    # The advantages come from the weighted sum 2.0 * short + 0.5 * mentions_target
    total = 2.0 * scores["short"] + 0.5 * scores["mentions_target"]
    np.testing.assert_allclose(scores["total"], total)
    np.testing.assert_allclose(seen["rewards"], total.astype(np.float32))
    np.testing.assert_allclose(seen["advantages"], compute_advantages(total.astype(np.float32), 2))

    run = tmp_path / "out" / "run"
    step = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
    for name in ("short", "mentions_target", "total"):
        assert step[f"rewards/{name}/mean"] == pytest.approx(float(np.mean(scores[name])))
        assert step[f"rewards/{name}/std"] == pytest.approx(float(np.std(scores[name])))
    assert "zero_std_fraction" in step and "accuracy" in step
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").glob("events.*"))
    assert b"rewards/short/mean" in events and b"rewards/mentions_target/std" in events

    # grpax evaluate: the trained checkpoint, scored with the same task and reward file
    actor = run / "checkpoints" / "actor" / "1" / "model_params"
    out = tmp_path / "eval"
    keys = [k for k in _keys(tiny_checkpoint, tmp_path) if k.split("=")[0] in EVALUATE_KEYS]
    args = ["evaluate", *keys, f"load_parameters_path={actor}", f"output_path={out}", "model_name="]
    assert main(args) == 0
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["question"] for r in records] == [r["instruction"] for r in ROWS[4:]]
    for r, row in zip(records, ROWS[4:], strict=True):
        assert r["rewards"]["mentions_target"] >= 0.1 * row["difficulty"] - 1e-9
        assert r["correct"] == (r["rewards"]["mentions_target"] > 0)


EVALUATE_KEYS = {
    "dataset_name",
    "task",
    "prompt_field",
    "answer_field",
    "prompt_preset",
    "reward_functions_path",
    "reward_functions",
    "reward_weights",
    "accuracy_reward",
    "max_target_length",
}

BAD = {
    "raises": ("raise RuntimeError('judge offline')", r"raised RuntimeError: judge offline on row 0"),
    "wrong_length": ("return [1.0]", r"returned 1 values for 4 completions"),
    "not_a_number": ("return ['high'] * len(completions)", r"returned 'high' for row 0: expected a finite"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_reward_function_stops_before_the_update(tiny_checkpoint, tmp_path, capsys, case):
    body, message = BAD[case]
    # Good at step 1 (its checkpoint is written), broken from step 2 on.
    (tmp_path / "flaky.py").write_text(
        "calls = []\n\n"
        "def flaky(prompts, completions, tmvp_config, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 1:\n"
        "        return [0.5] * len(completions)\n"
        f"    {body}\n"
    )
    keys = _keys(
        tiny_checkpoint,
        tmp_path,
        reward_functions_path=str(tmp_path / "flaky.py"),
        reward_functions="[flaky]",
        reward_weights="[]",
        accuracy_reward="",
        num_batches=2,
        num_test_batches=0,
    )
    assert main(["train_rl", *keys]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # one line
    assert (
        err.startswith("grpax train_rl: error: step 2: reward function 'flaky' (") and "no update was" in err
    )
    assert re.search(message, err), err
    actor = tmp_path / "out" / "run" / "checkpoints" / "actor"
    assert sorted(p.name for p in actor.iterdir()) == ["1"]
    restore_params(str(Path(actor / "1" / "model_params")))  # intact: it restores


@pytest.mark.slow
def test_math_task_trains_a_step(tiny_checkpoint, tmp_path):
    pytest.importorskip("math_verify")
    problems = [
        {"problem": f"What is {a}/{b}?", "answer": f"\\frac{{{a}}}{{{b}}}"}
        for a, b in [(1, 2), (2, 3), (3, 4)]
    ]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in problems))
    keys = tiny_run_keys(
        tiny_checkpoint,
        tmp_path / "out",
        dataset_name=str(data),
        allow_eval_on_train_rows=True,
        task="math",
        prompt_preset="math",
        num_batches=1,
        filter_zero_std_groups=True,
        overlong_buffer_length=8,
    )
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 0
    run = tmp_path / "out" / "run"
    step = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
    # A random model writes no \boxed{}: no answer, no format points; 16 tokens = max_completion_length, so
    # every completion gets the full overlong punishment -1: all groups are zero-std, and the batch is filled
    assert step["rewards/answer_correct/mean"] == 0.0 and step["rewards/answer_format/mean"] == 0.0
    assert step["rewards/overlong/mean"] == -1.0 and step["zero_std_fraction"] == 1.0
    assert step["dynamic_sampling/batches"] == 3 and step["dynamic_sampling/filled_groups"] == 2
    summary = json.loads((run / "eval" / "after" / "summary.json").read_text())
    assert summary["accuracy"] == 0.0 and summary["num_questions"] == 2
