"""Multi-turn through the commands: README's environment file, ``grpax evaluate`` and ``grpax train_rl`` with an
environment, on a tiny random model with SmolLM2's real tokenizer and the real GSM8K files."""

import json
from pathlib import Path

import pytest
from conftest import gsm8k_dir, tiny_run_keys

from grpax.cli.main import main
from grpax.tasks.environment import load_environment


def _readme_env(tmp_path) -> Path:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("# my_env.py", 1)[1].split("```", 1)[0]
    path = tmp_path / "my_env.py"
    path.write_text("# my_env.py" + code)
    return path


def test_the_readme_environment_file_runs_as_documented(tmp_path):
    env = load_environment("UnitTable", str(_readme_env(tmp_path)))()
    messages = [{"role": "user", "content": "How many eggs in 2 dozen?"}]
    assert env.reset({"question": "q", "columns": {}, "messages": messages}) == messages
    assert env.stop_strings == ("</lookup>",)
    assert env.step("Look it up: <lookup> Dozen </lookup>") == ("<result>12</result>", 0.0, False)
    assert env.step("<lookup>mile</lookup>") == ("<result>error: unknown unit</result>", 0.0, False)
    assert env.step("2 * 12 = 24. <answer>24</answer>") == (None, 0.0, True)


@pytest.mark.slow  # compiles the sampler and the multi-turn segment for SmolLM2's vocabulary
def test_evaluate_runs_the_environment(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "eval"
    keys = [
        f"load_parameters_path={tiny_checkpoint}",
        f"dataset_name={gsm8k_dir()}",
        f"environment_path={_readme_env(tmp_path)}",
        "environment=UnitTable",
        "max_turns=2",
        "max_target_length=272",
        "num_test_batches=1",
        "eval_batch_size=2",
        f"output_path={out}",
    ]
    assert main(["evaluate", *keys]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 and summary["num_questions"] == 2
    for r in records:
        assert r["turns"] >= 1 and r["tool_calls"] == r["turns"] - 1 and r["tool_errors"] >= 0
    assert summary["turns"] == sum(r["turns"] for r in records) / 2
    assert "tool_calls" in capsys.readouterr().out


@pytest.mark.slow  # two train_rl steps with the calculator environment
def test_train_rl_with_the_calculator(tiny_checkpoint, tmp_path):
    keys = tiny_run_keys(
        tiny_checkpoint,
        tmp_path,
        num_batches=2,
        num_test_batches=1,
        eval_before=False,
        environment="calculator",
        max_prefill_predict_length=448,  # with the calculator instructions every GSM8K prompt is over 256
        max_target_length=464,
    )
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items())]) == 0
    run_dir = tmp_path / "run"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "multi_turn/turns" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["multi_turn/turns"] >= 1 and "rewards/environment/mean" in r
        assert 0 <= r["multi_turn/tool_use_rate"] <= 1
    evals = [json.loads(x) for x in (run_dir / "eval" / "after" / "results.jsonl").read_text().splitlines()]
    assert all("turns" in r for r in evals)


def test_environment_keys_are_checked(tmp_path, capsys):
    load = f"load_parameters_path={tmp_path}/none"
    assert main(["evaluate", load, "environment=calc"]) == 2
    assert "environment='calc': expected one of ['calculator']" in capsys.readouterr().err
    assert main(["evaluate", load, "environment_path=x.py"]) == 2
    assert "environment_path='x.py' needs environment=NAME" in capsys.readouterr().err
    assert main(["evaluate", load, "environment=calculator", "tool_format=json"]) == 2
    assert "tool_format='json': expected one of tags, chat" in capsys.readouterr().err
    assert main(["evaluate", load, "environment=calculator", "max_turns=0"]) == 2
    assert "max_turns=0" in capsys.readouterr().err


