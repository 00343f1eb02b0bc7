"""The `math` reward: a completion's final answer compared by value with the reference answer.

    math_reward("... so she has 1,234 apples.", "She sells ... #### 1234", example)   # -> (1.0, {...})

Final answer: the last `\\boxed{...}`, else what follows the last `####`, else (a completion) the
last number. The reference is reduced the same way (GSM8K's "...#### 72" to "72"); one with
neither is taken whole (`\\frac{1}{\\sqrt{2}}`). Comparison, cheapest first:

1. both are plain numbers (`1,234`, `-3.5`, `7/2`, `1e3`, a trailing `.` or `%` or a leading `$`
   dropped; `\\frac{1}{2}`, `\\dfrac12` read as fractions): exact, or within 1e-6 relative;
2. otherwise math-verify (the `math-verify` package: LaTeX and expressions parsed with sympy, e.g.
   `\\frac{\\sqrt{2}}{2}` equals `\\frac{1}{\\sqrt{2}}`), in one worker process per scoring process
   (math-verify's own `MATH_VERIFY_TIMEOUT_S` alarm inside it; a worker that overruns twice that
   is killed and the answer counts as wrong, so no input can hang a scorer);
3. without math-verify installed, or for answers longer than `MAX_ANSWER_CHARS`: the two answers
   as text, whitespace and `$` dropped.

components: `format` = a final answer was found in the completion, `correct` = it matches.
"""

from __future__ import annotations

import atexit
import re
import threading
from fractions import Fraction
from typing import Any

from rlpipe.envs.rewards import _numbers_equal, parse_number, register_reward

MATH_VERIFY_TIMEOUT_S = 5
"""Seconds math-verify may spend parsing and comparing one answer pair."""
MAX_ANSWER_CHARS = 200
"""Longer final answers are compared as text, never parsed (a bound on what sympy is given)."""

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FRAC = re.compile(r"(-?)\\[dt]?frac\s*(?:\{\s*(-?\d+)\s*\}|(\d))\s*(?:\{\s*(-?\d+)\s*\}|(\d))")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    command = re.match(r"\\(?:boxed|fbox)\s*", text[start:])
    open_at = start + command.end()
    if not text.startswith("{", open_at):  # "\boxed 5"
        rest = text[open_at:].split()
        return rest[0].rstrip(".$") if rest else None
    depth = 0
    for index in range(open_at, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:index]
    return None


def final_answer(text: Any) -> str | None:
    """The final answer in `text`: the last \\boxed{}, else after the last ####, else the last
    number (None when there is none)."""
    text = str(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def plain_number(answer: str) -> Fraction | None:
    """`answer` as an exact number when it is one (thousands separators, `$`, `%`, a trailing
    period, `\\frac{a}{b}` and `a/b` allowed); None otherwise."""
    text = answer.strip().strip("$").strip()
    text = re.sub(r"\\[,!;: ]|\\text\{[^}]*\}|\\%|%|\\\$", "", text).strip().rstrip(".").strip()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    frac = _FRAC.fullmatch(text)
    if frac:
        sign, num, den = frac[1], frac[2] or frac[3], frac[4] or frac[5]
        text = f"{sign}{num}/{den}"
    try:
        return parse_number(text)
    except ValueError:
        return None


def _verify_in_worker(prediction: str, reference: str, timeout_s: int) -> bool:
    """math-verify's verdict, in the worker process (its main thread: math-verify's own alarm works)."""
    from math_verify import parse, verify

    gold = parse(f"${reference}$", parsing_timeout=timeout_s)
    guess = parse(f"${prediction}$", parsing_timeout=timeout_s)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=timeout_s))


_WORKER: Any = None
_WORKER_LOCK = threading.Lock()
_WORKER_START_S = 60.0  # a fresh worker imports sympy and math-verify first


def _math_verify_equal(prediction: str, reference: str, timeout_s: int) -> bool | None:
    """math-verify's verdict from a worker process, False when it overruns (the worker is then
    killed: sympy can hold the interpreter for minutes on `9^{9^{9^{9}}}`, which neither an alarm
    nor an abandoned thread would stop); None when math-verify is not installed."""
    global _WORKER
    import importlib.util

    if importlib.util.find_spec("math_verify") is None:
        return None
    import multiprocessing

    with _WORKER_LOCK:  # one comparison at a time: the worker is one process
        fresh = _WORKER is None
        if fresh:
            _WORKER = multiprocessing.get_context("spawn").Pool(1)
            atexit.register(_WORKER.terminate)  # before interpreter teardown, which a late __del__ trips on
        pending = _WORKER.apply_async(_verify_in_worker, (prediction, reference, timeout_s))
        try:
            return bool(pending.get(2 * timeout_s + (_WORKER_START_S if fresh else 0.0)))
        except multiprocessing.TimeoutError:
            _WORKER.terminate()
            atexit.unregister(_WORKER.terminate)
            _WORKER = None
            return False
        except Exception:  # noqa: BLE001 - a parse math-verify cannot do: not equal
            return False


def _as_text(answer: str) -> str:
    return re.sub(r"\s+|\$", "", answer)


def answers_equal(prediction: str, reference: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Whether two final answers are the same value (see the module docstring for the order)."""
    a, b = plain_number(prediction), plain_number(reference)
    if a is not None and b is not None:
        return _numbers_equal(a, b)
    if _as_text(prediction) == _as_text(reference):
        return True
    if max(len(prediction), len(reference)) > MAX_ANSWER_CHARS:
        return False
    verdict = _math_verify_equal(prediction, reference, timeout_s)
    return bool(verdict)


def reference_answer(answer: Any) -> str:
    """A dataset's reference reduced to its final answer: the last \\boxed{}, else after the last
    ####, else the whole (stripped) text, e.g. `\\frac{1}{\\sqrt{2}}` as is."""
    text = str(answer)
    if last_boxed(text) is not None or _HASHES.search(text):
        return final_answer(text) or ""
    return text.strip()


def math_reward(text: str, answer: Any, example: Any = None) -> tuple[float, dict[str, float]]:
    """1.0 when the completion's final answer equals the reference's final answer by value."""
    guess = final_answer(text)
    if guess is None:
        return 0.0, {"format": 0.0, "correct": 0.0}
    reference = reference_answer(answer)
    if not reference:
        raise ValueError(f"reference answer {str(answer)[:60]!r} holds no final answer")
    correct = float(answers_equal(guess, reference))
    return correct, {"format": 1.0, "correct": correct}


register_reward("math", math_reward)
