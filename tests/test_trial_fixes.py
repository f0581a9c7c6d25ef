"""Fixes from the careless-user trial of issue 27's last item (a fresh clone, only the README).

Each test failed before its fix: the case it reproduces is named in its docstring.
"""

import pytest

from grpax.cli.generate import GenerateConfig, read_prompts
from grpax.config import ConfigError, build_config
from grpax.rl.train_config import TrainConfig
from grpax.tasks import build_task

REWARDS = "def f(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n"


def _task(tmp_path, *keys):
    rewards = tmp_path / "r.py"
    rewards.write_text(REWARDS)
    argv = ["model_name=", f"reward_functions_path={rewards}", "reward_functions=[f]", *keys]
    return build_task(build_config(TrainConfig, argv))


CONVERSATION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize(
    "task_keys", [["task=custom", "prompt_preset=plain"], ["task=math", "prompt_preset=math"]]
)
@pytest.mark.parametrize(
    "prompt, shown",
    [
        (
            CONVERSATION,
            r'\[\{"role": "user", "content": "What is 2\+2\?"\}\], not text \(a list of chat messages',
        ),
        ({"text": "hi"}, r'\{"text": "hi"\}, not text: fix the row'),
        (7, r"7, not text: fix the row"),
        ("  ", r'"  ", not text: fix the row'),
    ],
)
def test_a_prompt_cell_that_is_not_text_is_named(tmp_path, task_keys, prompt, shown):
    """Case c73: a TRL conversational prompt column (a list of messages) was sampled as its Python repr
    "[{'role': 'user', ...}]" by task=custom and task=math, and scored and trained on with exit 0."""
    task = _task(tmp_path, *task_keys)
    column = "prompt" if "task=custom" in task_keys else "problem"
    rows = [{column: "1+1?", "answer": "2"}, {column: prompt, "answer": "4"}]
    with pytest.raises(
        ValueError, match=rf"^d\.jsonl: row 2 column '{column}' \(prompt_field='{column}'\) holds {shown}"
    ):
        task.rows_from(rows, "d.jsonl")
    assert [r["question"] for r in task.rows_from(rows[:1], "d.jsonl")] == ["1+1?"]


def test_a_math_answer_that_is_a_list_is_named(tmp_path):
    task = _task(tmp_path, "task=math", "prompt_preset=math")
    with pytest.raises(ValueError, match=r"row 1 column 'answer' \(answer_field='answer'\) holds list"):
        task.rows_from([{"problem": "1+1?", "answer": ["2"]}], "m.jsonl")
    assert task.rows_from([{"problem": "1+1?", "answer": 2}], "m.jsonl")[0]["gold"] == "2"


def _prompts(tmp_path, data: bytes):
    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    return read_prompts(build_config(GenerateConfig, [f"prompts_path={path}"])), str(path)


@pytest.mark.parametrize(
    "line, shown",
    [
        (b'{"prompt": null}', "null, not the prompt's text"),
        (b'{"prompt": 3}', "3, not the prompt's text"),
        (
            b'{"prompt": [{"role": "user", "content": "hi"}]}',
            "not the prompt's text (a list of chat messages",
        ),
    ],
)
def test_generate_prompts_path_refuses_a_prompt_that_is_not_text(tmp_path, line, shown):
    """Case c74: {"prompt": null} was sampled as the text 'None' (exit 0)."""
    with pytest.raises(ConfigError) as e:
        _prompts(tmp_path, b'{"prompt": "ok"}\n\n' + line + b"\n")
    assert "p.jsonl:3 'prompt' holds " in str(e.value) and shown in str(e.value)


