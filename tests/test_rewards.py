"""GSM8K answer extraction, number parsing and reward values, on real and adversarial strings."""

import logging
import math

import pytest

from grpax.tasks import gsm8k_rewards as R
from grpax.tasks.answers import extract_answer, extract_last_number, is_close, is_correct, normalize_number
from grpax.tasks.gsm8k_rewards import (
    RewardConfig,
    answer_close,
    answer_correct,
    format_approximate,
    format_exact,
    get_reward_config,
    number_match,
    score_completions,
)

TUNIX = get_reward_config("tunix")
LENIENT = get_reward_config("tunix", require_format=False)

# A real GSM8K train question (Natalia, gold 72) answered in the requested layout.
GOOD = (
    "<reasoning>\nNatalia sold 48/2 = 24 clips in May.\n"
    "Natalia sold 48+24 = 72 clips altogether in April and May.\n</reasoning>\n<answer>\n72\n</answer>\n"
)


def one(fn, completion, gold="72", **kwargs):
    return fn(["prompt"], [completion], [gold], **kwargs)[0]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72", 72.0),
        ("1,000", 1000.0),
        ("$18", 18.0),
        ("-3", -3.0),
        ("\u22123", -3.0),
        ("+5", 5.0),
        ("72,", 72.0),
        ("72.", 72.0),
        ("18.00", 18.0),
        ("3.0", 3.0),
        ("50%", 50.0),
        ("1/2", 0.5),
        ("3 1/2", 3.5),
        ("-3 1/2", -3.5),
        ("$1,234.50", 1234.5),
        ("18 dollars", 18.0),
        ("18 eggs", 18.0),
        ("= 42", 42.0),
        ("5 + 3 = 8", 8.0),
        ("-$5", -5.0),
        (".5", 0.5),
        ("1,000,000", 1_000_000.0),
        ("The answer is 7 apples", 7.0),
        ("no number", None),
        ("", None),
        (None, None),
        ("1/0", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        (GOOD, "\n72\n"),
        ("<answer>5</answer> then <answer> 7 </answer>", " 7 "),  # the last block wins
        ("<answer>5</answer> <answer>18 eggs", "18 eggs"),  # unclosed last tag
        ("<answer></answer>", ""),
        ("The answer is 72.", None),
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10.", "$10"),
        ("Total: 1,200, then 5 more.", "5"),
        ("so the answer is -4.5 degrees", "-4.5"),
        ("from 10-5 we get", "5"),
        ("Betty needs 100 - 95 = 5 more dollars.", "5"),
        ("nothing here", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_is_correct_and_close():
    assert is_correct("\n72\n", "72")
    assert is_correct("$1,000.00", "1000")
    assert is_correct("72 clips", "72")
    assert not is_correct("720", "72")
    assert not is_correct(None, "72")
    assert is_close("95", "100") and is_close("110", "100") and not is_close("111", "100")
    assert is_close("0", "0") and not is_close("1", "0")


@pytest.mark.parametrize(
    "completion, prefix, expected",
    [
        (GOOD, "", 3.0),
        ("   \n" + GOOD, "", 3.0),  # leading whitespace allowed
        (GOOD[len("<reasoning>\n") :], "<reasoning>\n", 3.0),  # pre-filled tag counts as emitted
        (GOOD[len("<reasoning>\n") :], "", 0.0),
        (GOOD + "Hope this helps!", "", 0.0),  # text after the answer
        ("<reasoning></reasoning><answer>72</answer>", "", 0.0),  # empty reasoning
        ("<answer>72</answer><reasoning>x</reasoning>", "", 0.0),  # wrong order
        ("", "", 0.0),
    ],
)
def test_format_exact(completion, prefix, expected):
    assert one(format_exact, completion, response_prefix=prefix, reward_config=TUNIX) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        (GOOD, 2.0),  # 4 tags once each: 4 * 0.5
        ("", -2.0),  # all missing: 4 * -0.5
        ("<reasoning>x</reasoning>", 0.0),  # two present, two missing
        (GOOD + "<answer>73</answer>", 0.0),  # answer tags repeated: 2 * 0.5 + 2 * -0.5
        ("<reasoning><reasoning>x</reasoning><answer>1</answer>", 1.0),
    ],
)
def test_format_approximate_tunix(completion, expected):
    assert one(format_approximate, completion, reward_config=TUNIX) == expected


