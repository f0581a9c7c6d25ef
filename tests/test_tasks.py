"""The task seam without a model: user reward files (MaxText signature, TRL columns), their one-line errors,
custom columns and templates, task=math against math-verify, and ``grpax evaluate`` of a completions file."""

import json
import math
import re
import textwrap

import numpy as np
import pytest

from grpax.cli.main import main
from grpax.config import build_config
from grpax.data.prompts import PromptPreset
from grpax.errors import ConfigError
from grpax.rl.train_config import TrainConfig
from grpax.tasks import RewardFunctionError, build_task, validate_task_keys
from grpax.tasks.base import call_reward_function, weighted_total
from grpax.tasks.user import load_prompt_template, load_reward_functions

REWARDS = """
import math

def length_bonus(prompts, completions, tmvp_config, **kwargs):
    # MaxText's signature: the run's config arrives as tmvp_config
    return [tmvp_config.max_target_length / 100 if len(c) < 10 else 0.0 for c in completions]

def matches_target(prompts, completions, target, **kwargs):
    # a dataset column (here 'target') arrives by keyword, one value per completion (TRL's convention)
    return [1.0 if c.strip() == t else (None if t == "?" else 0.0) for c, t in zip(completions, target)]
"""


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _custom_cfg(tmp_path, **keys):
    args = dict(
        task="custom",
        reward_functions_path=_write(tmp_path / "rewards.py", REWARDS),
        reward_functions="[length_bonus,matches_target]",
        reward_weights="[1.0,0.5]",
        prompt_field="instruction",
        answer_field="target",
        max_target_length=300,
        model_name="",
        prompt_preset="plain",
    )
    args.update(keys)
    return build_config(TrainConfig, [f"{k}={v}" for k, v in args.items()])


def test_user_rewards_get_columns_and_tmvp_config_and_sum_with_weights(tmp_path):
    cfg = _custom_cfg(tmp_path)
    validate_task_keys(cfg)
    task = build_task(cfg)
    data = _jsonl(
        tmp_path / "d.jsonl",
        [{"instruction": "say hi", "target": "hi"}, {"instruction": "say ?", "target": "?"}],
    )
    rows = task.load_rows(data, "train")
    assert [r["question"] for r in rows] == ["say hi", "say ?"]
    scores = task.score([rows[0], rows[0], rows[1]], ["hi", "a long answer", "x"])
    # length_bonus: max_target_length 300 / 100 = 3.0 for completions under 10 characters
    assert scores["length_bonus"] == [3.0, 0.0, 3.0]
    # matches_target: 1.0, 0.0, and None (abstain, NaN) for the '?' target
    assert scores["matches_target"][:2] == [1.0, 0.0] and math.isnan(scores["matches_target"][2])
    # total = 1.0 * length_bonus + 0.5 * matches_target, the abstained value skipped
    assert scores["total"] == [3.5, 0.0, 3.0]
    # correctness (accuracy_reward = the first function by default): points > 0
    records = task.records([rows[0], rows[0]], ["hi", "a long answer"])
    assert [r["correct"] for r in records] == [True, False]
    assert records[0]["rewards"] == {"length_bonus": 3.0, "matches_target": 1.0, "total": 3.5}


