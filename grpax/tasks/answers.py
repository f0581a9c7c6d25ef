"""Answer helpers every task may use (pure Python, no JAX): the ``<answer>`` block, numbers in text, equality.

A completion states its final answer between ``<answer>`` tags (the built-in prompts ask for them; ``task=custom``
and ``task=math`` read the same block); numbers are read as people write them (``"$1,000"``, ``"3 1/2"``,
``"50%"``, the unicode minus) and compared by value, as MaxText's GSM8K answer check does
(``rl/utils_rl.py``). ``math-verify`` (Hugging Face) judges LaTeX answers when asked. A task's reward functions
(``grpax.tasks.gsm8k_rewards``) and its correctness checks build on these.
"""

from __future__ import annotations

import logging
import math
import re

logger = logging.getLogger(__name__)

ANSWER_START = "<answer>"
ANSWER_END = "</answer>"

_MINUS = "\u2212"  # unicode minus sign, seen in model output
# One number: optional sign, optional $, digits with optional thousands groups, optional decimals; or a bare
# ".5". The lookbehind keeps the "-" of "10-5" from turning 5 into -5.
_NUMBER = r"(?<![\w.])[-+\u2212]?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])[-+\u2212]?\$?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_FRACTION_RE = re.compile(rf"(?:({_NUMBER})\s+)?({_NUMBER})\s*/\s*(\d+)")


def extract_answer(completion: str) -> str | None:
    """Returns the text of the last ``<answer>`` block.

    Args:
        completion: generated text (with any response prefix already prepended).

    Returns:
        The text between the last ``<answer>`` and the ``</answer>`` after it, unstripped; the text after the
        last ``<answer>`` if it is not closed; None if there is no ``<answer>`` tag.

    Example:
        >>> extract_answer("<answer>1</answer> <answer> 72 </answer>")
        ' 72 '
    """
    start = completion.rfind(ANSWER_START)
    if start < 0:
        return None
    rest = completion[start + len(ANSWER_START) :]
    end = rest.find(ANSWER_END)
    return rest if end < 0 else rest[:end]


def extract_last_number(text: str) -> str | None:
    """Returns the last number written anywhere in the text.

    Args:
        text: any text.

    Returns:
        The number as written (sign, ``$`` and thousands separators kept, trailing ``.`` or ``,`` dropped), or
        None if there is none.

    Example:
        >>> extract_last_number("She pays $1,200, then 18 more. Total: -3.5.")
        '-3.5'
    """
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def _to_float(token: str) -> float:
    token = token.replace(_MINUS, "-").replace("$", "").replace(",", "")
    return float(token)


def normalize_number(text: str | None) -> float | None:
    """Parses the first number in a short answer string.

    Handles signs (including the unicode minus), ``$``, thousands separators, decimals, trailing punctuation
    or words (``"18 eggs"``, ``"72."``), percentages (``"50%"`` -> 50, as GSM8K writes them), fractions
    (``"1/2"``), mixed numbers (``"3 1/2"``) and a leading ``=`` (only the text after the last ``=`` counts).

    Args:
        text: the answer text; None is allowed.

    Returns:
        The value, or None if no number is found (or a fraction divides by zero).

    Example:
        >>> normalize_number("$1,234.50"), normalize_number("3 1/2"), normalize_number("no idea")
        (1234.5, 3.5, None)
    """
    if text is None:
        return None
    text = text.split("=")[-1]
    frac = _FRACTION_RE.search(text)
    first = _NUMBER_RE.search(text)
    if frac is not None and first is not None and frac.start() == first.start():
        whole, num, den = frac.groups()
        if float(den) == 0:
            return None
        value = _to_float(num) / float(den)
        if whole is not None:
            w = _to_float(whole)
            value = w - value if w < 0 else w + value
        return value
    if first is None:
        return None
    return _to_float(first.group(0))


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def math_verify_equal(pred: str, gold: str, timeout_s: float) -> bool:
    try:
        import math_verify  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise ImportError(
            "use_math_verify=True needs the math-verify library: pip install 'math-verify>=0.5' "
            "(or pip install 'grpax[math]')"
        ) from e
    t = max(1, int(math.ceil(timeout_s)))
    try:
        gold_parsed = math_verify.parse(gold, parsing_timeout=t)
        pred_parsed = math_verify.parse(pred, parsing_timeout=t)
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=t))
    except Exception as e:  # a timeout or parse failure means "not shown equal", not a crash
        logger.debug("math-verify could not compare %r with %r: %s", pred, gold, e)
        return False


def is_correct(
    extracted: str | None, gold: str, use_math_verify: bool = False, timeout_s: float = 5.0
) -> bool:
    """Whether an extracted answer equals the gold answer.

    Equal means: the same string after stripping whitespace, or the same number after ``normalize_number``
    (relative and absolute tolerance 1e-6), or, if ``use_math_verify``, equivalent for ``math-verify``.

    Args:
        extracted: the model's answer text, or None if it gave none.
        gold: the gold answer, e.g. ``"72"``.
        use_math_verify: also try ``math-verify``.
        timeout_s: seconds allowed per ``math-verify`` call.

    Returns:
        True if correct.

    Raises:
        ImportError: if ``use_math_verify`` and ``math-verify`` is not installed.

    Example:
        >>> is_correct(" $1,000.00 ", "1000"), is_correct("999", "1000")
        (True, False)
    """
    if extracted is None:
        return False
    if extracted.strip() == gold.strip():
        return True
    if numbers_equal(normalize_number(extracted), normalize_number(gold)):
        return True
    return use_math_verify and math_verify_equal(extracted, gold, timeout_s)


def is_close(extracted: str | None, gold: str, tolerance: float = 0.1) -> bool:
    """Whether the extracted number is within ``tolerance`` of the gold one, as a ratio.

    This is MaxText's "partial accuracy": ``1 - tolerance <= extracted / gold <= 1 + tolerance``. A zero gold
    value only accepts zero.

    Args:
        extracted: the model's answer text, or None.
        gold: the gold answer.
        tolerance: allowed relative distance (0.1 = 10%).

    Returns:
        True if close (exact answers are close).

    Example:
        >>> is_close("95", "100"), is_close("85", "100")
        (True, False)
    """
    pred, true = normalize_number(extracted), normalize_number(gold)
    if pred is None or true is None:
        return False
    if true == 0:
        return pred == 0
    return 1 - tolerance - 1e-9 <= pred / true <= 1 + tolerance + 1e-9
