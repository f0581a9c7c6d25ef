"""``grpax train_rl`` keys that cannot work are refused before any model is loaded, naming key, value and fix.

Each bad key is passed to ``train`` with a ``load_parameters_path`` that does not exist: a ConfigError (rather than
FileNotFoundError from the model load, or a crash after training) shows that the check runs up front.
"""

import json

import pytest
from conftest import tiny_run_keys

from grpax.config import ConfigError, build_config
from grpax.data.prompts import prepare_rows
from grpax.rl import resume, train_config
from grpax.rl.config import GRPOConfig
from grpax.rl.resume import RunPaths, check_resume
from grpax.rl.train_config import TrainConfig
from grpax.rl.trainer import train
from grpax.tasks import build_task


def _config(tmp_path, **overrides):
    keys = {"dataset_name": str(tmp_path / "gsm8k"), **overrides}  # never read: the checks come first
    return TrainConfig(**tiny_run_keys(tmp_path / "no-such-checkpoint", tmp_path / "out", **keys))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_num_checkpoints_to_keep", 0, r"max_num_checkpoints_to_keep=0: expected >= 1"),
        ("checkpoint_period", 0, r"checkpoint_period=0: expected >= 1"),
        ("log_period", 0, r"log_period=0: expected >= 1"),
        ("num_batches", 0, r"num_batches=0: expected >= 1"),
        ("eval_interval", -1, r"eval_interval=-1: expected >= 0"),
        ("num_test_batches", -2, r"num_test_batches=-2: expected >= 1 .*, or -1 .*, or 0 for no evaluation"),
        ("eval_batch_size", 0, r"eval_batch_size=0: expected >= 1"),
        ("num_eval_passes", 0, r"num_eval_passes=0: expected >= 1"),
        ("micro_batch_size", 0, r"micro_batch_size=0: expected >= 1 prompts per micro-batch, or -1 to use "),
        (
            "micro_batch_size",
            -2,
            r"micro_batch_size=-2: expected >= 1 prompts per micro-batch, or -1 to use ",
        ),
    ],
)
def test_bad_counts_are_refused_before_the_model_loads(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        train(_config(tmp_path, **{key: value}))
    assert not (tmp_path / "out").exists()


def test_whole_split_no_evaluation_and_zero_eval_interval_are_accepted(tmp_path):
    train_config.validate(_config(tmp_path, num_test_batches=-1, eval_interval=0))
    train_config.validate(_config(tmp_path, num_test_batches=0, eval_interval=1))


@pytest.mark.parametrize("value", ["0", "-1e-5", "0.0"])
def test_learning_rate_must_be_positive(value):
    with pytest.raises(ConfigError, match=rf"learning_rate={float(value)}: expected a finite value > 0"):
        build_config(TrainConfig, [f"learning_rate={value}"])
    with pytest.raises(ConfigError, match="learning_rate"):
        GRPOConfig(learning_rate=float(value))
    assert GRPOConfig(learning_rate=1e-6).learning_rate == 1e-6


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("adam_eps", "0", r"adam_eps=0.0: expected a finite value > 0"),  # Adam's 0 / 0 on a zero gradient
        ("learning_rate", "inf", r"learning_rate=inf: expected a finite value > 0"),
        ("learning_rate", "nan", r"learning_rate=nan: expected a finite value > 0"),
        ("temperature", "nan", r"temperature=nan: expected a finite value > 0"),
        ("decode_sampling_temperature", "inf", r"temperature=inf: expected a finite value > 0"),
        ("beta", "nan", r"beta=nan: expected a finite KL coefficient >= 0"),
        ("adam_b1", "5", r"b1=5.0: expected a finite value in \[0, 1\)"),
        ("b2", "-1", r"b2=-1.0: expected a finite value in \[0, 1\)"),
        ("weight_decay", "-3", r"weight_decay=-3.0: expected a finite value >= 0"),
        ("max_grad_norm", "nan", r"max_grad_norm=nan: expected a finite value >= 0"),
        ("epsilon_high", "inf", r"epsilon_high=inf: expected 0 <= eps < 1, finite eps_high >= 0"),
        ("decode_sampling_nucleus_p", "0", r"decode_sampling_nucleus_p=0.0: expected a mass in \(0, 1\]"),
        ("decode_sampling_nucleus_p", "nan", r"decode_sampling_nucleus_p=nan: expected a mass in \(0, 1\]"),
        ("decode_sampling_top_k", "-5", r"decode_sampling_top_k=-5: expected >= 0 tokens"),
    ],
)
def test_non_finite_and_out_of_range_optimizer_and_sampling_keys_are_refused(tmp_path, key, value, message):
    """Through the command line's parser, before any model loads (the checkpoint path does not exist)."""
    args = [f"load_parameters_path={tmp_path / 'no-such-checkpoint'}", f"{key}={value}"]
    with pytest.raises(ConfigError, match=message):
        train(build_config(TrainConfig, args))


