"""What an export keeps of a training run (issue 45): the rounding of a run's update to the export's dtype measured
(by hand on a few numbers; on a real 2-step run, against the file written) and warned about; the PEFT export
naming its Hugging Face base and loading on it to the merged export's logits; a moved base found by a key; a PEFT
export of a whole model refused. The end-to-end ones train two tiny runs (about a minute): marked slow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.convert import to_native
from grpax.checkpoint.gguf import read_gguf
from grpax.checkpoint.hf import iter_hf_tensors
from grpax.checkpoint.orbax import restore_params
from grpax.checkpoint.safetensors_io import SafetensorsFile
from grpax.cli.main import main
from grpax.data.tokenizer import save_tokenizer
from grpax.models import lora as lora_lib
from grpax.models.registry import load_hf_config
from grpax.rl.train_config import TrainConfig
from grpax.rl.trainer import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROWS = [
    {"instruction": f"Write the word {w}.", "target": w} for w in ("cat", "dog", "sun", "sky", "sea", "red")
]
LENGTH = "def length(prompts, completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"


def test_the_rounding_report_counts_by_hand():
    """bfloat16 keeps 8 significant bits: at 1.0 its spacing is 2**-7, at 0.5 2**-8. Of three changed weights,
    1 + 2**-10 rounds back to 1 (under half a spacing), 1 + 2**-7 is kept, and 0.5 + 2**-9 is a tie that rounds
    to the even 0.5."""
    from grpax.checkpoint.rounding import measure

    base = {"w": np.array([1.0, 1.0, 2.0, 0.5], np.float32)}
    trained = {"w": np.array([1 + 2**-10, 1 + 2**-7, 2.0, 0.5 + 2**-9], np.float32)}
    report = measure(trained, base, np.dtype(ml_dtypes.bfloat16), "the base")
    assert (report.total, report.changed, report.kept) == (4, 3, 1)
    delta = np.array([2**-10, 2**-7, 0, 2**-9])
    error = np.array([-(2**-10), 0, 0, -(2**-9)])  # the exported update is [0, 2**-7, 0, 0]
    assert report.relative_error == pytest.approx(np.linalg.norm(error) / np.linalg.norm(delta), rel=1e-12)
    assert report.lost  # 1 of 3 kept
    assert report.line().startswith(
        "33.3% of the 3 weights training changed (of 4) still differ from the base"
    )
    assert "export with weight_dtype=float32" in report.warning()
    kept = measure(trained, base, np.dtype(np.float32), "the base")
    assert (kept.kept, kept.relative_error, kept.lost) == (3, 0.0, False)
    with pytest.raises(ValueError, match="another params tree"):
        measure(trained, {"v": base["w"]}, np.dtype(np.float32), "the base")


@pytest.mark.parametrize("base_dtype", [np.float32, ml_dtypes.bfloat16])
def test_an_export_dtype_that_keeps_every_weight_counts_as_the_compiled_measure_does(monkeypatch, base_dtype):
    """float32 keeps float32 and bfloat16 weights exactly: the numpy count gives the report the compiled
    comparison gives (every changed weight kept, error 0); a base with an inf or NaN takes the compiled one."""
    from grpax.checkpoint import rounding

    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((64, 48)).astype(base_dtype), "n": np.ones(48, base_dtype)}
    trained = {k: v.astype(np.float32) for k, v in base.items()}
    trained["w"][::3] += rng.standard_normal((22, 48)).astype(np.float32) * 1e-3
    fast = rounding.measure(trained, base, np.dtype(np.float32), "the base")
    monkeypatch.setattr(rounding, "_exact", lambda x, dtype: False)
    compiled = rounding.measure(trained, base, np.dtype(np.float32), "the base")
    assert fast == compiled and (fast.changed, fast.kept, fast.relative_error) == (22 * 48, 22 * 48, 0.0)
    monkeypatch.undo()
    base["n"][0] = np.inf
    assert not rounding._exact(base["n"], np.dtype(np.float32))
    report = rounding.measure(trained, base, np.dtype(np.float32), "the base")
    assert (report.changed, report.kept) == (22 * 48 + 1, 22 * 48 + 1) and np.isnan(report.relative_error)
    assert not rounding._exact(trained["w"], np.dtype(ml_dtypes.bfloat16))


def test_to_native_records_the_hugging_face_source_that_a_peft_export_names(tmp_path):
    from grpax.checkpoint.peft import hf_base, save_peft

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    to_native("", tmp_path / "base", hf_model_path=tmp_path / "hf", progress=False)
    recorded = json.loads((tmp_path / "base" / "config.json").read_text())["grpax_converted_from"]
    assert recorded == {"hf_model_path": str(tmp_path / "hf")}
    assert hf_base(tmp_path / "base" / "0" / "items")[0] == str(tmp_path / "hf")
    (tmp_path / "hf").rename(tmp_path / "gone")
    name, how = hf_base(tmp_path / "base" / "0" / "items")
    assert name == str(tmp_path / "hf") and "not there now" in how and "grpax to_huggingface" in how

    # a base of an older grpax (no record), and the adapters' file mode (safetensors writes 0600)
    name, how = hf_base(Path("/nonexistent/0/items"))
    assert name == "" and "export the base first" in how
    cfg = load_hf_config(tmp_path / "base")
    lora = lora_lib.LoraConfig(rank=2, alpha=4.0)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(0))
    meta = {"rank": 2, "alpha": 4.0, "target_modules": list(lora.target_modules), "use_rslora": False}
    save_peft(adapters, cfg, meta, tmp_path / "peft", "org/base")
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "peft").iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"], modes
    assert (
        json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "org/base"
    )


def test_lora_export_peft_of_a_whole_model_is_refused_before_anything_is_read(
    tiny_checkpoint, tmp_path, capsys
):
    code, _, err = _export(
        capsys,
        f"load_parameters_path={tiny_checkpoint}",
        f"base_output_directory={tmp_path / 'p'}",
        "lora_export=peft",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "lora_export=peft writes a LoRA run's adapters, but" in err and "holds a whole model" in err, err
    assert not (tmp_path / "p").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny random Llama saved by transformers (SmolLM2's vocabulary and tokenizer), converted with
    ``to_native hf_model_path=``, then two 2-step runs on it: a full fine-tune at the seed's scale of learning
    rate (1e-6: updates far below bfloat16's spacing) and rank-4 LoRA adapters at 1e-2."""
    tmp = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp / "hf")
    save_tokenizer(read_gguf().tokenizer(), tmp / "hf")
    to_native("", tmp / "base", hf_model_path=tmp / "hf", progress=False)
    data = tmp / "data"
    data.mkdir()
    for split, rows in (("train", ROWS[:4]), ("test", ROWS[4:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "length.py").write_text(LENGTH)
    task = dict(
        dataset_name=str(data), task="custom", prompt_field="instruction", answer_field="target",
        prompt_preset="plain", reward_functions_path=str(tmp / "length.py"), reward_functions=("length",),
        num_batches=2, num_test_batches=0, warmup_ratio=0.0, max_prefill_predict_length=48,
        max_target_length=64,
    )  # fmt: skip
    ckpt = tmp / "base" / "0" / "items"
    full = train(TrainConfig(**tiny_run_keys(ckpt, tmp / "out", run_name="full", learning_rate=1e-6, **task)))
    lora = train(
        TrainConfig(
            **tiny_run_keys(ckpt, tmp / "out", run_name="lora", lora_rank=4, learning_rate=1e-2, **task)
        )
    )
    return tmp, ckpt, Path(full["actor_path"]), Path(lora["actor_path"])


def _export(capsys, *keys) -> tuple[int, str, str]:
    code = main(["to_huggingface", *keys])
    out = capsys.readouterr()
    return code, out.out, out.err


def _hf(params, cfg) -> dict[str, np.ndarray]:
    return {name: np.asarray(w) for name, w in iter_hf_tensors(params, cfg)}


@pytest.mark.slow
def test_the_export_of_a_2_step_run_says_how_much_of_the_update_its_dtype_keeps(runs, capsys):
    """Counted again here from the safetensors the export wrote: the weights the 2 steps changed, those whose
    bfloat16 value differs from the base's bfloat16 value, and the exported update's error."""
    from grpax.checkpoint.convert import to_huggingface

    tmp, ckpt, full, _ = runs
    code, out, err = _export(capsys, f"load_parameters_path={full}", f"base_output_directory={tmp / 'bf16'}")
    assert code == 0
    assert "the bfloat16 export loses most of the training" in err and "weight_dtype=float32" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"still differ from {ckpt} (the run's load_parameters_path" in out, out

    cfg = load_hf_config(tmp / "base")
    trained, base = _hf(restore_params(full), cfg), _hf(restore_params(ckpt), cfg)
    exported = SafetensorsFile(tmp / "bf16" / "model.safetensors")
    changed = kept = 0
    delta_sq = error_sq = 0.0
    for name, t in trained.items():
        b = base[name].astype(np.float64)
        e = exported.get_tensor(name).astype(np.float64)
        moved = t != base[name]
        changed += int(moved.sum())
        kept += int((moved & (e != base[name].astype(ml_dtypes.bfloat16).astype(np.float64))).sum())
        delta = t.astype(np.float64) - b
        delta_sq += float((delta**2).sum())
        error_sq += float(((e - b.astype(ml_dtypes.bfloat16).astype(np.float64) - delta) ** 2).sum())
    assert changed > 0.9 * sum(t.size for t in trained.values())  # 2 AdamW steps move nearly every weight
    assert kept < 0.5 * changed  # ... by less than bfloat16 can show
    report = to_huggingface(full, tmp / "bf16_again", progress=False)["rounding"]
    assert (report.changed, report.kept) == (changed, kept)
    # float32 sums along each weight's last axis, added in float64 (rounding.measure): 1e-5 of float64's
    assert report.relative_error == pytest.approx(np.sqrt(error_sq / delta_sq), rel=1e-5)
    assert report.lost and f"{kept / changed:.1%} of the {changed:,} weights" in out

    code, out, err = _export(
        capsys, f"load_parameters_path={full}", f"base_output_directory={tmp / 'f32'}", "weight_dtype=float32"
    )
    assert code == 0 and err == ""
    assert f"100.0% of the {changed:,} weights training changed" in out and "error is 0x" in out, out


@pytest.mark.slow
def test_the_peft_export_names_its_hugging_face_base_and_loads_on_it_as_the_merged_export(runs, capsys):
    """``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<adapter_config's base>), export)``
    computes the merged export's logits, and the adapters were trained (they change the base's logits)."""
    peft_lib = pytest.importorskip("peft")
    tmp, _, _, lora = runs
    peft_dir, merged_dir = tmp / "peft", tmp / "merged"
    code, out, _ = _export(
        capsys, f"load_parameters_path={lora}", f"base_output_directory={peft_dir}", "lora_export=peft"
    )
    assert code == 0
    hf_base = json.loads((peft_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert hf_base == str(tmp / "hf")
    assert f"from_pretrained({hf_base!r}), {str(peft_dir)!r})" in out, out
    modes = {p.name: p.stat().st_mode & 0o777 for p in peft_dir.iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"] == modes["tokenizer.json"], (
        modes
    )
    assert (
        main(
            [
                "to_huggingface",
                f"load_parameters_path={lora}",
                f"base_output_directory={merged_dir}",
                "weight_dtype=float32",
            ]
        )
        == 0
    )

    tokens = torch.tensor(np.random.RandomState(0).randint(0, 49152, (2, 12)))
    model = transformers.AutoModelForCausalLM
    with torch.no_grad():
        base = model.from_pretrained(hf_base).eval()
        plain = base(tokens).logits.numpy()
        adapted = peft_lib.PeftModel.from_pretrained(base, str(peft_dir)).eval()(tokens).logits.numpy()
        merged = model.from_pretrained(merged_dir).eval()(tokens).logits.numpy()
    assert np.abs(adapted - merged).max() <= 1e-5
    assert np.abs(merged - plain).max() > 1e-4


@pytest.mark.slow
def test_a_moved_lora_base_is_found_with_base_parameters_path(runs, capsys):
    tmp, ckpt, _, lora = runs
    moved = tmp / "moved_base"
    shutil.move(tmp / "base", moved)
    try:
        code, _, err = _export(capsys, f"load_parameters_path={lora}", f"base_output_directory={tmp / 'm1'}")
        assert code == 2 and "pass base_parameters_path=<where it is now>" in err, err
        code, out, _ = _export(
            capsys,
            f"load_parameters_path={lora}",
            f"base_output_directory={tmp / 'm2'}",
            f"base_parameters_path={moved / '0' / 'items'}",
        )
        assert code == 0 and f"from the LoRA base {moved / '0' / 'items'}" in out, out
    finally:
        shutil.move(moved, tmp / "base")


@pytest.mark.slow
def test_a_peft_export_of_a_whole_model_is_refused_in_one_line(runs, capsys):
    tmp, _, full, _ = runs
    code, _, err = _export(
        capsys, f"load_parameters_path={full}", f"base_output_directory={tmp / 'p'}", "lora_export=peft"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "lora_export=peft writes a LoRA run's adapters, but" in err and "holds a whole model" in err, err
    assert not (tmp / "p").exists()


def test_a_base_parameters_path_that_does_not_exist_is_one_line(tiny_checkpoint, tmp_path, capsys):
    code, _, err = _export(
        capsys,
        f"load_parameters_path={tiny_checkpoint}",
        f"base_output_directory={tmp_path / 'hf'}",
        f"base_parameters_path={tmp_path / 'nope'}",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"base_parameters_path='{tmp_path / 'nope'}' does not exist" in err, err
    assert not (tmp_path / "hf").exists()


def test_export_hf_records_the_rounding_and_its_warning_names_a_fix_that_applies(
    tmp_path, monkeypatch, caplog
):
    """train_rl's export_hf writes bfloat16 with no dtype key: its warning names the to_huggingface command that
    keeps the update (weight_dtype=float32 of train_rl is the params' storage dtype, not the export's)."""
    import logging

    from grpax.checkpoint.rounding import RoundingReport
    from grpax.rl import results as results_lib

    report = RoundingReport("the base", "bfloat16", 10, 8, 1, 3.0)
    summary = {"output_dir": str(tmp_path / "hf"), "rounding": report, "rounding_note": ""}
    monkeypatch.setattr(results_lib, "to_huggingface", lambda path, folder: summary)
    results = {"before": None, "after": None, "actor_path": "run/checkpoints/actor/2/model_params"}
    with caplog.at_level(logging.INFO):
        results_lib.publish(results, tmp_path, tmp_path / "eval", str(tmp_path / "hf"), 2, lambda a, b: True)
    assert results["hf_rounding"]["kept_fraction"] == 1 / 8 and results["hf_rounding"]["lost"]
    assert json.loads((tmp_path / "results.json").read_text())["hf_rounding"]["kept"] == 1
    assert (
        "export the step again with grpax to_huggingface load_parameters_path=run/checkpoints/actor/2/model_params "
        "base_output_directory=<new folder> weight_dtype=float32 to keep them" in caplog.text
    )