def test_generate_prompts_path_reads_a_bom_and_names_a_non_utf8_line(tmp_path):
    """Cases c75-c76: a UTF-8 byte-order mark was 'not valid JSON' (datasets accept it), and a Latin-1 byte
    printed "'utf-8' codec can't decode byte 0xe9 ..." without the file or the line."""
    assert _prompts(tmp_path, b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n')[0] == ["café"]
    with pytest.raises(
        ConfigError, match=r"^prompts_path: .*p\.jsonl: line 2 is not UTF-8 \(byte 16 is b'\\xe9'\)"
    ):
        _prompts(tmp_path, b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')


@pytest.mark.parametrize("command", ["train_rl", "evaluate", "generate"])
@pytest.mark.parametrize("seed", ["-1", str(2**63), str(2**64)])
def test_a_seed_numpy_or_jax_refuses_is_named_before_the_model_loads(command, seed):
    """Cases k_seed_-1 / k_seed_2**64: train_rl seed=-1 printed 'error: expected non-negative integer' (no key
    named) after loading the model; seed=2**64 reached jax's 'Python int too large to convert to C long'."""
    from grpax.cli.evaluate import EvaluateConfig

    cls = {"train_rl": TrainConfig, "evaluate": EvaluateConfig, "generate": GenerateConfig}[command]
    with pytest.raises(ConfigError, match=rf"^seed={seed}: expected an integer in \[0, 2\*\*63 - 1\]$"):
        build_config(cls, [f"seed={seed}"])
    assert (
        build_config(cls, [f"seed={2**63 - 1}"]).seed == 2**63 - 1 and build_config(cls, ["seed=0"]).seed == 0
    )


def test_evaluate_refuses_a_completions_file_and_a_checkpoint_together(tmp_path, capsys):
    """Case c77: completions_path=FILE with load_parameters_path=CKPT scored the file, ignored the checkpoint
    without a word and exited 0 (a user who meant to evaluate the checkpoint read the file's numbers)."""
    from grpax.cli.main import main

    path = tmp_path / "c.jsonl"
    path.write_text('{"question": "q", "answer": "#### 3", "completion": "<answer>3</answer>"}\n')
    assert main(["evaluate", f"completions_path={path}", "load_parameters_path=ckpt/0/items"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"grpax evaluate: error: completions_path='{path}' and load_parameters_path='ckpt/0/items': "
    )
    assert "pass one" in err and "\n" not in err
    assert main(["evaluate", f"completions_path={path}"]) == 0


def test_a_broken_chat_template_is_named_at_load(tmp_path):
    """Case c82: a chat_template.jinja with a Jinja syntax error printed jinja2's 37-line traceback when generate
    rendered the first prompt (after the model had loaded)."""
    from grpax.checkpoint import gguf
    from grpax.data.tokenizer import load_tokenizer, save_tokenizer

    try:
        tokenizer = gguf.read_gguf(gguf.default_gguf_path()).tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    folder = tmp_path / "ckpt"
    save_tokenizer(tokenizer, folder)
    template = folder / "chat_template.jinja"
    assert template.is_file() and load_tokenizer(folder).chat_template  # the saved one loads and is checked
    template.write_text("{% for m in messages %}\n{{ m.content }\n")
    with pytest.raises(
        ValueError, match=rf"^{template}: the chat template is not valid Jinja at its line 2 \("
    ):
        load_tokenizer(folder)


def test_an_output_folder_under_a_file_names_the_key(tiny_checkpoint, tmp_path, capsys):
    """Cases c117 / c119: to_huggingface / to_native base_output_directory=/dev/null/x printed
    "[Errno 17] File exists: '/dev/null'", naming neither the key nor the fix."""
    from grpax.cli.main import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "hf"
    args = [
        "to_huggingface",
        "model_name=",
        f"load_parameters_path={tiny_checkpoint}",
        f"base_output_directory={out}",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"grpax to_huggingface: error: cannot write base_output_directory='{out}': {blocker} is a file, not a folder;"
    ), err
    assert "pass a folder you can write to" in err and "\n" not in err
    assert blocker.read_text() == "" and list(tmp_path.iterdir()) == [blocker]


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch, capsys):
    """Case c126b: a .parquet completions file (or dataset) without pyarrow installed (the README's install
    lacks it) printed a 27-line ImportError traceback around the message."""
    import sys

    from grpax.cli.main import main

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow.parquet raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    rewards = tmp_path / "r.py"
    rewards.write_text(REWARDS)
    data = tmp_path / "c.parquet"
    data.write_bytes(b"PAR1")
    keys = ["task=custom", "prompt_preset=plain", f"reward_functions_path={rewards}", "reward_functions=[f]"]
    assert main(["evaluate", *keys, f"completions_path={data}"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        f"reading {data} needs pyarrow: pip install pyarrow (or pass a .jsonl file)" in err
        and "\n" not in err
    )


@pytest.mark.parametrize("second", ["b.yml", "config=b.yml"])
def test_a_second_config_file_is_refused(tmp_path, monkeypatch, second):
    """Case c133: `grpax train_rl a.yml b.yml ...` used b.yml only; a.yml's keys were dropped without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text("num_batches: 7\n")
    (tmp_path / "b.yml").write_text("batch_size: 2\n")
    with pytest.raises(ConfigError, match=r"^two config files, a\.yml and b\.yml: pass one"):
        build_config(TrainConfig, ["a.yml", second])
    both = build_config(TrainConfig, ["a.yml", "batch_size=2"])
    assert (both.num_batches, both.batch_size) == (7, 2)


def test_a_refused_resume_does_not_first_warn_that_the_learning_rate_jumps(tmp_path, caplog):
    """Case c62: `num_batches=3 batch_size=2` on a run of batch_size=1 logged "resuming at step 2 with changed
    num_batches ...: the learning rate jumps ..." and then refused the resume."""
    import logging

    from conftest import tiny_run_keys

    from grpax.rl import resume

    def config(**keys):
        return TrainConfig(**tiny_run_keys(tmp_path / "ckpt", tmp_path / "out", dataset_name="d", **keys))

    cfg = config(num_batches=10, warmup_ratio=0.0)
    paths = resume.RunPaths.of(cfg)
    paths.run_dir.mkdir(parents=True)
    resume.write_config(paths, cfg)
    with caplog.at_level(logging.WARNING, logger="grpax.train"):
        with pytest.raises(
            ConfigError, match=r"was started with batch_size=.* a resumed run cannot change batch_size"
        ):
            resume.check_resume(
                config(num_batches=20, warmup_ratio=0.0, batch_size=cfg.batch_size + 1), paths, 5
            )
        assert "learning rate jumps" not in caplog.text
        resume.check_resume(config(num_batches=20, warmup_ratio=0.0), paths, latest=5)
    assert (
        "resuming at step 5 with changed num_batches (10 -> 20)" in caplog.text
    )  # an accepted one still warns


@pytest.mark.parametrize("left", ["nothing", "folder", "step"])
def test_an_interrupted_train_rl_says_what_it_left(tmp_path, monkeypatch, capsys, left):
    """Cases c71 / c127: Ctrl-C or SIGTERM before the first checkpoint said "the checkpoints saved so far are
    kept: the same command resumes from the last one" while none existed and the run folder had been removed."""
    from grpax.cli import main as cli_main
    from grpax.cli import train_rl
    from grpax.interrupts import Interrupted

    run_dir = tmp_path / "out" / "r"

    def interrupted_train(config, fit=None):
        if left != "nothing":
            run_dir.mkdir(parents=True)
        if left == "step":
            (run_dir / "checkpoints" / "actor" / "4").mkdir(parents=True)
            (run_dir / "checkpoints" / "actor" / "6.orbax-checkpoint-tmp").mkdir()
        raise Interrupted(15)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(train_rl, "train", interrupted_train)
    monkeypatch.setattr(cli_main.os, "_exit", exit_)
    with pytest.raises(SystemExit) as e:
        cli_main.main(["train_rl", "model_name=", f"base_output_directory={tmp_path / 'out'}", "run_name=r"])
    assert e.value.code == 143
    err = capsys.readouterr().err.strip()
    said = {
        "nothing": f"no checkpoint had been saved yet, and {run_dir} was removed",
        "folder": f"no checkpoint had been saved yet: the same command starts {run_dir} afresh",
        "step": "the checkpoints saved so far are kept (last: step 4): the same command resumes from it",
    }[left]
    assert err == f"grpax train_rl: interrupted (SIGTERM); {said}"