def test_weighted_total_abstains_only_when_every_function_does():
    nan = float("nan")
    total = weighted_total({"a": [1.0, nan, nan], "b": [2.0, 4.0, nan]}, {"a": 2.0, "b": 0.25})
    assert total[:2] == [2.5, 1.0] and math.isnan(total[2])


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            lambda prompts, completions, **kw: [1.0 / (len(c) - 3) for c in completions],
            r"^reward function 'bad' \(f\.py\) raised ZeroDivisionError: float division by zero on row 1 "
            r"\(completion 'abc'\)$",
        ),
        (
            lambda prompts, completions, **kw: [1.0],
            r"^reward function 'bad' \(f\.py\) returned 1 values for 3 completions: expected one per",
        ),
        (
            lambda prompts, completions, **kw: [1.0, "high", 0.0],
            r"^reward function 'bad' \(f\.py\) returned 'high' for row 1: expected a finite number, or None",
        ),
        (
            lambda prompts, completions, **kw: [1.0, float("inf"), 0.0],
            r"returned inf for row 1: expected a finite",
        ),
        (lambda prompts, completions, **kw: [True, 1, 0], r"returned True for row 0"),
        (
            lambda prompts, completions, **kw: (1.0 / (len(c) - 3) for c in completions),
            r"raised ZeroDivisionError: float division by zero on row 1 \(completion 'abc'\)$",
        ),
    ],
    ids=["raises", "wrong_length", "string", "inf", "bool", "generator_raises"],
)
def test_bad_reward_function_is_one_line_naming_function_row_and_value(bad, message):
    with pytest.raises(RewardFunctionError, match=message) as e:
        call_reward_function("bad", bad, ["p"] * 3, ["ab", "abc", "abcde"], {}, source="f.py")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            lambda prompts, completions, **kw: 1.0,
            r"returned 1\.0 \(a float\): expected a list of 3 numbers, one per",
        ),
        (
            lambda prompts, completions, **kw: None,
            r"returned None \(a NoneType\): expected a list of 3 numbers",
        ),
        (lambda prompts, completions, **kw: "abc", r"returned 'abc' \(a str\): expected a list of 3 numbers"),
        (
            lambda prompts, completions, **kw: {"a": 1.0},
            r"returned \{'a': 1\.0\} \(a dict\): expected a list",
        ),
        (
            lambda prompts, completions, **kw: np.ones((3, 1)),
            r"returned an array of shape \(3, 1\): expected a list",
        ),
        (lambda prompts, completions, **kw: np.ones(2), r"returned 2 values for 3 completions"),
        (
            lambda prompts, completions, **kw: np.array([True, False, True]),
            r"returned True for row 0: .* \(a bool: ",
        ),
        (
            lambda prompts, completions: [1.0] * 3,
            r"cannot take this call's keywords \['prompts', 'completions', "
            r"'label'\]: got an unexpected keyword argument 'label'; name only these as parameters and end the list "
            r"with \*\*kwargs$",
        ),
        (
            lambda prompts, completions, lbl, **kw: [1.0] * 3,
            r"cannot take .*missing a required argument: 'lbl'",
        ),
    ],
    ids=[
        "float",
        "none",
        "str",
        "dict",
        "2d_array",
        "short_array",
        "bool_array",
        "no_kwargs",
        "no_such_column",
    ],
)
def test_bad_return_types_and_signatures_are_named(bad, message):
    """Before, a float / None returned read 'raised TypeError ... on the batch', a str or dict was split into
    its characters or keys, a missing **kwargs read as a crash of the function."""
    with pytest.raises(
        RewardFunctionError, match=r"^reward function 'bad' \(f\.py\) " + "(.*)" + message
    ) as e:
        call_reward_function(
            "bad", bad, ["p"] * 3, ["a", "b", "c"], {"label": ["x", "y", "z"]}, source="f.py"
        )
    assert "\n" not in str(e.value)


def test_numpy_and_jax_numbers_and_ints_count_as_points():
    import jax.numpy as jnp
    import torch

    for good in (
        lambda prompts, completions, **kw: np.array([1, 2, 3]),
        lambda prompts, completions, **kw: jnp.array([1.0, 2.0, 3.0]),
        lambda prompts, completions, **kw: [np.float32(1.0), jnp.float32(2.0), 3],
        lambda prompts, completions, **kw: [torch.tensor(1.0), torch.tensor(2), np.array(3.0)],
        lambda prompts, completions, **kw: torch.tensor([1.0, 2.0, 3.0]),
        lambda prompts, completions, **kw: (float(len(c)) for c in completions),  # a generator
    ):
        values = call_reward_function("good", good, ["p"] * 3, ["a", "bb", "ccc"], {})
        assert values == [1.0, 2.0, 3.0] and all(type(v) is float for v in values)


def test_none_and_nan_abstain():
    values = call_reward_function(
        "f", lambda prompts, completions, **kw: [None, float("nan"), 2], ["p"] * 3, ["a", "b", "c"], {}
    )
    assert math.isnan(values[0]) and math.isnan(values[1]) and values[2] == 2.0


