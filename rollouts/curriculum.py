"""The pass-rate curriculum (`rl.curriculum.type = "pass_rate"`): prompts the policy always solves, or
never does, rest instead of filling the batch with zero-variance groups.

Each prompt, keyed by (env, example_id), keeps its pass history: whether each of its last
`window` scored completions passed (reward >= `pass_reward`; completions whose reward function
raised are not counted). A prompt whose window is full and all passed is *solved*, all failed
*hopeless*: it rests. When the prompt stream reaches a resting prompt it is sampled anyway with
probability `retest` (a re-test, whose scores refresh its window and may wake it) and skipped
otherwise; the chance comes from a hash of (seed, step, attempt, env, example_id), so a replayed
step draws the same prompts. A round reads the stream at most once round (never the same prompt
twice in a round, which would merge into one group). Every skip and re-test is a row of the `curriculum` table with its
reason (`decision_row`).

`key = "class"` (rl.curriculum.key) keys the history by the prompt's *class* instead: the
environment's `Example.curriculum_key` (what makes it hard, e.g. arithmetic's operand digits and
carries), or its example_id when the environment gives none. Prompts that never repeat then rest
with their class once the class is solved; the window should span several groups of the class.
A resting class is re-tested prompt by prompt: each of its prompts is sampled with probability
`retest` (drawn per example). `solved_rate` < 1 lets a large window rest with a few failures in it.

    curriculum = Curriculum(options, PassHistory.from_rows(history_rows(run_dir, through_step=s), w))
    examples, rows = curriculum.choose(prompts.next_batch, n, step=step, attempt=attempt)
    curriculum.observe(rollouts, scores)        # after the round is scored

The history is never saved: a resumed run rebuilds it from its own `rollouts` and `scores`
tables up to the checkpoint's step (`history_rows`), the exact history the stopped run had there.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rlpipe.envs.base import Example
    from rlpipe.rollouts.records import Rollout, Score

KINDS = ("none", "pass_rate")
KEYS = ("example", "class")
STATUSES = ("skipped", "retested")
Key = tuple[str, str]
"""What a pass history is kept for: (env, example_id), or (env, class) with key = "class"."""


@dataclass(frozen=True)
class CurriculumOptions:
    """What the curriculum reads of the `[rl]` section ([rl.curriculum])."""

    kind: str = "none"
    window: int = 8
    """Completions of a prompt its pass rate is taken over (the newest ones)."""
    retest: float = 0.1
    """Chance that a resting prompt is sampled when its turn comes."""
    pass_reward: float = 1.0
    """A completion passes when its reward is at least this."""
    seed: int = 0
    """The run's seed: the re-test draws derive from it."""
    key: str = "example"
    """"example": a history per prompt; "class": per the environment's Example.curriculum_key."""
    solved_rate: float = 1.0
    """A full window rests as solved when at least this share passed (hopeless: at most 1 - it)."""
    reads: float = 0.0
    """A round reads at most this many times the prompts it asks for (0 = until it has them): with
    most prompts resting, a round then samples fewer instead of searching the stream for more."""

    def key_of(self, example: Example) -> Key:
        """The history key of a prompt: its example_id, or its class with key = "class" (the
        example_id when the environment gives no class)."""
        if self.key == "class" and example.curriculum_key is not None:
            return example.env, example.curriculum_key
        return example.env, example.example_id

    @property
    def enabled(self) -> bool:
        """Whether prompts are chosen by their pass history."""
        return self.kind == "pass_rate"