def test_format_approximate_smollm2_partial_credit():
    cfg = get_reward_config("smollm2_demo")
    assert one(format_approximate, "<answer>72</answer>", reward_config=cfg) == 0.5
    assert one(format_approximate, "72</answer>", reward_config=cfg, response_prefix="<reasoning>\n") == 0.5


@pytest.mark.parametrize(
    "completion, gold, cfg, expected",
    [
        (GOOD, "72", TUNIX, 3.0),
        (GOOD.replace("\n72\n", "72"), "72", TUNIX, 3.0),
        (GOOD.replace("\n72\n", "$72.00"), "72", TUNIX, 3.0),  # currency and decimals
        (GOOD.replace("\n72\n", "1,000"), "1000", TUNIX, 3.0),  # thousands separator
        (GOOD.replace("\n72\n", "-3"), "-3", TUNIX, 3.0),  # negative
        (GOOD.replace("\n72\n", "0.5"), ".5", TUNIX, 3.0),
        (GOOD.replace("\n72\n", "72 clips"), "72", TUNIX, 3.0),  # text after the answer
        (GOOD.replace("\n72\n", " seventy-two "), "seventy-two", TUNIX, 1.5),  # whitespace-only difference
        (GOOD.replace("\n72\n", "73"), "72", TUNIX, 0.0),
        (GOOD + " extra", "72", TUNIX, 0.0),  # layout broken -> not scored under require_format
        (GOOD + " extra", "72", LENIENT, 3.0),
        ("The answer is 72", "72", LENIENT, 0.0),  # no tag
        ("", "72", LENIENT, 0.0),
    ],
)
def test_answer_correct(completion, gold, cfg, expected):
    assert one(answer_correct, completion, gold, reward_config=cfg) == expected


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("72", "72", 0.0),  # exact: paid by answer_correct
        ("95", "100", 0.5),  # ratio 0.95
        ("110", "100", 0.5),
        ("85", "100", 0.25),  # ratio 0.85
        ("120", "100", 0.25),
        ("121", "100", -1.0),
        ("-100", "100", -1.0),
        ("I don't know", "100", -0.5),  # answer given, no number
    ],
)
def test_answer_close(answer, gold, expected):
    completion = f"<reasoning>x</reasoning><answer>{answer}</answer>"
    assert one(answer_close, completion, gold, reward_config=TUNIX) == expected


def test_answer_close_abstains_on_non_numeric_gold():
    assert math.isnan(one(answer_close, GOOD, "seventy-two", reward_config=TUNIX))
    assert one(answer_close, "no tags at all", "72", reward_config=TUNIX) == 0.0


@pytest.mark.parametrize(
    "completion, cfg, expected",
    [
        (GOOD, TUNIX, 1.5),
        (GOOD.replace("\n72\n", "She sold 72 clips in all."), TUNIX, 1.5),
        (GOOD.replace("\n72\n", "24 then 72"), TUNIX, 1.5),  # several numbers: the last counts
        (GOOD.replace("\n72\n", "72 then 24"), TUNIX, 0.0),
        ("48 + 24 = 72 clips.", TUNIX, 0.0),  # no layout: not scored under require_format
        ("48 + 24 = 72 clips.", LENIENT, 1.5),  # falls back to the last number anywhere
        ("", LENIENT, 0.0),
    ],
)
def test_number_match(completion, cfg, expected):
    assert one(number_match, completion, reward_config=cfg) == expected