def test_reward_file_errors_name_the_key_and_what_exists(tmp_path):
    path = _write(tmp_path / "r.py", REWARDS)
    with pytest.raises(
        ConfigError,
        match=r"has no function 'length_bonis'; it defines \['length_bonus', "
        r"'matches_target'\]\. Did you mean 'length_bonus'\?",
    ):
        load_reward_functions(path, ["length_bonis"])
    with pytest.raises(ConfigError, match="reward_functions_path='nope.py' does not exist"):
        load_reward_functions("nope.py", ["a"])
    broken = _write(tmp_path / "broken.py", "import not_a_module_anywhere\n")
    with pytest.raises(ConfigError, match="importing it raised ModuleNotFoundError"):
        load_reward_functions(broken, ["a"])
    keys = [
        "task=custom",
        f"reward_functions_path={path}",
        "reward_functions=[length_bonus]",
        "prompt_preset=plain",
    ]
    with pytest.raises(ConfigError, match=r"reward_weights=\[1\.0, 2\.0\]: 2 weights for 1 reward_functions"):
        validate_task_keys(build_config(TrainConfig, [*keys, "reward_weights=[1,2]"]))
    with pytest.raises(ConfigError, match="task=custom needs reward_functions_path"):
        validate_task_keys(build_config(TrainConfig, ["task=custom"]))
    with pytest.raises(ConfigError, match=r"accuracy_reward='x': expected one of reward_functions"):
        validate_task_keys(build_config(TrainConfig, [*keys, "accuracy_reward=x"]))
    with pytest.raises(ConfigError, match="task='gsm9k': expected one of gsm8k, math, custom"):
        validate_task_keys(build_config(TrainConfig, ["task=gsm9k"]))


def test_keys_that_would_train_on_nan_or_be_ignored_are_refused(tmp_path):
    """Before: reward_weights=[nan] trained with a NaN total (zero advantages, exit 0), accuracy_reward was
    ignored outside task=custom, and a function without **kwargs failed only at step 1, after model load."""
    path = _write(tmp_path / "r.py", REWARDS)
    keys = [
        "task=custom",
        f"reward_functions_path={path}",
        "reward_functions=[length_bonus]",
        "prompt_preset=plain",
    ]
    for weight in ("nan", "inf"):
        with pytest.raises(
            ConfigError, match=rf"reward_weights=\[{weight}\]: {weight} is not a finite number"
        ):
            validate_task_keys(build_config(TrainConfig, [*keys, f"reward_weights=[{weight}]"]))
    validate_task_keys(build_config(TrainConfig, [*keys, "reward_weights=[-0.5]"]))  # negative: fine
    # Before: [length_bonus,length_bonus] with weights [1,2] silently ran it once with weight 2, and a function
    # named 'total' had its points overwritten by the weighted total.
    twice = [*keys[:2], "reward_functions=[length_bonus,length_bonus]", keys[3], "reward_weights=[1,2]"]
    with pytest.raises(ConfigError, match=r"names 'length_bonus' twice: name each function once"):
        validate_task_keys(build_config(TrainConfig, twice))
    with pytest.raises(ConfigError, match=r"'total' is the name of grpax's own reward entry .*: rename"):
        validate_task_keys(build_config(TrainConfig, [*keys[:2], "reward_functions=[total]", keys[3]]))
    gsm8k = ["task=gsm8k", f"reward_functions_path={path}", "reward_functions=[length_bonus]"]
    with pytest.raises(
        ConfigError,
        match=r"^accuracy_reward='length_bonus' is for task=custom; task=gsm8k counts accuracy with",
    ):
        validate_task_keys(build_config(TrainConfig, [*gsm8k, "accuracy_reward=length_bonus"]))
    nokw = _write(tmp_path / "nokw.py", "def f(prompts, completions):\n    return [1.0] * len(completions)\n")
    with pytest.raises(
        ConfigError,
        match=r"^reward function 'f' \(.*nokw\.py\) cannot take this call's keywords \['prompts', 'completions', "
        r"'tmvp_config'\] and every dataset column: got an unexpected keyword argument 'tmvp_config'; name only",
    ):
        load_reward_functions(nokw, ["f"], extra_kwargs={"tmvp_config": None})
    # A column named as a parameter is fine at load time (the columns are known at the call).
    load_reward_functions(path, ["matches_target"], extra_kwargs={"tmvp_config": None})


def test_missing_column_names_the_columns_the_file_has(tmp_path):
    task = build_task(_custom_cfg(tmp_path))
    data = _jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "label": "a"}])
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl: row 1 has no column 'target' \(answer_field='target'\); its columns are "
        r"\['instruction', 'label'\]: set answer_field=<one of them>",
    ):
        task.load_rows(data, "train")


