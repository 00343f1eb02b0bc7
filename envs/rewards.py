"""Reward functions: a registry users extend with plain Python functions, and safe scoring.

A reward function is `fn(completion_text, answer, example) -> float | (float, components)`.
`completion_text` is the completion's answer: for a thinking model the text after `</think>`
(`''` when the completion was cut inside its reasoning; docs/DESIGN.md, "Chat templates,
reasoning and answer"), else the whole completion.
Register one with the decorator or a call:

    from rlpipe.envs.rewards import register_reward

    @register_reward("starts_with_answer")
    def starts_with_answer(text, answer, example):
        return float(text.strip().startswith(str(answer)))

    register_reward("my_reward", some_function)

and name it in a config (`task.options.reward = "starts_with_answer"` for the `dataset` env).
Built-ins: `exact_match`, `numeric_match`, `integer_match`, `format_integer`, `format_number`,
and `math` (final answers compared by value: GSM8K `####`, `\\boxed{}`, LaTeX), which
envs/math_answers.py registers (the dataset environment imports it).

Composition (`format_then_correct`): the format check runs first; when it fails the correctness
check is not evaluated (the reward is 0) and components record `format` and `correct` as 0/1.

Errors: `evaluate_reward` catches an exception from a reward function: reward 0, `error` = the
formatted traceback. `score_completions` counts them and raises `RewardError` (carrying the first
traceback) once their share of the batch exceeds `max_error_fraction` — a bug in a reward
function fails the step loudly instead of silently training on zeros.

The default registry is filled at import time (built-ins and user decorators); nothing changes it
while a run is going on.
"""

from __future__ import annotations

import math
import re
import traceback
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from rlpipe.envs.base import Environment, Example, Messages, RewardResult

RewardValue = float | tuple[float, dict[str, float]]
RewardFn = Callable[[str, Any, Example], RewardValue]


class RewardError(RuntimeError):
    """Too many reward calls raised; the message carries the first traceback."""


class RewardRegistry:
    """Named reward functions. `register` works as a call or as a decorator."""

    def __init__(self) -> None:
        self._fns: dict[str, RewardFn] = {}

    def register(
        self, name: str, fn: RewardFn | None = None, *, replace: bool = False
    ) -> Callable[[RewardFn], RewardFn] | RewardFn:
        if not name or not isinstance(name, str):
            raise ValueError(f"reward name must be a non-empty string, got {name!r}")

        def add(f: RewardFn) -> RewardFn:
            if not callable(f):
                raise ValueError(f"reward {name!r}: {f!r} is not callable")
            if name in self._fns and not replace and self._fns[name] is not f:
                raise ValueError(f"reward {name!r} is already registered (pass replace=True)")
            self._fns[name] = f
            return f

        return add if fn is None else add(fn)

    def get(self, name: str) -> RewardFn:
        if name not in self._fns:
            raise ValueError(f"unknown reward {name!r}; registered: {', '.join(self.names())}")
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns


REWARDS = RewardRegistry()


def register_reward(
    name: str,
    fn: RewardFn | None = None,
    *,
    replace: bool = False,
    registry: RewardRegistry = REWARDS,
) -> Any:
    """Register `fn` under `name` (or use as `@register_reward(name)`); returns fn / a decorator."""
    return registry.register(name, fn, replace=replace)


def get_reward(name: str | RewardFn, registry: RewardRegistry = REWARDS) -> RewardFn:
    """A reward function by name (a callable is returned as is)."""
    return name if callable(name) else registry.get(name)


# ---------------------------------------------------------------------------- evaluation


def format_traceback(exc: BaseException) -> str:
    """First line: `ExcType: message`; then the full traceback."""
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return summary + "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _as_result(value: RewardValue) -> RewardResult:
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(
                f"a reward function returned a {len(value)}-tuple; want (reward, components)"
            )
        reward, components = value
        components = {str(k): float(v) for k, v in dict(components).items()}
    else:
        reward, components = value, {}
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite: {reward}")
    return RewardResult(reward=reward, components=components, error=None)


def evaluate_reward(
    fn: RewardFn, completion_text: str, answer: Any, example: Example
) -> RewardResult:
    """`fn(completion_text, answer, example)` as a RewardResult; an exception gives reward 0 + error."""
    try:
        return _as_result(fn(completion_text, answer, example))
    except Exception as exc:  # noqa: BLE001 — user code: record it, count it, decide later
        return RewardResult(reward=0.0, components={}, error=format_traceback(exc))


def score_completions(
    env: Environment,
    examples: Sequence[Example],
    completions_text: Sequence[str | Messages],
    max_error_fraction: float = 0.0,
) -> list[RewardResult]:
    """Score each completion against its example (same order, same length).

    Raises `RewardError` with the first traceback when the share of reward calls that raised
    exceeds `max_error_fraction` (0.0: any error raises; 1.0: never raises).
    """
    if len(examples) != len(completions_text):
        raise ValueError(
            f"score_completions: {len(examples)} examples for {len(completions_text)} completions"
        )
    if not 0.0 <= max_error_fraction <= 1.0:
        raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
    results = []
    for example, text in zip(examples, completions_text, strict=True):
        try:
            result = env.reward(example, text)
        except Exception as exc:  # noqa: BLE001 — an env's own reward() may raise too
            result = RewardResult(reward=0.0, components={}, error=format_traceback(exc))
        results.append(result)
    errors = [r.error for r in results if r.error is not None]
    if results and len(errors) / len(results) > max_error_fraction:
        raise RewardError(
            f"{len(errors)} of {len(results)} reward calls raised (more than "
            f"max_error_fraction={max_error_fraction}); first error:\n{errors[0]}"
        )
    return results


