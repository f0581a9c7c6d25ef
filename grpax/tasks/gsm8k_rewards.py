"""GSM8K's reward functions and their point-value presets (pure Python, no JAX).

The model is asked to reason between ``<reasoning>`` tags and to put the final number between ``<answer>``
tags. The rewards follow the GRPO GSM8K recipe of MaxText (``configs/rl.yml``, ``rl/utils_rl.py``) and the
Tunix GRPO demo, which share one set of point values: an exact-format bonus, a per-tag partial-format
score, a tiered answer score (exact, whitespace-only difference, within 10% / 20% of the gold value, wrong)
and a number-match score. Each reward is a separate function with the signature

    fn(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]

where ``answers`` are gold numbers as strings and ``completions`` are the generated text after the prompt.
If the prompt pre-filled a ``response_prefix`` (e.g. ``"<reasoning>\\n"``) it is passed as a keyword and
prepended before checking, so pre-filled tags count as emitted. Point values come from a ``RewardConfig``
(kwarg ``reward_config``); ``score_completions`` runs the functions a config names and sums them with its
weights. A value of NaN means the function abstained (could not score that completion): it adds nothing to
the total. Answers are read and compared with the task-neutral helpers of ``grpax.tasks.answers``. See
docs/rewards.md.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from grpax.tasks.answers import (
    ANSWER_END,
    ANSWER_START,
    extract_answer,
    extract_last_number,
    is_close,
    math_verify_equal,
    normalize_number,
    numbers_equal,
)

logger = logging.getLogger(__name__)

RewardFn = Callable[..., list[float]]

# The layout the GSM8K prompts ask for: working between the reasoning tags, then the final number between the
# answer tags (grpax.tasks.answers).
REASONING_START = "<reasoning>"
REASONING_END = "</reasoning>"
TAGS = (REASONING_START, REASONING_END, ANSWER_START, ANSWER_END)

# Whole-completion layout: optional leading whitespace, one reasoning block, then the answer block, then only
# whitespace. The reasoning must be non-empty; the answer block is captured.
_FORMAT_RE = re.compile(
    rf"^\s*{re.escape(REASONING_START)}.+?{re.escape(REASONING_END)}\s*"
    rf"{re.escape(ANSWER_START)}(.*?){re.escape(ANSWER_END)}\s*$",
    flags=re.DOTALL,
)


@dataclass(frozen=True)
class RewardConfig:
    """Point values and weights of the GSM8K rewards.

    Attributes:
        format_exact: points when the whole completion has the layout
            ``<reasoning>...</reasoning> <answer>...</answer>`` (MaxText ``reward_exact_format_match``).
        format_tag_present: points per tag that appears exactly once (``reward_partial_format_match``).
        format_tag_penalty: points per tag that is missing or repeated (``penalty_incorrect_format``).
        answer_exact: points when the extracted answer equals the gold one, as a string or numerically
            (``reward_exact_format_match`` in MaxText's answer check).
        answer_whitespace: points when the answers differ only by surrounding whitespace and are not numbers
            (``reward_white_space_format_match``).
        answer_ratio_high: points when extracted / gold is within [0.9, 1.1] but not equal
            (``reward_ratio_guess_to_answer_high``).
        answer_ratio_low: points when the ratio is within [0.8, 1.2] (``reward_ratio_guess_to_answer_low``).
        answer_wrong: points for a numeric answer outside those ranges (``penalty_incorrect_answer``).
        answer_unparseable: points when an answer was given but holds no number
            (MaxText / Tunix give ``penalty_incorrect_format`` here).
        number_match: points when the number found equals the gold value (MaxText / Tunix ``check_numbers``).
        require_format: if True, ``answer_correct``, ``answer_close`` and ``number_match`` only score
            completions whose whole layout matches (as MaxText / Tunix do) and give 0 otherwise; if False the
            answer is taken from the last ``<answer>`` tag wherever it is.
        weights: reward-function name -> weight in the total; only the names listed are run.
        use_math_verify: also accept answers that the ``math-verify`` library judges equivalent.
        math_verify_timeout_s: seconds allowed per ``math-verify`` parse / compare.
    """

    format_exact: float = 3.0
    format_tag_present: float = 0.5
    format_tag_penalty: float = -0.5
    answer_exact: float = 3.0
    answer_whitespace: float = 1.5
    answer_ratio_high: float = 0.5
    answer_ratio_low: float = 0.25
    answer_wrong: float = -1.0
    answer_unparseable: float = -0.5
    number_match: float = 1.5
    require_format: bool = True
    weights: Mapping[str, float] = field(
        default_factory=lambda: {
            "format_exact": 1.0,
            "format_approximate": 1.0,
            "answer_correct": 1.0,
            "answer_close": 1.0,
            "number_match": 1.0,
        }
    )
    use_math_verify: bool = False
    math_verify_timeout_s: float = 5.0


# MaxText configs/rl.yml and the Tunix GRPO demo use the same values: "tunix" is another name of "maxtext".
_SIMPLE = RewardConfig(
    format_exact=0.1,
    answer_exact=1.0,
    answer_whitespace=1.0,
    require_format=False,
    weights={"answer_correct": 1.0, "format_exact": 1.0},
)
_SMOLLM2_DEMO = RewardConfig(
    format_exact=1.0,
    format_tag_present=0.25,
    format_tag_penalty=0.0,
    answer_exact=2.0,
    answer_whitespace=2.0,
    answer_ratio_high=0.5,
    answer_ratio_low=0.25,
    answer_wrong=0.0,
    answer_unparseable=0.0,
    number_match=0.5,
    require_format=False,
)
# No reward: every completion scores 0, so GRPO's advantages are 0 and only a teacher teaches (on-policy
# distillation, ``distillation_coef`` > 0); the evaluation still judges format and answers.
_NONE = RewardConfig(
    format_exact=0.0, format_tag_present=0.0, format_tag_penalty=0.0, answer_exact=0.0, answer_whitespace=0.0,
    answer_ratio_high=0.0, answer_ratio_low=0.0, answer_wrong=0.0, answer_unparseable=0.0, number_match=0.0,
)  # fmt: skip
REWARD_PRESETS: dict[str, RewardConfig] = {
    "maxtext": RewardConfig(),
    "tunix": RewardConfig(),  # Tunix's GSM8K rewards are MaxText's
    "simple": _SIMPLE,
    "smollm2_demo": _SMOLLM2_DEMO,
    "none": _NONE,
}


def get_reward_config(name: str, **overrides) -> RewardConfig:
    """Returns a reward preset, optionally with some fields replaced.

    Args:
        name: ``"maxtext"``, ``"tunix"``, ``"simple"`` or ``"smollm2_demo"``.
        **overrides: RewardConfig fields to replace.

    Returns:
        The RewardConfig.

    Raises:
        ValueError: if the name or an override field is unknown.

    Example:
        >>> get_reward_config("tunix", answer_wrong=0.0).answer_wrong
        0.0
    """
    if name not in REWARD_PRESETS:
        known = sorted(REWARD_PRESETS)
        raise ValueError(f"unknown reward preset {name!r}; known presets: {known}")
    unknown = set(overrides) - set(RewardConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown RewardConfig fields {sorted(unknown)}")
    return replace(REWARD_PRESETS[name], **overrides)


# ----------------------------------------------------------------------------------------------------------
# The layout check.


def is_format_exact(completion: str) -> bool:
    """Whether the whole completion has the ``<reasoning>...</reasoning><answer>...</answer>`` layout.

    Args:
        completion: generated text with any response prefix prepended.

    Returns:
        True if it matches (whitespace allowed before, between the blocks and after).

    Example:
        >>> is_format_exact("<reasoning>2+2</reasoning>\\n<answer>4</answer>\\n"), is_format_exact("4")
        (True, False)
    """
    return _FORMAT_RE.match(completion) is not None


# ----------------------------------------------------------------------------------------------------------
# Reward functions.


def _prep(completions: Sequence[str], kwargs: dict) -> tuple[list[str], RewardConfig]:
    prefix = kwargs.get("response_prefix") or ""
    config = kwargs.get("reward_config") or RewardConfig()
    return [prefix + c for c in completions], config


def _answer_for_scoring(completion: str, config: RewardConfig) -> str | None:
    if config.require_format:
        m = _FORMAT_RE.match(completion)
        return None if m is None else m.group(1)
    return extract_answer(completion)


def format_exact(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Rewards completions whose whole layout is ``<reasoning>...</reasoning> <answer>...</answer>``.

    Args:
        prompts: prompt texts [B] (unused).
        completions: generated texts [B].
        answers: gold answers [B] (unused).
        **kwargs: ``response_prefix`` (str) and ``reward_config`` (RewardConfig).

    Returns:
        Points [B]: ``format_exact`` if the layout matches, else 0.

    Example:
        >>> format_exact([""], ["think</reasoning><answer>4</answer>"], ["4"], response_prefix="<reasoning>")
        [3.0]
    """
    texts, config = _prep(completions, kwargs)
    return [config.format_exact if is_format_exact(t) else 0.0 for t in texts]


def format_approximate(
    prompts: list[str], completions: list[str], answers: list[str], **kwargs
) -> list[float]:
    """Scores each of the four tags: present exactly once earns points, missing or repeated costs points.

    Args:
        prompts: prompt texts [B] (unused).
        completions: generated texts [B].
        answers: gold answers [B] (unused).
        **kwargs: ``response_prefix`` (str) and ``reward_config`` (RewardConfig).

    Returns:
        Points [B]: the sum over the 4 tags of ``format_tag_present`` or ``format_tag_penalty``.

    Example:
        >>> format_approximate([""], ["<reasoning>x</reasoning><answer>1</answer><answer>"], ["1"])
        [1.0]
    """
    texts, config = _prep(completions, kwargs)
    return [
        sum(config.format_tag_present if t.count(tag) == 1 else config.format_tag_penalty for tag in TAGS)
        for t in texts
    ]


def answer_correct(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Rewards a correct final answer.

    The answer is the last ``<answer>`` block (with ``require_format``, only from a completion whose layout
    matches). Exact or numerically equal answers earn ``answer_exact``; non-numeric answers equal after
    stripping whitespace earn ``answer_whitespace``; anything else earns 0 here (``answer_close`` scores it).

    Args:
        prompts: prompt texts [B] (unused).
        completions: generated texts [B].
        answers: gold answers [B], e.g. ``"72"``.
        **kwargs: ``response_prefix`` (str) and ``reward_config`` (RewardConfig).

    Returns:
        Points [B].

    Raises:
        ImportError: if the config asks for ``math-verify`` and it is not installed.

    Example:
        >>> answer_correct([""], ["<reasoning>48/2=24</reasoning><answer>$72.00</answer>"], ["72"])
        [3.0]
    """
    texts, config = _prep(completions, kwargs)
    scores = []
    for text, gold in zip(texts, answers, strict=True):
        pred = _answer_for_scoring(text, config)
        if pred is None:
            scores.append(0.0)
        elif pred == gold or numbers_equal(normalize_number(pred), normalize_number(gold)):
            scores.append(config.answer_exact)
        elif pred.strip() == gold.strip():
            scores.append(config.answer_whitespace)
        elif config.use_math_verify and math_verify_equal(pred, gold, config.math_verify_timeout_s):
            scores.append(config.answer_exact)
        else:
            scores.append(0.0)
    return scores


def answer_close(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Partial credit for a wrong answer near the gold value, a penalty for one far from it.

    Correct answers score 0 here (``answer_correct`` pays them). Otherwise, with r = extracted / gold:
    ``answer_ratio_high`` if 0.9 <= r <= 1.1, ``answer_ratio_low`` if 0.8 <= r <= 1.2, else ``answer_wrong``;
    ``answer_unparseable`` if the answer holds no number; 0 if there is no answer. NaN (abstain) if the gold
    answer is not a number.

    Args:
        prompts: prompt texts [B] (unused).
        completions: generated texts [B].
        answers: gold answers [B].
        **kwargs: ``response_prefix`` (str) and ``reward_config`` (RewardConfig).

    Returns:
        Points [B].

    Example:
        >>> answer_close([""], ["<reasoning>x</reasoning><answer>95</answer>"], ["100"])
        [0.5]
    """
    texts, config = _prep(completions, kwargs)
    scores = []
    for text, gold in zip(texts, answers, strict=True):
        pred_text = _answer_for_scoring(text, config)
        true = normalize_number(gold)
        if true is None:
            scores.append(math.nan)
            continue
        if pred_text is None:
            scores.append(0.0)
            continue
        pred = normalize_number(pred_text)
        if pred is None:
            scores.append(config.answer_unparseable)
        elif pred_text.strip() == gold.strip() or numbers_equal(pred, true):
            scores.append(0.0)
        elif is_close(pred_text, gold, 0.1):
            scores.append(config.answer_ratio_high)
        elif is_close(pred_text, gold, 0.2):
            scores.append(config.answer_ratio_low)
        else:
            scores.append(config.answer_wrong)
    return scores


def number_match(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """Rewards the right number even when the answer block holds more than a number.

    The number is the last one in the answer block; without an ``<answer>`` tag (and without
    ``require_format``) it is the last number anywhere in the completion.

    Args:
        prompts: prompt texts [B] (unused).
        completions: generated texts [B].
        answers: gold answers [B].
        **kwargs: ``response_prefix`` (str) and ``reward_config`` (RewardConfig).

    Returns:
        Points [B]: ``number_match`` if the number equals the gold value, else 0.

    Example:
        >>> number_match([""], ["... so she earns 10 dollars."], ["10"], reward_config=get_reward_config("simple"))
        [1.5]
    """
    texts, config = _prep(completions, kwargs)
    scores = []
    for text, gold in zip(texts, answers, strict=True):
        block = _answer_for_scoring(text, config)
        if block is None and not config.require_format:
            block = text
        number = None if block is None else extract_last_number(block)
        ok = number is not None and numbers_equal(normalize_number(number), normalize_number(gold))
        scores.append(config.number_match if ok else 0.0)
    return scores


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "format_exact": format_exact,
    "format_approximate": format_approximate,
    "answer_correct": answer_correct,
    "answer_close": answer_close,
    "number_match": number_match,
}

_warned: set[str] = set()


def score_completions(
    prompts: list[str],
    completions: list[str],
    answers: list[str],
    reward_config: RewardConfig | str = "maxtext",
    reward_fns: Mapping[str, RewardFn] | None = None,
    **kwargs,
) -> dict[str, list[float]]:
    """Runs the reward functions a config names and adds their weighted sum.

    A function that raises abstains: its values are NaN for the whole batch and a warning is logged once per
    function name. NaN values add nothing to ``total``; a completion for which every function abstained gets
    a NaN total.

    Args:
        prompts: prompt texts [B].
        completions: generated texts [B], without the response prefix.
        answers: gold answers [B] as strings.
        reward_config: a RewardConfig or preset name; its ``weights`` pick the functions.
        reward_fns: extra or replacement functions by name (looked up before the built-in ones).
        **kwargs: passed to every function (e.g. ``response_prefix``).

    Returns:
        Name -> points [B] for each weighted function, plus ``"total"`` [B].

    Raises:
        ValueError: if the input lengths differ, a weighted name has no function, or a function returns the
            wrong number of values (the message names it).

    Example:
        >>> out = score_completions([""], ["<reasoning>x</reasoning><answer>4</answer>"], ["4"], "tunix")
        >>> out["total"]
        [9.5]
    """
    if isinstance(reward_config, str):
        reward_config = get_reward_config(reward_config)
    if not (len(prompts) == len(completions) == len(answers)):
        raise ValueError(
            f"prompts, completions and answers must have the same length, got "
            f"{len(prompts)}, {len(completions)}, {len(answers)}"
        )
    fns = {**REWARD_FUNCTIONS, **(reward_fns or {})}
    out: dict[str, list[float]] = {}
    for name in reward_config.weights:
        if name not in fns:
            raise ValueError(f"reward {name!r} in RewardConfig.weights has no function; known: {sorted(fns)}")
        try:
            raw = fns[name](prompts, completions, answers, reward_config=reward_config, **kwargs)
            values = [float(v) for v in raw]
        except ImportError:
            raise
        except Exception as e:  # a broken reward abstains rather than killing a long run
            if name not in _warned:
                _warned.add(name)
                logger.warning("reward %r raised %s: %s; scoring NaN (abstain)", name, type(e).__name__, e)
            values = [math.nan] * len(completions)
        if len(values) != len(completions):
            raise ValueError(
                f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
            )
        out[name] = values
    totals = []
    for i in range(len(completions)):
        terms = [reward_config.weights[n] * out[n][i] for n in out if not math.isnan(out[n][i])]
        totals.append(sum(terms) if terms else math.nan)
    out["total"] = totals
    return out