@dataclass
class PassHistory:
    """Each prompt's pass/fail of its newest `window` scored completions."""

    window: int
    recent: dict[Key, deque[bool]] = field(default_factory=dict)

    def add(self, key: Key, passed: bool) -> None:
        """Append one scored completion of `key` (the oldest falls out of a full window)."""
        self.recent.setdefault(key, deque(maxlen=self.window)).append(passed)

    def counts(self, key: Key) -> tuple[int, int]:
        """(passed, counted) over the prompt's window; (0, 0) for a prompt never scored."""
        window = self.recent.get(key, ())
        return sum(window), len(window)

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[str, str, float]], window: int, pass_reward: float,
                  key_of: Callable[[Key], Key] | None = None) -> PassHistory:
        """The history of (env, example_id, reward) rows in the order they were scored; `key_of`
        maps a prompt to its history key (its class), the prompt itself when None."""
        history = cls(window)
        for env, example_id, reward in rows:
            history.add(key_of((env, example_id)) if key_of else (env, example_id), passes(reward, pass_reward))
        return history


def resting(passed: int, counted: int, window: int, solved_rate: float = 1.0) -> str | None:
    """'solved' or 'hopeless' when a full window passed entirely or not at all (at least
    `solved_rate` of it, or at most 1 - `solved_rate`), else None."""
    if counted < window:
        return None
    if passed >= solved_rate * counted:
        return "solved"
    if passed <= (1 - solved_rate) * counted:
        return "hopeless"
    return None


def retest_draw(seed: int, step: int, attempt: int, key: Key) -> float:
    """A uniform number in [0, 1) fixed by the run's seed, the round and the prompt."""
    text = f"{seed}/{step}/{attempt}/{key[0]}/{key[1]}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") / 2**64


def decision_row(key: Key, status: str, state: str, passed: int, counted: int, options: CurriculumOptions, *,
                 attempt: int, forced: bool = False, rests_as: str | None = None) -> dict:
    """One `curriculum` row: a resting prompt (`key`: env, example_id) skipped or re-tested at a
    sampling round, and why; `rests_as` names its class when the history is kept per class."""
    assert status in STATUSES, status
    whose = f"the last {counted} completions of its class {rests_as!r}" if rests_as else f"its last {counted} completions"
    how = f"{passed} of {whose} passed (reward >= {options.pass_reward:g})"
    if forced:
        action = "sampled anyway: every prompt of the stream rests, and a round samples at least one"
    elif status == "skipped":
        action = f"skipped (re-tested with probability rl.curriculum.retest={options.retest:g})"
    else:
        action = f"re-tested (probability rl.curriculum.retest={options.retest:g})"
    return {"attempt": attempt, "env": key[0], "example_id": key[1], "status": status, "state": state,
            "passed": passed, "counted": counted, "reason": f"{state}: {how}; {action}"}