def reward_metrics(results: Sequence[RewardResult]) -> dict[str, float]:
    """`rollout/*` metrics: reward mean, error count and share, mean of each component."""
    if not results:
        return {
            "rollout/reward_mean": 0.0,
            "rollout/reward_errors": 0.0,
            "rollout/reward_error_fraction": 0.0,
        }
    n = len(results)
    errors = sum(r.error is not None for r in results)
    metrics = {
        "rollout/reward_mean": sum(r.reward for r in results) / n,
        "rollout/reward_errors": float(errors),
        "rollout/reward_error_fraction": errors / n,
    }
    names = sorted({k for r in results for k in r.components})
    for name in names:
        metrics[f"rollout/{name}_mean"] = sum(r.components.get(name, 0.0) for r in results) / n
    return metrics


# ---------------------------------------------------------------------------- composition


def format_then_correct(
    format_fn: Callable[[str, Any, Example], float | bool],
    correct_fn: Callable[[str, Any, Example], float | bool],
    *,
    format_reward: float = 0.0,
) -> RewardFn:
    """A reward that checks format first, then correctness (short-circuit on format failure).

    reward = format_reward + correct when the format passes (correct ∈ {0, 1} or a partial score),
    0 otherwise; components {"format": 0/1, "correct": 0/1 (or the partial score)}.
    """

    def reward(text: str, answer: Any, example: Example) -> tuple[float, dict[str, float]]:
        if not format_fn(text, answer, example):
            return 0.0, {"format": 0.0, "correct": 0.0}
        correct = float(correct_fn(text, answer, example))
        return format_reward + correct, {"format": 1.0, "correct": correct}

    return reward


# ---------------------------------------------------------------------------- built-ins

_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|-?\d+/\d+")
_NUMBER_SEARCH = re.compile(r"-?\d+/\d+|-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(text: str, max_exponent: int = 400, max_digits: int = 1000) -> Fraction:
    """An exact number from '12', '-3.5', '1e3' or '7/2' (ValueError otherwise).

    Bounded: more than `max_digits` characters or an exponent beyond ±`max_exponent` is refused
    (a model can write "1e999999999"; building that integer would hang the scorer).
    """
    text = text.strip().replace(",", "")
    if len(text) > max_digits or not _NUMBER.fullmatch(text):
        raise ValueError(f"not a number: {text[:40]!r}")
    if "e" in text.lower():
        exponent = int(text.lower().split("e")[1])
        if abs(exponent) > max_exponent:
            raise ValueError(f"exponent out of range: {text[:40]!r}")
    try:
        return Fraction(text)
    except ZeroDivisionError:
        raise ValueError(f"zero denominator: {text[:40]!r}") from None


def _try_parse_number(text: str) -> Fraction | None:
    try:
        return parse_number(text)
    except ValueError:
        return None


def format_integer(text: str, answer: Any = None, example: Example | None = None) -> float:
    """1.0 when the stripped completion is an integer (digits, optional minus sign), else 0.0."""
    return float(_INTEGER.fullmatch(text.strip()) is not None)


def format_number(text: str, answer: Any = None, example: Example | None = None) -> float:
    """1.0 when the stripped completion is one number (int, decimal, exponent or a/b), else 0.0."""
    return float(_NUMBER.fullmatch(text.strip().replace(",", "")) is not None)


def exact_match(text: str, answer: Any, example: Example | None = None) -> float:
    """1.0 when the stripped completion equals str(answer) stripped."""
    return float(text.strip() == str(answer).strip())


def _numbers_equal(a: Fraction, b: Fraction, rel_tol: float = 1e-6) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)
    except OverflowError:  # beyond float range: only exact equality counts
        return False


def numeric_match(
    text: str, answer: Any, example: Example | None = None
) -> tuple[float, dict[str, float]]:
    """Compare the last number in the completion with the answer (exact, or 1e-6 relative).

    components: format = a number was found, correct = it equals the answer.
    """
    found = _NUMBER_SEARCH.findall(text.replace(",", ""))
    value = _try_parse_number(found[-1]) if found else None
    if value is None:  # the completion's problem, not the reward function's
        return 0.0, {"format": 0.0, "correct": 0.0}
    correct = float(_numbers_equal(value, parse_number(str(answer))))
    return correct, {"format": 1.0, "correct": correct}


def integer_equal(text: str, answer: Any, example: Example | None = None) -> float:
    """1.0 when the completion, an integer, equals int(answer). Compared as canonical text, so
    that a 10,000-digit completion is simply wrong rather than an int-conversion error."""
    text = text.strip()
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("-").lstrip("0") or "0"
    canonical = digits if digits == "0" else sign + digits
    return float(canonical == str(int(answer)))


register_reward("exact_match", exact_match)
register_reward("numeric_match", numeric_match)
register_reward("format_integer", format_integer)
register_reward("format_number", format_number)
register_reward("integer_match", format_then_correct(format_integer, integer_equal))
