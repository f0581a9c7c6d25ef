"""Reward functions cannot poison each other or the run (issue 27, item 4): each call gets its own copies of its
inputs, ``sys.exit`` in a reward file is one line, a hung function stops at ``reward_timeout_seconds``, and a
return too large for a float is named instead of an ``OverflowError`` traceback."""

from __future__ import annotations

import textwrap
import time

import pytest

from grpax.errors import ConfigError
from grpax.tasks import RewardFunctionError
from grpax.tasks.base import UserRewards, call_reward_function, run_user_rewards
from grpax.tasks.user import load_reward_functions


def test_an_in_place_edit_changes_nothing_the_next_function_or_epoch_sees():
    def vandal(prompts, completions, answer, **kwargs):
        completions[:] = ["3"] * len(completions)  # "fixes" every answer in place
        answer[0].append("junk")
        return [0.0] * len(completions)

    def accuracy(prompts, completions, answer, **kwargs):
        return [float(c == a[0]) for c, a in zip(completions, answer, strict=True)]

    rewards = UserRewards(
        fns={"vandal": vandal, "accuracy": accuracy}, weights={"vandal": 1.0, "accuracy": 1.0}
    )
    completions, gold = ["3", "4"], [["3"], ["3"]]
    scores = run_user_rewards(rewards, ["q", "q"], completions, {"answer": gold})
    assert scores["accuracy"] == [1.0, 0.0]  # before: [1.0, 1.0], the half-wrong answers scored right
    assert completions == ["3", "4"] and gold == [["3"], ["3"]]  # the next epoch's rows are intact


def test_sys_exit_in_a_reward_function_or_file_is_one_line(tmp_path):
    def quitter(prompts, completions, **kwargs):
        raise SystemExit(0)

    with pytest.raises(RewardFunctionError, match=r"'quitter' \(f\.py\) called sys\.exit\(0\) on row 0") as e:
        call_reward_function("quitter", quitter, ["p", "p"], ["a", "b"], {}, source="f.py")
    assert "\n" not in str(e.value)
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"importing it called sys\.exit\(no GPU here\)"):
        load_reward_functions(str(path), ["f"])


def test_a_hung_function_stops_at_the_timeout_with_one_line():
    def hang(prompts, completions, **kwargs):
        time.sleep(30)
        return [0.0] * len(completions)

    start = time.perf_counter()
    with pytest.raises(
        RewardFunctionError, match=r"'hang' .*did not return within reward_timeout_seconds=0\.2"
    ):
        call_reward_function("hang", hang, ["p"], ["a"], {}, timeout_s=0.2)
    assert time.perf_counter() - start < 5
    # With a limit, a quick function and its errors behave as without one.
    assert call_reward_function(
        "ok", lambda prompts, completions, **kw: [1.0], ["p"], ["a"], {}, timeout_s=5
    ) == [1.0]
    with pytest.raises(RewardFunctionError, match="raised ZeroDivisionError"):
        call_reward_function("bad", lambda prompts, completions, **kw: [1 / 0], ["p"], ["a"], {}, timeout_s=5)


def test_the_timeout_key_reaches_the_functions_and_is_checked(tmp_path):
    from grpax.config import build_config
    from grpax.rl.train_config import TrainConfig
    from grpax.tasks import build_task, validate_task_keys

    path = tmp_path / "r.py"
    path.write_text(
        textwrap.dedent("def f(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    )
    keys = [
        f"reward_functions_path={path}",
        "reward_functions=[f]",
        "model_name=",
        "reward_timeout_seconds=7.5",
    ]
    cfg = build_config(TrainConfig, keys)
    validate_task_keys(cfg)
    assert build_task(cfg).user_rewards.timeout_s == 7.5
    with pytest.raises(
        ConfigError, match=r"reward_timeout_seconds=-1\.0: expected a finite number of seconds"
    ):
        validate_task_keys(build_config(TrainConfig, [*keys[:-1], "reward_timeout_seconds=-1"]))


def test_a_reward_beyond_float_range_is_named_not_an_overflow_traceback():
    with pytest.raises(
        RewardFunctionError, match=r"'big' \(\) returned 1000000.* for row 0: expected a finite"
    ):
        call_reward_function("big", lambda prompts, completions, **kw: [10**400], ["p"], ["a"], {})
