"""The `math` reward: a completion's final answer compared by value with the reference answer.

    math_reward("... so she has 1,234 apples.", "She sells ... #### 1234", example)   # -> (1.0, {...})

Final answer: the last `\\boxed{...}`, else what follows the last `####`, else (a completion) the
last number. The reference is reduced the same way (GSM8K's "...#### 72" to "72"); one with
neither is taken whole (`\\frac{1}{\\sqrt{2}}`). Comparison, cheapest first:

1. both are plain numbers (`1,234`, `-3.5`, `7/2`, `1e3`, a trailing `.` or `%` or a leading `$`
   dropped; `\\frac{1}{2}`, `\\dfrac12` read as fractions): exact, or within 1e-6 relative;
2. both are lists of plain numbers (`3,5`, `1, 2, 3`): equal as sets, each element by value;
3. an answer the pre-check refuses (`too_costly`) is wrong, and is never parsed;
4. otherwise math-verify (the `math-verify` package: LaTeX and expressions parsed with sympy, e.g.
   `\\frac{\\sqrt{2}}{2}` equals `\\frac{1}{\\sqrt{2}}`), in a pool of worker processes (see below);
5. without math-verify installed, or for answers longer than `MAX_ANSWER_CHARS`: the two answers
   as text, whitespace and `$` dropped.

Numbers are read as the GSM8K and MATH graders read them (GSM8K strips thousands separators;
math-verify, the MATH grader, reads a comma list as a set): a comma is a thousands separator only
in `1,234` or `12,345,678` (groups of three digits after the first), so `1,234` is 1234; `3,5` and
`1,2,3` are lists ({3, 5} and {1, 2, 3}), never 35 or 123, and never a decimal comma. Relative
tolerance 1e-6 applies to non-zero values only: `\\boxed{1e-300}` is not 0 (a zero matches only
zero), as exact comparison says.

Each answer's time is its own: math-verify runs in up to `MATH_VERIFY_WORKERS` worker processes at
once, each answer on a worker of its own, timed from when that worker takes it (math-verify's own
`MATH_VERIFY_TIMEOUT_S` alarm inside; a worker that overruns twice that is killed, the answer
counts as wrong, and a replacement starts at once, in the background). A spare warm worker is kept
ready, so an innocent answer scored while another runs long gets a worker without waiting for it
(the reward of one answer never depends on its neighbours, `task.reward_timeout_s` included).
Before any of that, a cheap pre-check (`too_costly`) refuses what no worker could evaluate in
time: a numeric power tower or power whose value has more than `MAX_DIGITS` digits
(`9^{9^{9^{9}}}`, `2^{10^{6}}`), a factorial of more than `MAX_DIGITS` digits (`10000!`) or of a
factorial (`(5!)!!`), a binomial of such size, and braces nested past 50 levels.

components: `format` = a final answer was found in the completion, `correct` = it matches.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from fractions import Fraction
from typing import Any

from rlpipe.envs.math_precheck import matching_brace, too_costly
from rlpipe.envs.rewards import parse_number, register_reward

MATH_VERIFY_TIMEOUT_S = 5
"""Seconds math-verify may spend parsing and comparing one answer pair."""
MAX_ANSWER_CHARS = 200
"""Longer final answers are compared as text, never parsed (a bound on what sympy is given)."""
"""The pre-check refuses numeric powers and factorials whose value has more digits than this."""
MATH_VERIFY_WORKERS = max(2, min(4, os.cpu_count() or 2))
"""Worker processes comparing answers at once (each answer on one of its own)."""

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
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
    close = matching_brace(text, open_at)
    return None if close is None else text[open_at + 1:close]


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
    if "," in text:
        if not _THOUSANDS.fullmatch(text):  # "3,5", "1,2,3": a list, not a number
            return None
        text = text.replace(",", "")
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


def _serve(connection: Any) -> None:
    """A worker process: import math-verify, say ready, then answer (prediction, reference,
    timeout) requests with a verdict (None: math-verify could not parse or compare)."""
    import math_verify  # noqa: F401 - imported before "ready": a request's time is its own

    connection.send("ready")
    while True:
        try:
            prediction, reference, timeout_s = connection.recv()
        except EOFError:
            return
        try:
            connection.send(_verify_in_worker(prediction, reference, timeout_s))
        except Exception:  # noqa: BLE001 - a parse math-verify cannot do: not equal
            connection.send(False)


class _Worker:
    """One worker process and its end of the pipe."""

    def __init__(self, serve: Any = _serve) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(theirs,), daemon=True, name="rlpipe-math-verify")
        self.process.start()
        theirs.close()

    def ready(self, timeout_s: float) -> bool:
        return self.connection.poll(timeout_s) and self.connection.recv() == "ready"

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.connection.close()


class _VerifierPool:
    """Up to `size` warm math-verify workers; an answer takes an idle one (or starts one, or waits
    for one to come back), and one that overruns is killed and replaced in the background."""

    def __init__(self, size: int, serve: Any = _serve) -> None:
        self.size, self.serve = size, serve
        self.idle: list[_Worker] = []
        self.live = 0  # workers started and not killed: idle, busy or starting
        self.changed = threading.Condition()
        atexit.register(self.close)

    def _start_spare(self) -> None:
        """Start workers in the background up to `size` (under `changed`): the pool is kept full
        and warm, so an answer finds an idle worker unless `size` answers run at once."""
        while self.live < self.size:
            self.live += 1
            threading.Thread(target=self._warm, name="rlpipe-math-verify-start", daemon=True).start()

    def _warm(self) -> None:
        worker = None
        try:
            worker = _Worker(self.serve)
            ok = worker.ready(_WORKER_START_S)
        except Exception:  # noqa: BLE001 - a worker that cannot start: room for another
            ok = False
        with self.changed:
            if ok:
                self.idle.append(worker)
            else:
                self.live -= 1
                if worker is not None:
                    worker.kill()
            self.changed.notify_all()

    def compare(self, prediction: str, reference: str, timeout_s: int) -> bool:
        with self.changed:
            self._start_spare()
            while not self.idle:
                if not self.changed.wait(_WORKER_START_S) and not self.idle and self.live == 0:
                    return False  # no worker could start
                self._start_spare()
            worker = self.idle.pop()
            self._start_spare()  # a warm spare for the next answer while this one runs
        try:
            worker.connection.send((prediction, reference, timeout_s))
            if worker.connection.poll(2 * timeout_s):
                verdict = bool(worker.connection.recv())
                with self.changed:
                    self.idle.append(worker)
                    self.changed.notify_all()
                return verdict
        except (OSError, EOFError):
            pass
        worker.kill()  # overran (sympy can hold it for minutes on `9^{9^{9^{9}}}`) or died
        with self.changed:
            self.live -= 1
            self._start_spare()
            self.changed.notify_all()
        return False

    def close(self) -> None:
        with self.changed:
            workers, self.idle = self.idle, []
        for worker in workers:
            worker.kill()


_POOL: _VerifierPool | None = None
_POOL_LOCK = threading.Lock()
_WORKER_START_S = 60.0  # a fresh worker imports sympy and math-verify first


def _math_verify_equal(prediction: str, reference: str, timeout_s: int) -> bool | None:
    """math-verify's verdict from a pool worker, False when it overruns (the worker is then
    killed and replaced: neither an alarm nor an abandoned thread stops sympy); None when
    math-verify is not installed."""
    global _POOL
    import importlib.util

    if importlib.util.find_spec("math_verify") is None:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _VerifierPool(MATH_VERIFY_WORKERS)
    return _POOL.compare(prediction, reference, timeout_s)


def _as_text(answer: str) -> str:
    return re.sub(r"\s+|\$", "", answer)


def _same_number(a: Fraction, b: Fraction) -> bool:
    """Exact, or within 1e-6 relative, computed exactly; so a zero equals only zero (1e-300 is not 0)."""
    return a == b or abs(a - b) * 1_000_000 <= max(abs(a), abs(b))


def number_list(answer: str) -> list[Fraction] | None:
    """`answer` as a comma list of plain numbers (`3,5`, `1, 2, 3`, `\\{1,2\\}`), or None."""
    text = answer.strip().strip("$").strip()
    text = re.sub(r"^\\\{(.*)\\\}$|^\{(.*)\}$", lambda m: m.group(1) or m.group(2) or "", text).strip()
    if "," not in text or _THOUSANDS.fullmatch(text):
        return None
    values = [plain_number(part) for part in text.split(",")]
    return None if any(v is None for v in values) else values  # type: ignore[return-value]


def answers_equal(prediction: str, reference: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Whether two final answers are the same value (see the module docstring for the order)."""
    a, b = plain_number(prediction), plain_number(reference)
    if a is not None and b is not None:
        return _same_number(a, b)
    listed_a, listed_b = number_list(prediction), number_list(reference)
    if listed_a is not None and listed_b is not None:  # sets, as math-verify compares them
        return (all(any(_same_number(x, y) for y in listed_b) for x in listed_a)
                and all(any(_same_number(x, y) for x in listed_a) for y in listed_b))
    if _as_text(prediction) == _as_text(reference):
        return True
    if max(len(prediction), len(reference)) > MAX_ANSWER_CHARS or too_costly(prediction) or too_costly(reference):
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