def test_null_cells_are_named_or_have_no_answer(tmp_path):
    """Before: a null prompt trained on the text 'None', and a null answer was the gold answer 'None' (so a
    majority '<answer>None</answer>' counted in maj@k)."""
    task = build_task(_custom_cfg(tmp_path))
    rows = [{"instruction": "q", "target": None}, {"instruction": "r", "target": float("nan")}]
    assert [r["gold"] for r in task.rows_from(rows, "d.jsonl")] == ["", ""]
    assert not task.is_correct("None", "") and not task.is_correct("", "") and task.is_correct(" hi ", "hi")
    with pytest.raises(
        ValueError,
        match=r"^d\.jsonl: row 2 has no value in column 'instruction' \(prompt_field='instruction'\): it is null or "
        r"absent; fill it in or drop the row$",
    ):
        task.rows_from([{"instruction": "q", "target": "a"}, {"instruction": None, "target": "a"}], "d.jsonl")
    # Ragged JSONL: a row without a column some row has gets None there (before: a KeyError traceback in the
    # reward call, or 'set answer_field' although the column exists), so every batch passes the same keywords.
    ragged = task.rows_from(
        [{"instruction": "q", "target": "a"}, {"instruction": "r", "hint": "h"}], "d.jsonl"
    )
    assert [r["gold"] for r in ragged] == ["a", ""]
    assert task.columns(ragged[0]) == {"instruction": "q", "target": "a", "hint": None}
    scores = task.score(ragged, ["a", "b"])
    assert scores["matches_target"] == [1.0, 0.0]
    with pytest.raises(
        ValueError, match=r"row 2 has no value in column 'instruction' .*: it is null or absent"
    ):
        task.rows_from([{"instruction": "q", "target": "a"}, {"target": "b"}], "d.jsonl")
    math_task = build_task(build_config(TrainConfig, ["task=math", "prompt_preset=math", "model_name="]))
    with pytest.raises(ValueError, match=r"row 1 has no value in column 'answer' \(answer_field='answer'\)"):
        math_task.rows_from([{"problem": "1+1?", "answer": None}], "m.jsonl")


def test_prompt_template_files(tmp_path):
    text = load_prompt_template(_write(tmp_path / "t.txt", "Translate: {prompt}\n"))
    assert text == PromptPreset(system_prompt="", user_template="Translate: {question}")
    yml = _write(
        tmp_path / "t.yml",
        "system_prompt: Be brief.\nuser_template: 'Q: {question}'\nresponse_prefix: 'A:'\n",
    )
    assert load_prompt_template(yml) == PromptPreset("Be brief.", "Q: {question}", "A:")
    with pytest.raises(ConfigError, match=r"no \{question\} \(or \{prompt\}\) slot"):
        load_prompt_template(_write(tmp_path / "u.txt", "no slot"))
    task = build_task(_custom_cfg(tmp_path, prompt_template_path=yml))
    assert task.preset.response_prefix == "A:"


