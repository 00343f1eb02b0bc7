"""Safe evaluation of arithmetic expressions written by a model (never `eval`).

`evaluate(text)` accepts only integer literals, `+ - * /`, parentheses and spaces. The text is
checked against a character whitelist and a length limit before parsing, then parsed with
`ast` and walked over a whitelist of node types; anything else (names, calls, attributes,
`**`, `//`, floats, strings...) raises `ExpressionError`. Arithmetic is exact (`Fraction`), so
`7/2*2` is 7 and division by zero is an error, not a float.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() ]+")
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ExpressionError(ValueError):
    """The text is not a well-formed, allowed arithmetic expression."""


@dataclass(frozen=True)
class Evaluated:
    """value: the exact result; literals: the integer literals in order of appearance."""

    value: Fraction
    literals: tuple[int, ...]


def evaluate(
    text: str,
    *,
    operators: str = "+-*/",
    allow_unary_minus: bool = False,
    max_len: int = 256,
    max_depth: int = 100,
) -> Evaluated:
    """Parse and evaluate `text` exactly; raise ExpressionError on anything not allowed."""
    text = text.strip()
    if not text:
        raise ExpressionError("empty expression")
    if len(text) > max_len:
        raise ExpressionError(f"expression longer than {max_len} characters")
    if not _ALLOWED_CHARS.fullmatch(text):
        bad = sorted({c for c in text if not _ALLOWED_CHARS.fullmatch(c)})
        raise ExpressionError(f"characters not allowed: {''.join(bad)[:20]!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"cannot parse: {type(exc).__name__}") from None
    literals: list[int] = []
    value = _walk(tree.body, operators, allow_unary_minus, literals, 0, max_depth)
    return Evaluated(value=value, literals=tuple(literals))


def _walk(
    node: ast.AST, operators: str, unary: bool, literals: list[int], depth: int, max_depth: int
) -> Fraction:
    if depth > max_depth:
        raise ExpressionError(f"expression nested deeper than {max_depth}")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        symbol = _BINOPS[type(node.op)]
        if symbol not in operators:
            raise ExpressionError(f"operator {symbol!r} not allowed")
        left = _walk(node.left, operators, unary, literals, depth + 1, max_depth)
        right = _walk(node.right, operators, unary, literals, depth + 1, max_depth)
        if symbol == "+":
            return left + right
        if symbol == "-":
            return left - right
        if symbol == "*":
            return left * right
        if right == 0:
            raise ExpressionError("division by zero")
        return left / right
    if unary and isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_walk(node.operand, operators, unary, literals, depth + 1, max_depth)
    raise ExpressionError(f"{type(node).__name__} not allowed")
