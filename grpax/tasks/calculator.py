"""The built-in ``calculator`` tool: safe arithmetic for tool-using rollouts (GSM8K and the like).

A model's tool call is untrusted text, so it is never given to Python's ``eval`` (nor ``ast``): a small
tokenizer and recursive-descent parser admit numbers and the operators ``+ - * / // % **`` (``^`` is read as
``**``), unary minus and plus, and parentheses; anything else (a name, a call, an attribute, a string) is refused
before anything is computed. Arithmetic is exact (``fractions.Fraction``: ``0.1 + 0.2`` is ``0.3``; ``7 / 2`` is
``3.5``); a number may carry thousands separators (``1,234.5``); units and currency signs are refused. The work is bounded, so a call cannot hang or exhaust memory: the input length, the nesting depth,
the exponent, the size of every intermediate result and the wall time (checked at every operation).

``calculate(text)`` is the tool: it returns the result as text (``12``, ``3.5``, ``0.3333333333``) or a
one-line ``error: ...`` observation; it never raises. ``evaluate`` is the parser that raises ``CalculatorError``.

Example:
  >>> calculate("(48 / 2) * 3 + 1,000")
  '1072'
  >>> calculate("__import__('os')")
  "error: 'calculator' takes only numbers and + - * / // % ** ( ): unexpected '_' at 1"
"""

from __future__ import annotations

import re
import time
from fractions import Fraction

MAX_INPUT_CHARS = 200  # a longer call is refused before parsing
MAX_DEPTH = 32  # nesting of parentheses and unary signs
MAX_EXPONENT = 64  # |n| in x ** n for an integer n
MAX_DIGITS = 40  # decimal digits of any intermediate numerator or denominator
MAX_SECONDS = 0.05  # wall time of one call

_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d*|\.\d+|\d+)|(?P<op>\*\*|//|[-+*/%^()]))",
    re.ASCII,
)
_MAX_VALUE = 10**MAX_DIGITS


class CalculatorError(ValueError):
    """A call the calculator refuses or cannot compute; the message is the observation (one line)."""


def _lex(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, 1-based column) of each token: kind "number" or "op"."""
    tokens, pos = [], 0
    while text[pos:].strip():
        match = _TOKEN.match(text, pos)
        if match is None:  # a name, a quote, a comma outside a number ("1,23"), ...
            col = len(text) - len(text[pos:].lstrip()) + 1
            raise CalculatorError(
                f"'calculator' takes only numbers and + - * / // % ** ( ): unexpected {text[col - 1]!r} at {col}"
            )
        kind = "number" if match.group("number") else "op"
        tokens.append((kind, match.group(kind), match.start(kind) + 1))
        pos = match.end()
    return tokens


class _Parser:
    """expr := term (('+' | '-') term)* ; term := unary (('*' | '/' | '//' | '%') unary)* ;
    unary := ('-' | '+') unary | power ; power := atom (('**' | '^') unary)? ; atom := number | '(' expr ')'.

    Python's precedence: ``-2 ** 2`` is -4, ``2 ** -1`` is 0.5, ``2 ** 3 ** 2`` is 512.
    """

    def __init__(self, tokens: list[tuple[str, str, int]], deadline: float):
        self.tokens, self.i, self.depth, self.deadline = tokens, 0, 0, deadline

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str, int]:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def check(self, value: Fraction) -> Fraction:
        if time.monotonic() > self.deadline:
            raise CalculatorError(f"took longer than {MAX_SECONDS} s")
        if abs(value.numerator) >= _MAX_VALUE or value.denominator >= _MAX_VALUE:
            raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            right = self.term()
            value = self.check(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()[1]
            right = self.unary()
            if op != "*" and right == 0:
                raise CalculatorError("division by zero")
            if op == "*":
                value = value * right
            elif op == "/":
                value = value / right
            elif op == "//":
                value = Fraction(value // right)
            else:
                value = value % right
            self.check(value)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("-", "+"):
            op = self.take()[1]
            self.enter()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() not in ("**", "^"):
            return base
        self.take()
        self.enter()
        exponent = self.unary()
        self.depth -= 1
        if exponent.denominator != 1:
            raise CalculatorError("only whole-number exponents are allowed")
        n = exponent.numerator
        if abs(n) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {n} is larger than {MAX_EXPONENT}")
        if base == 0 and n < 0:
            raise CalculatorError("division by zero")
        # Refuse before computing: digits of the result ~ |n| * digits of the base.
        digits = max(len(str(abs(base.numerator))), len(str(base.denominator))) - 1
        if digits * abs(n) > MAX_DIGITS:
            raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
        return self.check(base**n)

    def atom(self) -> Fraction:
        if self.i >= len(self.tokens):
            raise CalculatorError("the expression ends too early")
        kind, text, col = self.take()
        if kind == "number":
            return self.check(Fraction(text.replace(",", "")))
        if text == "(":
            self.enter()
            value = self.expr()
            self.depth -= 1
            if self.peek() != ")":
                raise CalculatorError(f"'(' at {col} is not closed")
            self.take()
            return value
        raise CalculatorError(f"unexpected {text!r} at {col}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nested deeper than {MAX_DEPTH}")


def evaluate(text: str) -> Fraction:
    """The exact value of an arithmetic expression.

    Args:
      text: e.g. ``"(3 + 4) * 2"``; at most ``MAX_INPUT_CHARS`` characters.

    Raises:
      CalculatorError: anything that is not arithmetic, or a bound exceeded (the message says which).
    """
    if len(text) > MAX_INPUT_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_INPUT_CHARS} characters")
    tokens = _lex(text)
    if not tokens:
        raise CalculatorError("the expression is empty")
    parser = _Parser(tokens, time.monotonic() + MAX_SECONDS)
    value = parser.expr()
    if parser.i < len(tokens):
        _, extra, col = tokens[parser.i]
        raise CalculatorError(f"unexpected {extra!r} at {col}")
    return value


def format_number(value: Fraction) -> str:
    """``12`` for a whole number, else up to 10 significant digits (``3.5``, ``0.3333333333``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculate(text: str) -> str:
    """The ``calculator`` tool: the value of ``text`` as text, or a one-line ``error: ...`` observation.

    Never raises: every refusal (a name, a call, an attribute, a string, a huge exponent or result, a long
    input, a timeout) is an observation the model reads.
    """
    try:
        return format_number(evaluate(str(text)))
    except CalculatorError as e:
        return "error: " + " ".join(str(e).split())
    except (ArithmeticError, ValueError, RecursionError) as e:  # a bound missed: still one line
        return f"error: {type(e).__name__}"
