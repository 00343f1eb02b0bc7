"""The code environment's built-in task set: a dozen function specs, each with a parameter, a
reference solution, a plausible wrong one (the imperfect teacher's) and hidden unit tests.

    task = make_task(FAMILIES["add"], 7, rng)     # "Write a Python function f(x) that returns x plus 7."
    task.tests                                     # ((args, expected), ...) hidden from the model

Every task asks for a function `f`. A family's parameter gives many instances (`x plus 7`, `x plus
12`, ...), so the eval split holds instances train never shows. Expected values come from the
reference solution, run here (it is this module's own code, not a model's); inputs and outputs are
JSON values (ints, bools, strings, lists), so the tests travel to the sandbox as JSON.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FUNCTION = "f"


@dataclass(frozen=True)
class Family:
    """A spec with a parameter.

    spec:      the task's text after "Write a Python function", with {p} for the parameter
    solution:  the reference body's expression, with {p} (the argument names are in `signature`)
    wrong:     a plausible mistake of the same shape (the imperfect teacher's)
    params:    the parameter's values
    inputs:    draws one call's arguments (a tuple) for a parameter value
    """

    name: str
    signature: str
    spec: str
    solution: str
    wrong: str
    params: tuple[Any, ...]
    inputs: Callable[[random.Random, Any], tuple]


@dataclass(frozen=True)
class CodeTask:
    """One instance: the prompt's spec, the reference and wrong solutions, the hidden tests."""

    family: str
    param: Any
    spec: str
    solution: str
    wrong_solution: str
    tests: tuple[tuple[list, Any], ...]


def _int(rng: random.Random, _p: Any) -> tuple:
    return (rng.randint(-30, 30),)


def _small(rng: random.Random, _p: Any) -> tuple:
    return (rng.randint(-9, 9),)


def _text(rng: random.Random, _p: Any) -> tuple:
    return ("".join(rng.choice("abcde") for _ in range(rng.randint(0, 8))),)


def _long_text(rng: random.Random, p: Any) -> tuple:
    return ("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(p, p + 6))),)


def _items(rng: random.Random, p: Any) -> tuple:
    low = p + 1 if isinstance(p, int) and 0 <= p < 6 else 1
    return ([rng.randint(0, 20) for _ in range(rng.randint(low, low + 5))],)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("add", "x", "returns x plus {p}", "x + {p}", "x - {p}", tuple(range(1, 100)), _int),
    Family("times", "x", "returns x times {p}", "x * {p}", "x + {p}", tuple(range(2, 21)), _int),
    Family("mod", "x", "returns the remainder of x divided by {p}", "x % {p}", "x // {p}",
           tuple(range(2, 21)), _int),
    Family("power", "x", "returns x to the power {p}", "x ** {p}", "x * {p}", (2, 3, 4, 5), _small),
    Family("repeat", "s", "returns s repeated {p} times", "s * {p}", "s * {p} + s", tuple(range(2, 10)), _text),
    Family("count", "s", "returns how many times {p!r} occurs in s", "s.count({p!r})", "s.find({p!r})",
           tuple("abcde"), _text),
    Family("index", "xs", "returns the item at index {p} of xs", "xs[{p}]", "xs[{p} - 1]", (1, 2, 3, 4, 5), _items),
    Family("sum", "xs", "returns the sum of xs plus {p}", "sum(xs) + {p}", "sum(xs)", tuple(range(1, 100)), _items),
    Family("multiple", "x", "returns whether x is a multiple of {p}", "x % {p} == 0", "x % {p} == 1",
           tuple(range(2, 21)), _int),
    Family("smaller", "x", "returns the smaller of x and {p}", "min(x, {p})", "max(x, {p})",
           tuple(range(-30, 31)), _int),
    Family("above", "xs", "returns the items of xs greater than {p}", "[v for v in xs if v > {p}]",
           "[v for v in xs if v >= {p}]", tuple(range(0, 21)), _items),
    Family("suffix", "s", "returns the last {p} characters of s", "s[-{p}:]", "s[:{p}]", (1, 2, 3, 4, 5), _long_text),
)}


def source_of(family: Family, expression: str, param: Any) -> str:
    """A whole solution: `def f(<args>):` returning the expression at `param`."""
    return f"def {FUNCTION}({family.signature}):\n    return {expression.format(p=param)}\n"


def reference(family: Family, param: Any) -> Callable[..., Any]:
    """The reference solution as a function (this module's own code, run on the host)."""
    namespace: dict[str, Any] = {}
    exec(source_of(family, family.solution, param), namespace)  # noqa: S102 - our own reference, not a model's
    return namespace[FUNCTION]


def make_task(family: Family, param: Any, rng: random.Random, n_tests: int = 5) -> CodeTask:
    """An instance of `family` at `param` with `n_tests` hidden tests drawn from `rng` (distinct
    inputs where the family has enough)."""
    solve = reference(family, param)
    tests: dict[str, tuple[list, Any]] = {}
    for _ in range(n_tests * 20):
        args = family.inputs(rng, param)
        tests.setdefault(repr(args), (list(args), solve(*args)))
        if len(tests) == n_tests:
            break
    spec = f"Write a Python function {FUNCTION}({family.signature}) that {family.spec.format(p=param)}."
    return CodeTask(family.name, param, spec, source_of(family, family.solution, param),
                    source_of(family, family.wrong, param), tuple(tests.values()))