@pytest.mark.slow  # compiles the multi-turn sampler for SmolLM2's vocabulary
def test_generate_runs_the_environment(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    keys = [
        f"load_parameters_path={tiny_checkpoint}",
        "prompt=How many eggs are in 2 dozen?",
        "environment=calculator",
        "num_generations=2",
        "max_target_length=272",
        "decode_sampling_strategy=weighted",
        f"output_path={out}",
    ]
    assert main(["generate", *keys]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["prompt"] == "How many eggs are in 2 dozen?" and r["turns"] >= 1
        assert r["tool_calls"] == r["turns"] - 1 and len(r["completion_ids"]) <= 16
    assert "=== prompt 0" in capsys.readouterr().out


def test_generate_checks_environment_keys(tmp_path, capsys):
    load = f"load_parameters_path={tmp_path}/none"
    assert main(["generate", load, "prompt=x", "environment=calculator", "use_chat_template=false"]) == 2
    assert "drop use_chat_template=false" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["filter_zero_std_groups=true", "overlong_buffer_length=4"])
def test_train_rl_refuses_what_multi_turn_does_not_support(tiny_checkpoint, tmp_path, capsys, key):
    keys = tiny_run_keys(tiny_checkpoint, tmp_path, environment="calculator")
    assert main(["train_rl", *(f"{k}={v}" for k, v in keys.items()), key]) == 2
    assert "multi-turn rollouts, which do not support filter_zero_std_groups" in capsys.readouterr().err


def test_the_length_filter_measures_the_prompt_with_the_environments_instructions(tmp_path):
    # The calculator adds its instructions to the system prompt: a question whose plain prompt fits
    # max_prefill_predict_length may not fit with them, and is dropped (it was kept, then left-truncated).
    from grpax.checkpoint.gguf import read_gguf
    from grpax.data.prompts import prepare_rows, render_prompt
    from grpax.rl.train_config import Inputs, TrainConfig
    from grpax.rl.trainer import _load_rows
    from grpax.sampler.multi_turn import prompt_renderer
    from grpax.tasks import build_task
    from grpax.tasks.gsm8k import load_dataset_rows
    from grpax.tasks.prompts import get_prompt_preset

    tokenizer, preset = read_gguf().tokenizer(), get_prompt_preset("smollm2_calculator")
    rows = load_dataset_rows(str(gsm8k_dir()), "test")[:16]
    render = prompt_renderer(tokenizer, load_environment("calculator"), preset)
    plain = [len(tokenizer.encode(render_prompt(tokenizer, r["question"], preset))) for r in rows]
    full = [len(tokenizer.encode(render(r))) for r in rows]
    limit = sorted(full)[8]
    assert max(plain) <= limit  # every plain prompt fits: the old filter kept all 16
    fits = [i for i, n in enumerate(full) if n <= limit]
    assert 9 <= len(fits) < 16

    def load(dataset, split):
        return [dict(r) for r in rows]

    kept = prepare_rows(tokenizer, "gsm8k", "test", preset, limit, load=load, render=render)
    assert [r["question"] for r in kept] == [rows[i]["question"] for i in fits]
    assert all(r["prompt_ids"] == tokenizer.encode(render(r)) for r in kept)
    assert len(prepare_rows(tokenizer, "gsm8k", "test", preset, limit, load=load)) == 16  # without render

    # train_rl and evaluate measure them so with environment=calculator.
    keys = tiny_run_keys(tmp_path, tmp_path, dataset_name="gsm8k", environment="calculator", batch_size=2)
    cfg = TrainConfig(**keys, prompt_preset="smollm2_calculator", max_prefill_predict_length=limit)
    iterator, eval_rows = _load_rows(cfg, tokenizer, build_task(cfg), Inputs(None, load(0, 0), load(0, 0)))
    assert [r["question"] for r in eval_rows] == [rows[i]["question"] for i in fits][:2]
    from grpax.cli.evaluate import EvaluateConfig, _renderer

    eval_cfg = EvaluateConfig(environment="calculator", prompt_preset="smollm2_calculator")
    assert _renderer(eval_cfg, build_task(eval_cfg), tokenizer)(rows[0]) == render(rows[0])
    assert _renderer(EvaluateConfig(), build_task(EvaluateConfig()), tokenizer) is None
