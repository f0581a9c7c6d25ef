"""The main job end to end through the CLI: convert SmolLM2 from its GGUF, 2 GRPO steps on real GSM8K, export,
load the export in transformers; plus ``grpax evaluate completions_path=...`` on hand-made completions."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import gsm8k_dir

from grpax.cli.main import main


def _grpax(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "grpax", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_main_job_smollm2_gsm8k(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpax.checkpoint.gguf import default_gguf_path
    from grpax.checkpoint.orbax import load_model
    from grpax.models.llama import forward

    _grpax(
        "to_native",
        "model_name=smollm2-135m-Instruct",
        f"gguf_path={default_gguf_path()}",
        f"base_output_directory={tmp_path}/base",
    )
    out = _grpax(
        "train_rl",
        "model_name=smollm2-135m-Instruct",
        f"load_parameters_path={tmp_path}/base/0/items",
        f"base_output_directory={tmp_path}",
        "run_name=smoke",
        f"dataset_name={gsm8k_dir()}",
        "num_batches=2",
        "batch_size=2",
        "num_generations=2",
        "max_target_length=288",
        "num_test_batches=1",
        "eval_batch_size=2",
        "learning_rate=1e-5",
    )
    assert "accuracy" in out and "before" in out and "after" in out
    run = tmp_path / "smoke"
    actor = run / "checkpoints" / "actor" / "2" / "model_params"
    assert actor.is_dir()
    for name in (
        "config.json",
        "metrics.jsonl",
        "results.json",
        "eval/before/summary.json",
        "eval/after/results.jsonl",
        "checkpoints/config.json",
        "checkpoints/tokenizer.json",
    ):
        assert (run / name).exists(), name
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if "loss" in s]
    assert [s["step"] for s in train_steps] == [1, 2]
    assert all(
        s["mismatch/logprob_diff_max"] < 1e-3 for s in train_steps
    )  # sampler and trainer agree (float32)
    tb = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert tb and tb[0].stat().st_size > 0

    _grpax(
        "to_huggingface",
        "model_name=smollm2-135m-Instruct",
        f"load_parameters_path={actor}",
        f"base_output_directory={tmp_path}/hf",
        "weight_dtype=float32",
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    params, cfg, _ = load_model(actor)
    ours, _ = forward(params, np.asarray([ids]), cfg)
    assert np.abs(np.asarray(ours) - ref).max() < 1e-3  # the trained actor, exported, is the same model


def test_evaluate_completions_file(tmp_path, capsys):
    records = [  # 2 questions x 2 samples
        {
            "question": "q1",
            "answer": "Some working.\n#### 1,000",
            "completion": "<reasoning>10*100</reasoning>\n<answer>1,000</answer>",
        },
        {"question": "q1", "answer": "Some working.\n#### 1,000", "completion": "<answer>990</answer>"},
        {"question": "q2", "answer": "18", "completion": "<reasoning>x</reasoning>\n<answer>$17</answer>"},
        {"question": "q2", "answer": "18", "completion": "I think 20"},
    ]
    path = tmp_path / "completions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rc = main(
        [
            "evaluate",
            f"completions_path={path}",
            "num_eval_passes=2",
            f"output_path={tmp_path}/out",
            "reward_preset=smollm2_demo",
        ]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_questions"] == 2
    assert summary["accuracy"] == 0.25  # only the first completion is right
    assert summary["format_accuracy"] == 0.5  # completions 1 and 3 have the whole layout
    assert summary["partial_accuracy"] == 0.75  # 1,000 (exact), 990 (1% off) and 17 (5.6%) are within 10%
    # pass@2: q1 has a right sample, q2 none. maj@2: q1's votes tie (1,000 / 990) -> the first seen, right.
    assert summary["pass@k"] == 0.5 and summary["maj@k"] == 0.5
    results = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["extracted_answer"] for r in results] == ["1,000", "990", "$17", None]
    assert [r["correct"] for r in results] == [True, False, False, False]
    assert "accuracy" in capsys.readouterr().out


def test_evaluate_needs_a_source(capsys):
    assert main(["evaluate"]) == 2
    assert "load_parameters_path" in capsys.readouterr().err