def test_biased_settings_warn_with_the_fix(tmp_path, caplog):
    train_config.validate(_config(tmp_path))  # the defaults: no filter, token ratios
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    train_config.validate(_config(tmp_path, decode_sampling_top_k=50, temperature=1.0))
    assert "set decode_sampling_top_k=0 decode_sampling_nucleus_p=1 for unbiased rollouts" in caplog.text
    caplog.clear()
    train_config.validate(
        _config(tmp_path, decode_sampling_top_k=50, temperature=0.7)
    )  # T < 1: allowed quietly
    assert not caplog.text
    train_config.validate(_config(tmp_path, importance_sampling_level="sequence"))
    assert "set loss_agg_mode=sequence-mean-token-mean" in caplog.text
    caplog.clear()
    train_config.validate(_config(tmp_path, adv_estimator="rloo"))  # with the default scale_rewards=group
    assert "set scale_rewards=none for RLOO as TRL and verl define it" in caplog.text
    caplog.clear()
    train_config.validate(_config(tmp_path, adv_estimator="rloo", scale_rewards="none"))
    assert not caplog.text


def test_export_hf_into_a_non_empty_folder_is_refused(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    train_config.validate(_config(tmp_path, export_hf=str(folder)))  # empty: fine
    train_config.validate(_config(tmp_path, export_hf=str(tmp_path / "new")))  # absent: fine
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"export_hf=.*hf' already exists and is not an empty folder"):
        train(_config(tmp_path, export_hf=str(folder)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="export_hf"):
        train_config.validate(_config(tmp_path, export_hf=str(tmp_path / "file")))


def _saved_run(tmp_path, **overrides):
    cfg = _config(tmp_path, **overrides)
    paths = RunPaths.of(cfg)
    paths.run_dir.mkdir(parents=True)
    resume.write_config(paths, cfg)
    return paths


def test_resume_below_the_latest_step_is_refused(tmp_path):
    paths = _saved_run(tmp_path, num_batches=4)
    with pytest.raises(ConfigError) as err:
        check_resume(_config(tmp_path, num_batches=1), paths, latest=4)
    message = str(err.value)
    assert str(paths.run_dir) in message and "step 4" in message and "num_batches=1" in message
    assert "raise num_batches" in message and "new run_name" in message
    # Equal: the finished run is evaluated again.
    assert check_resume(_config(tmp_path, num_batches=4), paths, latest=4) == {}


def test_resume_reports_changed_keys_and_refuses_fixed_ones(tmp_path):
    paths = _saved_run(tmp_path, num_batches=4)
    changes = check_resume(_config(tmp_path, num_batches=6, learning_rate=2e-3), paths, latest=4)
    assert changes == {"learning_rate": (1e-3, 2e-3), "num_batches": (4, 6)}
    for key, value in [("batch_size", 4), ("num_generations", 4), ("seed", 7), ("model_name", "x")]:
        with pytest.raises(ConfigError, match=rf"{key}=.* \(now {value!r}\).*cannot change {key}"):
            check_resume(_config(tmp_path, **{key: value}), paths, latest=2)
    with pytest.raises(ConfigError, match="cannot change load_parameters_path"):
        check_resume(_config(tmp_path, load_parameters_path=str(tmp_path / "other")), paths, latest=2)
    # The same folder spelled differently is not a change.
    same = str(tmp_path / "x" / ".." / "no-such-checkpoint")
    assert check_resume(_config(tmp_path, num_batches=4, load_parameters_path=same), paths, latest=2) == {}


def test_resume_refuses_a_changed_layer_layout(tmp_path):
    paths = _saved_run(tmp_path, num_batches=4)
    with pytest.raises(ConfigError, match=r"scan_layers=True \(now False\).*cannot change scan_layers"):
        check_resume(_config(tmp_path, num_batches=4, scan_layers=False), paths, latest=2)


def test_resume_refuses_a_changed_weight_dtype(tmp_path):
    """Issue 45 trial: a resume with weight_dtype=bfloat16 (a float32 run) stopped after the model load with
    Orbax's 5-line tree mismatch (a 16-bit run's optimizer state holds a float32 master copy)."""
    paths = _saved_run(tmp_path, num_batches=4)
    with pytest.raises(
        ConfigError, match=r"weight_dtype='float32' \(now 'bfloat16'\).*cannot change weight_dtype"
    ):
        check_resume(_config(tmp_path, num_batches=4, weight_dtype="bfloat16"), paths, latest=2)


def test_resume_on_a_dataset_smaller_than_the_saved_position_is_one_line(tmp_path):
    """Issue 45 trial: 'iterator index 2 out of range for 1 rows', naming no key and no fix."""
    import types

    import jax.numpy as jnp

    from grpax.data.iterator import PromptIterator
    from grpax.rl.resume import restore_or_start
    from grpax.rl.train_step import TrainState

    cfg = _config(tmp_path, dataset_name="one.jsonl")
    paths = _saved_run(tmp_path)
    meta = {"step": 2, "optimizer_step": 2, "iterator": {"epoch": 0, "index": 2, "seed": 42}}
    checkpointer = types.SimpleNamespace(latest_step=lambda: 2, restore=lambda step, p, o: (p, o, meta))
    state = TrainState(params={}, opt_state={}, step=jnp.zeros((), jnp.int32))
    with pytest.raises(ConfigError) as e:
        restore_or_start(cfg, paths, True, checkpointer, None, state, PromptIterator([{}], 1), {})
    assert str(e.value) == (
        f"run {paths.run_dir} stopped at prompt 2 of an epoch of its training prompts, past the 1 prompts of "
        "dataset_name='one.jsonl' (train_split='train') now: resume with the dataset it was trained on (a larger "
        "one continues at the saved position), or pass a new run_name"
    )


def test_resume_compares_load_paths_as_absolute(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    paths = _saved_run(tmp_path, load_parameters_path="ckpt")  # relative: saved as <tmp>/a/ckpt
    assert json.loads((paths.run_dir / "config.json").read_text())["load_parameters_path"] == str(
        tmp_path / "a" / "ckpt"
    )
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")  # the same relative spelling now names another folder
    with pytest.raises(ConfigError, match="cannot change load_parameters_path"):
        check_resume(_config(tmp_path, load_parameters_path="ckpt"), paths, latest=2)
    assert (
        check_resume(_config(tmp_path, load_parameters_path=str(tmp_path / "a" / "ckpt")), paths, latest=2)
        == {}
    )
    # A relative path saved by an older grpax cannot be compared and is not held against the resume.
    record = json.loads((paths.run_dir / "config.json").read_text())
    (paths.run_dir / "config.json").write_text(json.dumps({**record, "load_parameters_path": "ckpt"}))
    assert check_resume(_config(tmp_path, load_parameters_path="/elsewhere"), paths, latest=2) == {}


def test_resume_with_a_corrupt_config_names_the_file(tmp_path):
    paths = _saved_run(tmp_path)
    (paths.run_dir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON .*delete it to resume"):
        check_resume(_config(tmp_path), paths, latest=2)


def test_export_hf_is_refused_with_several_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(train_config.jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="export_hf=.* single-process jobs only.*grpax to_huggingface"):
        train_config.validate(_config(tmp_path, export_hf=str(tmp_path / "hf")))
    train_config.validate(_config(tmp_path))


def _jsonl(path, count):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _refused_before_loading(tmp_path, **keys) -> str:
    """The ConfigError of ``train``: it comes before the model load (the checkpoint does not exist)."""
    with pytest.raises(ConfigError) as err:
        train(_config(tmp_path, **keys))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    return str(err.value)


def _passes_input_checks(tmp_path, **keys) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint does not exist"):
        train(_config(tmp_path, **keys))


def test_evaluating_on_the_training_file_is_refused_naming_the_keys(tmp_path):
    data = _jsonl(tmp_path / "rows.jsonl", 10)
    assert _refused_before_loading(tmp_path, dataset_name=data) == (
        f"dataset_name={data!r} (eval_split='test') holds the training rows (dataset_name={data!r}, "
        "train_split='train'; a file has no splits): set eval_dataset_name=<held-out file or folder>, or "
        "allow_eval_on_train_rows=true to evaluate on training rows anyway (num_test_batches=0: no evaluation)"
    )
    assert "eval_dataset_name=" in _refused_before_loading(
        tmp_path, dataset_name=data, eval_dataset_name=data
    )
    _passes_input_checks(
        tmp_path, dataset_name=data, eval_dataset_name=_jsonl(tmp_path / "held_out.jsonl", 3)
    )
    _passes_input_checks(tmp_path, dataset_name=data, allow_eval_on_train_rows=True)
    _passes_input_checks(tmp_path, dataset_name=data, num_test_batches=0)


def test_evaluating_on_the_training_split_is_refused(tmp_path):
    _jsonl(tmp_path / "gsm8k" / "train.jsonl", 10)
    _jsonl(tmp_path / "gsm8k" / "test.jsonl", 3)
    assert "holds the training rows" in _refused_before_loading(tmp_path, eval_split="train")
    _passes_input_checks(tmp_path)


def test_empty_evaluation_split_is_refused_before_training(tmp_path):
    """It used to train every step (eval_before=false) and fail only at the final evaluation: no results."""
    _jsonl(tmp_path / "gsm8k" / "train.jsonl", 10)
    _jsonl(tmp_path / "gsm8k" / "test.jsonl", 0)
    assert _refused_before_loading(tmp_path, eval_before=False) == (
        f"dataset_name='{tmp_path}/gsm8k' (eval_split='test') has 0 rows, fewer than 1 question: pass a "
        "dataset with evaluation rows, or num_test_batches=0 for no evaluation"
    )


def test_too_few_training_rows_name_the_dataset_split_and_key(tmp_path):
    _jsonl(tmp_path / "gsm8k" / "train.jsonl", 5)
    _jsonl(tmp_path / "gsm8k" / "test.jsonl", 3)
    assert _refused_before_loading(tmp_path, batch_size=8, num_generations=2) == (
        f"dataset_name='{tmp_path}/gsm8k' (train_split='train') has 5 rows, fewer than batch_size=8 (prompts "
        "per step): lower batch_size or pass a larger dataset"
    )
    missing = str(tmp_path / "gsm8kk")
    assert _refused_before_loading(tmp_path, dataset_name=missing).startswith(
        f"dataset_name={missing!r} (train_split='train'): dataset path {missing!r} does not exist"
    )


def test_too_few_rows_after_the_length_filter_name_the_dataset_split_and_key(tmp_path):
    from grpax.checkpoint.gguf import read_gguf
    from grpax.tasks.gsm8k import load_dataset_rows as load
    from grpax.tasks.prompts import get_prompt_preset

    data = _jsonl(tmp_path / "gsm8k" / "train.jsonl", 5)
    tokenizer, preset = read_gguf().tokenizer(), get_prompt_preset("maxtext")
    with pytest.raises(ConfigError) as err:
        prepare_rows(tokenizer, data, "train", preset, 20, load=load, need=("dataset_name", "train_split", 4))
    assert str(err.value) == (
        f"dataset_name={data!r} (train_split='train') has 0 prompts of at most max_prefill_predict_length=20 "
        "tokens (5 longer), fewer than the 4 needed: raise max_prefill_predict_length or pass a larger dataset"
    )
    assert (
        len(prepare_rows(tokenizer, data, "train", preset, 256, load=load, need=("dataset_name", "x", 5)))
        == 5
    )


def _short_context_checkpoint(tmp_path, max_position_embeddings=256):
    """Only a config.json (max_position_embeddings) above an empty params folder: the check reads no more."""
    from grpax.models.registry import get_model_config, to_hf_config

    cfg = get_model_config("smollm2-135m-Instruct", max_position_embeddings=max_position_embeddings)
    (tmp_path / "ckpt" / "0" / "items").mkdir(parents=True)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    return tmp_path / "ckpt" / "0" / "items"


def test_max_target_length_beyond_the_models_positions_is_refused(tmp_path):
    ckpt = _short_context_checkpoint(tmp_path)
    keys = tiny_run_keys(ckpt, tmp_path / "out", dataset_name=str(tmp_path / "never-read"))
    with pytest.raises(ConfigError) as err:
        train(TrainConfig(**keys))  # max_target_length=272
    assert str(err.value) == (
        f"max_target_length=272 exceeds the model's max_position_embeddings=256 ({tmp_path}/ckpt/config.json): "
        "positions past it were never trained; pass at most 256 tokens"
    )


def test_hf_train_files_and_hf_eval_files_name_the_rows_read(tmp_path):
    """MaxText's hf_train_files / hf_eval_files: the files read instead of the dataset's splits, a glob reading
    every file it matches in order, and the errors naming the key."""
    shards = [_jsonl(tmp_path / "data" / f"train-{i}.jsonl", 3) for i in range(2)]
    held_out = _jsonl(tmp_path / "held_out.jsonl", 2)
    glob = str(tmp_path / "data" / "train-*.jsonl")
    cfg = _config(tmp_path, hf_train_files=glob, hf_eval_files=held_out, batch_size=4, num_generations=2)
    inputs = train_config.check_inputs(cfg, build_task(cfg))
    assert [r["question"] for r in inputs.train_rows] == [f"What is {i} + 1?" for i in range(3)] * 2
    assert [r["question"] for r in inputs.eval_rows] == ["What is 0 + 1?", "What is 1 + 1?"]
    assert len(shards) == 2 and _refused_before_loading(
        tmp_path, hf_train_files=glob, hf_eval_files=held_out, batch_size=8, num_generations=2
    ) == (
        f"hf_train_files={glob!r} (train_split='train') has 6 rows, fewer than batch_size=8 (prompts per step): "
        "lower batch_size or pass a larger dataset"
    )
    nothing = str(tmp_path / "data" / "eval-*.parquet")
    assert _refused_before_loading(tmp_path, hf_train_files=glob, hf_eval_files=nothing).startswith(
        f"hf_eval_files={nothing!r}: no .jsonl / .json / .parquet file matches {nothing!r}"
    )
    assert "holds the training rows (hf_train_files=" in _refused_before_loading(
        tmp_path, hf_train_files=glob, hf_eval_files=glob
    )


def test_hf_files_on_the_hub_are_refused_offline_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = "hf://datasets/nvidia/OpenMathInstruct-2/data/train_1M-*.parquet"
    assert _refused_before_loading(tmp_path, hf_train_files=files, num_test_batches=0) == (
        f"hf_train_files={files!r} (train_split='train'): cannot load Hub files {files!r}: offline mode is set; "
        "download them and pass their local path or glob"
    )


def test_eval_mode_is_one_of_maxtexts(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^eval_mode='pass@1': expected one of pass \(pass@k\), maj \(maj@k\), "
    ):
        train_config.validate(_config(tmp_path, eval_mode="pass@1"))


def test_evaluation_files_shared_with_a_training_glob_are_refused(tmp_path):
    """Two globs, or a glob and a file, that share a file read those rows for training and evaluation both: it
    was compared as the whole list of files, so a partial overlap went unseen. The fix names the key that chose
    the evaluation rows (hf_eval_files wins over eval_dataset_name, so naming that one fixed nothing)."""
    shards = [_jsonl(tmp_path / "data" / f"part-{i}.jsonl", 3) for i in range(2)]
    glob = str(tmp_path / "data" / "*.jsonl")
    assert _refused_before_loading(tmp_path, hf_train_files=glob, hf_eval_files=shards[0]) == (
        f"hf_eval_files={shards[0]!r} (eval_split='test') holds the training rows (hf_train_files={glob!r}, "
        "train_split='train'; a file has no splits): set hf_eval_files=<held-out file or folder>, or "
        "allow_eval_on_train_rows=true to evaluate on training rows anyway (num_test_batches=0: no evaluation)"
    )
    held_out = _jsonl(tmp_path / "held_out.jsonl", 2)
    both = str(tmp_path / "*" / "*.jsonl")  # part-0, part-1 and held_out (the last under tmp_path itself: no)
    wider = str(tmp_path / "**" / "*.jsonl")
    assert _refused_before_loading(tmp_path, hf_train_files=shards[1], hf_eval_files=wider).startswith(
        f"hf_eval_files={wider!r} (eval_split='test') holds training rows (both read part-1.jsonl) "
    )
    assert "holds training rows (both read part-0.jsonl, part-1.jsonl)" in _refused_before_loading(
        tmp_path, hf_train_files=both, eval_dataset_name=wider
    )
    _passes_input_checks(tmp_path, hf_train_files=glob, hf_eval_files=held_out)
    _passes_input_checks(
        tmp_path, hf_train_files=glob, hf_eval_files=shards[0], allow_eval_on_train_rows=True
    )