def test_score_completions_tunix_totals():
    completions = [GOOD, GOOD.replace("\n72\n", "70"), "I think it is 72.", ""]
    out = score_completions(["p"] * 4, completions, ["72"] * 4, "tunix")
    assert out["format_exact"] == [3.0, 3.0, 0.0, 0.0]
    assert out["format_approximate"] == [2.0, 2.0, -2.0, -2.0]
    assert out["answer_correct"] == [3.0, 0.0, 0.0, 0.0]
    assert out["answer_close"] == [0.0, 0.5, 0.0, 0.0]  # 70/72 = 0.972
    assert out["number_match"] == [1.5, 0.0, 0.0, 0.0]
    assert out["total"] == [9.5, 5.5, -2.0, -2.0]


def test_score_completions_presets():
    simple = score_completions(["p"], [GOOD], ["72"], "simple")
    assert set(simple) == {"answer_correct", "format_exact", "total"}
    assert simple["total"] == pytest.approx([1.1])
    demo = score_completions(
        ["p"], [GOOD[len("<reasoning>\n") :]], ["72"], "smollm2_demo", response_prefix="<reasoning>\n"
    )
    # format exact 1.0 + 4 tags * 0.25 + correct 2.0 + close 0.0 + number 0.5
    assert demo["total"] == [4.5]
    assert get_reward_config("maxtext") == RewardConfig()


def test_score_completions_abstains_on_exception(caplog):
    def broken(prompts, completions, answers, **kwargs):
        raise RuntimeError("boom")

    cfg = RewardConfig(weights={"broken": 1.0, "format_exact": 1.0})
    R._warned.discard("broken")
    with caplog.at_level(logging.WARNING):
        out = score_completions(["p", "p"], [GOOD, ""], ["72", "72"], cfg, reward_fns={"broken": broken})
        score_completions(["p"], [GOOD], ["72"], cfg, reward_fns={"broken": broken})
    assert all(math.isnan(v) for v in out["broken"])
    assert out["total"] == [3.0, 0.0]  # NaN adds nothing
    assert sum("broken" in m for m in caplog.messages) == 1  # warned once

    only_broken = RewardConfig(weights={"broken": 1.0})
    assert math.isnan(
        score_completions(["p"], [GOOD], ["72"], only_broken, reward_fns={"broken": broken})["total"][0]
    )


def test_score_completions_wrong_length_names_function():
    def short(prompts, completions, answers, **kwargs):
        return [1.0]

    cfg = RewardConfig(weights={"short_fn": 1.0})
    with pytest.raises(ValueError, match="short_fn"):
        score_completions(["p", "p"], ["a", "b"], ["1", "1"], cfg, reward_fns={"short_fn": short})
    with pytest.raises(ValueError, match="no function"):
        score_completions(["p"], ["a"], ["1"], RewardConfig(weights={"nope": 1.0}))
    with pytest.raises(ValueError, match="unknown reward preset"):
        get_reward_config("nope")


def test_math_verify_missing_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    cfg = get_reward_config("tunix", use_math_verify=True)
    with pytest.raises(ImportError, match="pip install"):
        score_completions(["p"], [GOOD.replace("\n72\n", "\\frac{144}{2}")], ["72"], cfg)


def test_math_verify_flag_uses_library(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text, parsing_timeout: (
        calls.append(parsing_timeout),
        text.replace("\\frac{144}{2}", "72"),
    )[1]
    fake.verify = lambda gold, pred, timeout_seconds: gold == pred
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    completion = GOOD.replace("\n72\n", "\\frac{144}{2}")
    off = get_reward_config("tunix")
    on = get_reward_config("tunix", use_math_verify=True, math_verify_timeout_s=2.5)
    assert one(answer_correct, completion, reward_config=off) == 0.0
    assert one(answer_correct, completion, reward_config=on) == 3.0
    assert calls == [3, 3]  # timeout rounded up to whole seconds
    assert is_correct("\\frac{144}{2}", "72", use_math_verify=True)