class Curriculum:
    """Chooses a round's prompts from the stream by their pass history (module docstring)."""

    def __init__(self, options: CurriculumOptions, history: PassHistory | None = None) -> None:
        self.options = options
        self.history = history if history is not None else PassHistory(options.window)
        self._keys: dict[Key, Key] = {}  # (env, example_id) of a chosen prompt -> its history key

    def choose(self, draw: Callable[[int], list[Example]], n: int, *, step: int,
               attempt: int) -> tuple[list[Example], list[dict]]:
        """Up to `n` prompts read one by one from `draw(1)` (the stream), resting ones skipped or
        re-tested; returns them and the `curriculum` rows of the resting prompts met. A round
        reads the stream at most once round: it stops at the first prompt it already met, so no
        prompt is sampled twice in a round; if it then has none, the first resting prompt it met
        is re-tested."""
        if not self.options.enabled:
            return draw(n), []
        chosen: list[Example] = []
        rows: list[dict] = []
        met: set[Key] = set()
        first_resting: tuple[Example, int] | None = None  # (prompt, index of its row)
        while len(chosen) < n:
            if self.options.reads and len(met) >= self.options.reads * n:
                break  # read its share of the stream
            example = draw(1)[0]
            key = (example.env, example.example_id)
            if key in met:  # the stream came round
                break
            met.add(key)
            history_key = self.options.key_of(example)
            rests_as = history_key[1] if history_key != key else None
            passed, counted = self.history.counts(history_key)
            state = resting(passed, counted, self.options.window, self.options.solved_rate)
            if state is None:
                chosen.append(example)
                continue
            retest = retest_draw(self.options.seed, step, attempt, key) < self.options.retest
            if retest:
                chosen.append(example)
            elif first_resting is None:
                first_resting = (example, len(rows))
            rows.append(decision_row(key, "retested" if retest else "skipped", state, passed, counted,
                                     self.options, attempt=attempt, rests_as=rests_as))
        if not chosen and first_resting is not None:
            example, index = first_resting
            chosen.append(example)
            row = rows[index]
            history_key = self.options.key_of(example)
            rows[index] = decision_row((row["env"], row["example_id"]), "retested", row["state"], row["passed"],
                                       row["counted"], self.options, attempt=attempt, forced=True,
                                       rests_as=history_key[1] if history_key[1] != example.example_id else None)
        self._keys.update({(e.env, e.example_id): self.options.key_of(e) for e in chosen})
        return chosen, rows

    def observe(self, rollouts: list[Rollout], scores: list[Score]) -> None:
        """Add a scored round to the history (completions whose reward raised are not counted)."""
        if not self.options.enabled:
            return
        for rollout, score in sorted(zip(rollouts, scores, strict=True), key=lambda pair: pair[0].sample_id):
            if score.error is None:
                key = (rollout.env, rollout.example_id)
                self.history.add(self._keys.get(key, key), passes(score.reward, self.options.pass_reward))
        for rollout in rollouts:
            self._keys.pop((rollout.env, rollout.example_id), None)


def curriculum_metrics(rows: list[dict]) -> dict[str, float]:
    """rollout/curriculum_skipped and rollout/curriculum_retested: the step's resting prompts."""
    from rlpipe.core import metric_names as m

    return {m.CURRICULUM_SKIPPED: float(sum(r["status"] == "skipped" for r in rows)),
            m.CURRICULUM_RETESTED: float(sum(r["status"] == "retested" for r in rows))}


def passes(reward: float, pass_reward: float) -> bool:
    """Whether a reward passes, compared as the `scores` table stores it (float32), so the live
    history and the one rebuilt from the tables agree."""
    return bool(np.float32(reward) >= np.float32(pass_reward))


HISTORY_SQL = """
SELECT r.env, r.example_id, CAST(s.reward AS DOUBLE) AS reward
FROM rollouts r JOIN scores s ON s.run_id = r.run_id AND s.sample_id = r.sample_id AND s.step = r.step
WHERE r.step <= {through_step} AND s.error IS NULL
ORDER BY r.step, r.attempt, r.sample_id
"""


def history_rows(run_dir: Path, *, through_step: int) -> list[tuple[str, str, float]]:
    """(env, example_id, reward) of every completion a run scored at steps <= `through_step`,
    in the order it scored them (step, round, then sample id: group, completion)."""
    from rlpipe.storage.catalog import has_data
    from rlpipe.storage.queries import run_sql

    if not (has_data([run_dir], "rollouts") and has_data([run_dir], "scores")):
        return []
    table = run_sql([run_dir], HISTORY_SQL.format(through_step=int(through_step)))
    return list(zip(*(table.column(name).to_pylist() for name in ("env", "example_id", "reward")), strict=True))


def class_keys(examples: Iterable[Example], wanted: set[Key], options: CurriculumOptions) -> dict[Key, Key]:
    """The history key of each prompt in `wanted` ((env, example_id) pairs), read from `examples`
    (the run's prompt pool, scanned until every wanted prompt is found): how a resumed run keyed
    by class maps its tables' prompts back to their classes."""
    found: dict[Key, Key] = {}
    for example in examples:
        if len(found) == len(wanted):
            break
        key = (example.env, example.example_id)
        if key in wanted:
            found[key] = options.key_of(example)
    return found