def test_broken_template_and_reward_files_are_one_line_errors(tmp_path):
    """Before: a YAML syntax error was a yaml traceback, a list read 'unknown fields ['(not a mapping)']', a
    folder 'does not exist', a non-function name 'has no function'."""
    with pytest.raises(
        ConfigError, match=r"prompt_template_path='.*bad\.yml' is not valid YAML/JSON at line 2, column 1 "
    ) as e:
        load_prompt_template(_write(tmp_path / "bad.yml", 'system_prompt: "unclosed\n'))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"holds a list: expected a mapping with any of \['system_prompt'"):
        load_prompt_template(_write(tmp_path / "list.yml", "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"prompt_template_path='.*' is a folder, not a file"):
        load_prompt_template(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"reward_functions_path='.*' is a folder, not a file .*: pass the \.py"
    ):
        load_reward_functions(str(tmp_path), ["f"])
    path = _write(tmp_path / "r2.py", "SCALE = 3\ndef f(prompts, completions, **kw):\n    return [1.0]\n")
    with pytest.raises(
        ConfigError,
        match=r"^reward_functions: 'SCALE' in .*r2\.py is not a function \(type int\); its functions are \['f'\]",
    ):
        load_reward_functions(path, ["SCALE"])
    raising = _write(tmp_path / "r3.py", "raise ValueError('two\\nlines')\n")
    with pytest.raises(ConfigError, match=r"importing it raised ValueError: two lines$"):
        load_reward_functions(raising, ["f"])


# Hand-written completions and math-verify's verdict on each (gold answer, completion, correct).
MATH_CASES = [
    (r"\frac{1}{2}", r"Half of it: \boxed{\frac{1}{2}}", True),
    (r"\frac{1}{2}", r"so the answer is \boxed{0.5}", True),  # a decimal equals the fraction
    (r"\frac{3}{4}", r"\boxed{ \dfrac{3}{4} }", True),  # \dfrac and spaces
    ("1/2", r"\boxed{\frac12}", True),  # a plain-text gold, braceless \frac
    (r"x^2 + 1", r"<answer>$x^{2}+1$</answer>", True),  # tagged answer, LaTeX spacing
    (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", False),  # wrong
    ("7", r"first \boxed{7} then corrected \boxed{8}", False),  # the last box counts
    ("7", "the answer is seven", False),  # no final answer
    (r"The area is \boxed{12}.", r"\boxed{12}", True),  # a full solution as gold: its last box
]


def test_math_task_scores_as_math_verify_does():
    math_verify = pytest.importorskip("math_verify")
    task = build_task(build_config(TrainConfig, ["task=math", "prompt_preset=math", "model_name="]))
    rows = task.rows_from([{"problem": "q", "answer": g} for g, _, _ in MATH_CASES], "cases")
    completions = [c for _, c, _ in MATH_CASES]
    scores = task.score(rows, completions)
    assert scores["answer_correct"] == [1.0 if ok else 0.0 for _, _, ok in MATH_CASES]
    assert scores["answer_format"] == [0.1] * 7 + [0.0, 0.1]
    assert scores["total"][0] == pytest.approx(1.1) and scores["total"][7] == 0.0
    # The same verdicts as math-verify's own parse + verify of the boxed answers
    for gold, completion, ok in MATH_CASES[:4] + MATH_CASES[5:6]:
        assert math_verify.verify(math_verify.parse(f"${gold}$"), math_verify.parse(completion)) == ok
    records = task.records(rows, completions)
    assert [r["correct"] for r in records] == [ok for _, _, ok in MATH_CASES]
    assert records[1]["extracted_answer"] == "0.5" and records[7]["formatted"] is False


def test_math_without_math_verify_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"^task=math needs the math-verify library: pip install 'grpax\[math\]'$"
    ):
        validate_task_keys(build_config(TrainConfig, ["task=math"]))


def test_evaluate_scores_a_completions_file_with_the_user_rewards(tmp_path, capsys):
    rewards = _write(tmp_path / "rewards.py", REWARDS)
    lines = [
        {"instruction": "say hi", "target": "hi", "completion": "hi"},
        {"instruction": "say hi", "target": "hi", "completion": "hello there, friend"},
        {"instruction": "say yo", "target": "yo", "completion": "no"},
        {"instruction": "say yo", "target": "yo", "completion": "yo"},
    ]
    keys = [
        "task=custom",
        f"completions_path={_jsonl(tmp_path / 'c.jsonl', lines)}",
        f"reward_functions_path={rewards}",
        "reward_functions=matches_target,length_bonus",  # MaxText's comma-separated spelling
        "prompt_field=instruction",
        "answer_field=target",
        "num_eval_passes=2",
        "max_target_length=200",
        "prompt_preset=plain",
        f"output_path={tmp_path / 'out'}",
    ]
    assert main(["evaluate", *keys]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # correct = matches_target > 0: rows 0 and 3; totals 1+2, 0+0, 0+2, 1+2 (length_bonus 200/100 = 2)
    assert summary["accuracy"] == 0.5 and summary["pass@k"] == 1.0
    assert summary["mean_reward"] == pytest.approx((3 + 0 + 2 + 3) / 4)
    records = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert records[1]["rewards"] == {"matches_target": 0.0, "length_bonus": 0.0, "total": 0.0}
    assert "accuracy" in capsys.readouterr().out


def test_evaluate_of_a_bad_completions_file_names_the_key_and_the_fix(tmp_path, capsys):
    """Before: a missing file named 'dataset path' and the Hub, an empty file crashed the reward function, a
    count not a multiple of num_eval_passes (or interleaved questions) named no key."""
    rewards = _write(tmp_path / "rewards.py", REWARDS)
    keys = [
        "task=custom",
        f"reward_functions_path={rewards}",
        "reward_functions=[matches_target]",
        "prompt_field=instruction",
        "answer_field=target",
        "prompt_preset=plain",
    ]
    line = {"instruction": "say hi", "target": "hi", "completion": "hi"}
    other = {**line, "instruction": "say yo"}
    cases = [
        (
            "missing.jsonl",
            [],
            r"completions_path='missing\.jsonl' does not exist \(relative to .*\): pass a ",
        ),
        ("empty.jsonl", [], r"completions_path='.*empty\.jsonl' holds no completions"),
        (
            "three.jsonl",
            [line] * 3,
            r"holds 3 completions, not a multiple of num_eval_passes=2: set num_eval_passes",
        ),
        ("mixed.jsonl", [line, other, line, other], r"lines 1-2 mix questions, but num_eval_passes=2 reads"),
        ("list.jsonl", [[1, 2]], r"line 1 is a JSON list, not an object; each line needs completion"),
    ]
    for name, lines, message in cases:
        arg = name if name == "missing.jsonl" else _jsonl(tmp_path / name, lines)
        assert main(["evaluate", *keys, f"completions_path={arg}", "num_eval_passes=2"]) == 2
        err = capsys.readouterr().err.strip()
        assert re.search(message, err) and "\n" not in err, (name, err)


def test_evaluate_names_a_bad_dataset_before_loading_the_model(tmp_path, capsys):
    """Before: the model loaded first (here a missing checkpoint was the error), and a missing split or column
    then named no key."""
    rewards = _write(tmp_path / "rewards.py", REWARDS)
    (tmp_path / "data").mkdir()  # no test split yet
    keys = [
        "task=custom",
        f"reward_functions_path={rewards}",
        "reward_functions=[matches_target]",
        "prompt_field=instruction",
        "answer_field=target",
        "prompt_preset=plain",
        "model_name=",
        f"load_parameters_path={tmp_path / 'no_checkpoint'}",
    ]
    assert main(["evaluate", *keys, f"dataset_name={tmp_path / 'data'}"]) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"^grpax evaluate: error: dataset_name='.*data' \(eval_split='test'\): no 'test' split", err
    ), err
    _jsonl(tmp_path / "data" / "test.jsonl", [{"instruction": "q", "label": "a"}])
    assert main(["evaluate", *keys, f"dataset_name={tmp_path / 'data'}"]) == 2
    err = capsys.readouterr().err
    assert "(eval_split='test'): " in err and "has no column 'target' (answer_field='target')" in err, err


def test_train_rl_help_names_the_tasks_and_the_reward_keys(capsys):
    assert main(["train_rl", "--help"]) == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    assert "task's reward functions (task=gsm8k by default, math, or custom" in description
    assert "GSM8K rewards" not in description  # before: the only rewards it named


def test_the_readme_reward_file_runs_as_documented(tmp_path):
    """README's "Bring your own task" example file, run as train_rl runs it (hand-computed values)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("# my_rewards.py", 1)[1].split("```", 1)[0]
    path = _write(tmp_path / "my_rewards.py", "# my_rewards.py" + code)
    task = build_task(
        _custom_cfg(
            tmp_path,
            reward_functions_path=path,
            reward_functions="[exact_answer,brevity]",
            reward_weights="[1.0,0.2]",
            prompt_field="question_text",
            answer_field="label",
            max_target_length=356,  # budget 4 * (356 - 256) = 400 characters
        )
    )
    rows = task.rows_from([{"question_text": "2+2?", "label": 4}, {"question_text": "?", "label": None}], "r")
    completions = ["<answer> 4 </answer>", "x" * 100 + "<answer>5</answer>", "<answer>4</answer>"]
    scores = task.score([rows[0], rows[0], rows[1]], completions)
    assert scores["exact_answer"][:2] == [1.0, 0.0] and math.isnan(scores["exact_answer"][2])
    # brevity: 0.5 * (1 - 2 * len / 400) for lengths 20, 118, 18
    assert scores["brevity"] == pytest.approx([0.45, 0.205, 0.455])
    assert scores["total"] == pytest.approx([1.09, 0.041, 0.091])
