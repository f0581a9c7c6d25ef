"""The built-in calculator tool: exact arithmetic, and a one-line error observation for anything else."""

import pytest

from grpax.tasks import calculator
from grpax.tasks.calculator import calculate


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3*4", "12"),
        ("(48 / 2) * 3 + 1,000", "1072"),
        ("1,234,567.5 - 0.5", "1234567"),
        ("0.1 + 0.2", "0.3"),  # exact, not 0.30000000000000004
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("-2 ** 2", "-4"),  # Python's precedence
        ("2 ** -1", "0.5"),
        ("2 ** 3 ** 2", "512"),
        ("2 ^ 10", "1024"),
        ("--3", "3"),
        ("+.5 * 4", "2"),
        ("  12  ", "12"),
        ("3.0", "3"),
        ("2.5 ** 2", "6.25"),
    ],
)
def test_arithmetic(text, expected):
    assert calculate(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        # not arithmetic: names, calls, attributes, strings, dunders, literals of other kinds
        ("__import__('os').system('ls')", "unexpected '_' at 1"),
        ("open('/etc/passwd')", "unexpected 'o' at 1"),
        ("(1).real", "unexpected '.' at 4"),
        ("x + 1", "unexpected 'x' at 1"),
        ("'1' * 3", 'unexpected "\'" at 1'),
        ("1e5", "unexpected 'e' at 2"),
        ("1_000", "unexpected '_' at 2"),
        ("[1]", "unexpected '[' at 1"),
        ("1 if 1 else 2", "unexpected 'i' at 3"),
        ("lambda: 1", "unexpected 'l' at 1"),
        # malformed
        ("", "the expression is empty"),
        ("1,23", "unexpected ',' at 2"),
        ("(1 + 2", "'(' at 1 is not closed"),
        ("1 + 2)", "unexpected ')' at 6"),
        ("1 +", "the expression ends too early"),
        # bounds
        ("10 ** 100", "exponent 100 is larger than 64"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 64"),
        ("9 ** 64", "a result has more than 40 digits"),
        ("99999999999999999999 * 99999999999999999999 * 10", "a result has more than 40 digits"),
        ("4 ** 0.5", "only whole-number exponents are allowed"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1+" * 150 + "1", "the expression is longer than 200 characters"),
        ("(" * 40 + "1" + ")" * 40, "nested deeper than 32"),
        ("-" * 40 + "1", "nested deeper than 32"),
    ],
)
def test_refusals_are_one_line_observations(text, message):
    out = calculate(text)
    assert out.startswith("error: ") and "\n" not in out
    assert message in out, out


def test_time_bound(monkeypatch):
    """A call past its wall-time budget stops with an error observation (a negative budget: at once)."""
    monkeypatch.setattr(calculator, "MAX_SECONDS", -1.0)
    assert calculate("1 + 2") == "error: took longer than -1.0 s"


def test_never_raises_on_odd_input():
    for text in ("\x00", "1\n+2", None, 12):
        out = calculate(text)
        assert isinstance(out, str) and "\n" not in out


def test_only_ascii_digits():
    assert calculate("\u0661 + 1").startswith("error: 'calculator' takes only numbers")
