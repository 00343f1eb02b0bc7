"""The math reward's cheap pre-check (envs/math_answers.py): an answer that no math-verify worker
could evaluate in time (numeric powers and towers, factorials and binomials past MAX_DIGITS
digits, braces nested too deep) is refused as wrong before any worker sees it."""

from __future__ import annotations

import math
import re

MAX_DIGITS = 10_000
_POWER_BASE = re.compile(r"\d+(?:\.\d+)?")


_FACTORIAL = re.compile(r"(\d+)\s*!")


_PAREN_NUMBER = re.compile(r"[({]\s*(\d+(?:\.\d+)?)\s*[)}]")


_GROUP_FACTORIAL = re.compile(r"[)}\]]\s*!")


_BINOM = re.compile(r"\\[dt]?binom\s*\{?\s*(\d+)")


def _group_before(text: str, close: int) -> str:
    """The inside of the bracket group whose closing bracket is at `close`."""
    depth = 0
    for index in range(close, -1, -1):
        depth += (text[index] in ")}]") - (text[index] in "({[")
        if depth == 0:
            return text[index + 1:close]
    return text[:close]


def matching_brace(text: str, start: int) -> int | None:
    """Index of the `}` closing the brace group that opens at `start`; None when unclosed."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return index
    return None


def _group(text: str, start: int) -> int:
    """Index after the brace group opening at `start` (or len(text) when unclosed)."""
    close = matching_brace(text, start)
    return len(text) if close is None else close + 1


def _tower_digits(text: str, start: int) -> tuple[float, int]:
    """log10 of |value| of the numeric power tower starting with the number at `start`
    (`9^{9^9}`, `2^10^3`, right-associative), and the index after it; inf past float range."""
    number = _POWER_BASE.match(text, start)
    scale = _log10(number.group())  # |log10 of the base|: how fast its powers grow
    end = number.end()
    rest = text[end:].lstrip()
    if not rest.startswith("^") and not rest.startswith("**"):
        return scale, end
    at = end + (len(text[end:]) - len(rest)) + (1 if rest.startswith("^") else 2)
    while at < len(text) and text[at] == " ":
        at += 1
    if at < len(text) and text[at] == "{":
        close = _group(text, at)
        inner = text[at + 1:close - 1].strip().lstrip("-").strip()
        after = close
        if not inner or not _POWER_BASE.match(inner):
            return 0.0, after
        exponent_digits, used = _tower_digits(inner, 0)
        if inner[used:].strip():  # not a pure tower: take the larger of its parts' towers
            exponent_digits = max_power_digits(inner)
    elif at < len(text) and _POWER_BASE.match(text, at):
        exponent_digits, after = _tower_digits(text, at)
    else:
        return 0.0, at
    if scale == 0.0:
        return 0.0, after
    if exponent_digits > 300:
        return math.inf, after
    return 10 ** exponent_digits * scale, after


def _log10(number: str) -> float:
    """|log10| of a non-negative decimal literal, without overflowing on a long one (0 for 0 and 1)."""
    whole = number.split(".")[0].lstrip("0")
    if len(whole) > 300:
        return float(len(whole))
    value = float(number)
    return abs(math.log10(value)) if value > 0 else 0.0


def max_power_digits(text: str) -> float:
    """The most digits (log10 of |value|) of any numeric power or power tower in `text` (a
    number without an exponent counts 0: sympy reads long literals quickly)."""
    most, at = 0.0, 0
    while (number := _POWER_BASE.search(text, at)) is not None:
        digits, end = _tower_digits(text, number.start())
        if end > number.end():  # it had an exponent
            most = max(most, digits)
        at = max(end, number.end())
    return most


def too_costly(answer: str) -> bool:
    """Whether `answer` holds what math-verify could not evaluate in time (see the module
    docstring): the cheap pre-check, linear in the answer's length."""
    text = _PAREN_NUMBER.sub(r"\1", answer.replace("\\left", "").replace("\\right", ""))
    depth = most = 0
    for char in text:
        depth += (char == "{") - (char == "}")
        most = max(most, depth)
    if most > 50:
        return True
    if max_power_digits(text) > MAX_DIGITS:
        return True
    for match in _FACTORIAL.finditer(text):
        if math.lgamma(int(match.group(1)) + 1) / math.log(10) > MAX_DIGITS:
            return True
    for match in _GROUP_FACTORIAL.finditer(text):  # (10^{10})!, (5!)!: the group's size bounds n
        inside = _group_before(text, match.start())
        literal = max((_log10(n) for n in _POWER_BASE.findall(inside)), default=0.0)
        digits = max(max_power_digits(inside), literal)
        if "!" in inside or digits > 300 or math.lgamma(10 ** digits + 1) / math.log(10) > MAX_DIGITS:
            return True
    return any(int(m.group(1)) * math.log10(2) > MAX_DIGITS for m in _BINOM.finditer(text))

