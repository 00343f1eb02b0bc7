"""Arithmetic: `12+345=` → `357`, generated deterministically, verified exactly.

Prompts are short on purpose (one user message such as "12+345="): the demo trains a tiny model
with a character-level tokenizer on a CPU. The completion is the answer — an optional minus sign,
then digits — and nothing else (the engine stops at the end-of-sequence token).

Difficulty: each operand draws its digit count uniformly from [min_digits, max_digits] (so a
3-digit task still contains easy 1-digit problems, a built-in curriculum mix), the operand count
from [min_operands, max_operands], and operators from `operators` (any of "+-*", usual precedence).
`level` is a single knob: when set, `max_digits = level`.

`reverse_digits`: the answer is written least-significant digit first ("12+345=" → "753", and
-123 → "-321"). A left-to-right model must otherwise emit the most significant digit before it
has "seen" the carries that decide it; reversed, each digit depends only on digits already
written, which makes multi-digit addition learnable by tiny transformers. `reverse_operands`
(with `pad_operands`) writes the operands the same way ("007+543=" shown as "700+345="), so
answer digit i sits at a fixed distance from the operand digits it depends on.

`teacher_carry_error` makes the SFT demonstrations imperfect: that share of them comes from a
teacher who forgets every carry. SFT then imitates a mixture; RL with the exact verifier learns
which of its own answers are right. This is the demo's setting (configs/demo.toml).

Examples come from (seed, index) through a string-seeded RNG, so `examples("train", seed)[i]` is
the same problem on every machine and run. The eval split is fixed by `eval_seed` (not by the
run's seed, so evals are comparable across runs) and train never contains an eval problem.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlpipe.envs.base import Example, LazyExamples, Split, check_split, options_to_config
from rlpipe.envs.expr import evaluate
from rlpipe.envs.rewards import format_integer, format_then_correct
from rlpipe.envs.single_turn import SingleTurnEnv

ALPHABET = "0123456789+-*="
"""Every character of an arithmetic prompt or completion."""


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """Options of the arithmetic environment (`task.options` in a config)."""

    min_digits: int = 1
    """Fewest digits of an operand."""
    max_digits: int = 3
    """Most digits of an operand (overridden by `level` when set)."""
    operators: str = "+"
    """Operators to draw from: any of '+', '-', '*' (a string like "+-" or a list)."""
    min_operands: int = 2
    """Fewest operands per problem."""
    max_operands: int = 2
    """Most operands per problem."""
    level: int | None = None
    """Difficulty knob: when set, max_digits = level (and min_digits is capped at it)."""
    allow_negative: bool = True
    """Allow negative answers (with '-'); False redraws problems whose answer is below 0."""
    reverse_digits: bool = False
    """Write the answer least-significant digit first (see module docstring)."""
    pad_operands: bool = False
    """Zero-pad every operand in the prompt to max_digits ("7+45=" → "07+45=")."""
    reverse_operands: bool = False
    """Write the prompt's operands least-significant digit first too (see module docstring)."""
    teacher_carry_error: float = 0.0
    """SFT demonstrations only: the share of demonstrations from a teacher that forgets every
    carry (2-operand addition). RL's verifier always checks the true answer."""
    train_size: int = 100_000
    """Number of train examples (generated lazily)."""
    eval_size: int = 500
    """Number of held-out eval examples (distinct problems, never in train)."""
    eval_seed: int = 1234
    """Seed of the eval split (fixed across runs)."""

    def __post_init__(self) -> None:
        ops = self.operators if isinstance(self.operators, str) else "".join(self.operators)
        ops = "".join(dict.fromkeys(ops))  # dedupe, keep order
        object.__setattr__(self, "operators", ops)
        if not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {ops!r}")
        if self.level is not None:
            if self.level < 1:
                raise ValueError(f"level must be >= 1, got {self.level}")
            object.__setattr__(self, "max_digits", self.level)
            object.__setattr__(self, "min_digits", min(self.min_digits, self.level))
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got min_digits={self.min_digits}, "
                f"max_digits={self.max_digits}"
            )
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands, got min_operands={self.min_operands}, "
                f"max_operands={self.max_operands}"
            )
        if not 0.0 <= self.teacher_carry_error <= 1.0:
            raise ValueError(f"teacher_carry_error must be in [0, 1], got {self.teacher_carry_error}")
        if self.train_size < 1 or self.eval_size < 1:
            raise ValueError(
                f"train_size and eval_size must be >= 1, got {self.train_size}, {self.eval_size}"
            )
        if self.eval_size * 4 > problem_space_size(self):
            raise ValueError(
                f"eval_size={self.eval_size} is too large for {problem_space_size(self)} possible "
                "problems (at most a quarter may be held out): raise max_digits or lower eval_size"
            )


def problem_space_size(cfg: ArithmeticConfig) -> int:
    """How many distinct prompts the config can produce (ignoring allow_negative)."""
    numbers = 10**cfg.max_digits - (10 ** (cfg.min_digits - 1) if cfg.min_digits > 1 else 0)
    ops = len(cfg.operators)
    return sum(numbers**k * ops ** (k - 1) for k in range(cfg.min_operands, cfg.max_operands + 1))


def format_answer(value: int, reverse_digits: bool) -> str:
    """The expected completion text for `value` ('-' first, then the digits, maybe reversed)."""
    digits = str(abs(value))
    if reverse_digits:
        digits = digits[::-1]
    return ("-" if value < 0 else "") + digits


def parse_answer(text: str, reverse_digits: bool) -> int:
    """Inverse of format_answer (ValueError when text is not '-?digits')."""
    text = text.strip()
    if not format_integer(text):
        raise ValueError(f"not an answer: {text[:40]!r}")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("-")
    return sign * int(digits[::-1] if reverse_digits else digits)


def _draw_operand(rng: random.Random, cfg: ArithmeticConfig) -> int:
    d = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if d == 1 else 10 ** (d - 1)
    return rng.randint(low, 10**d - 1)


def _show_operand(value: int, cfg: ArithmeticConfig) -> str:
    text = f"{value:0{cfg.max_digits}d}" if cfg.pad_operands else str(value)
    return text[::-1] if cfg.reverse_operands else text


def _draw_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, int, list[int]]:
    """(prompt expression without '=', value, the operands)."""
    k = rng.randint(cfg.min_operands, cfg.max_operands)
    operands = [_draw_operand(rng, cfg) for _ in range(k)]
    ops = [rng.choice(cfg.operators) for _ in range(k - 1)]
    expr = str(operands[0]) + "".join(o + str(x) for o, x in zip(ops, operands[1:], strict=True))
    value = evaluate(expr, operators="+-*")
    assert value.value.denominator == 1
    shown = _show_operand(operands[0], cfg) + "".join(
        o + _show_operand(x, cfg) for o, x in zip(ops, operands[1:], strict=True))
    return shown, int(value.value), operands


def carries(operands: Sequence[int]) -> int:
    """How many columns of the schoolbook sum of `operands` (all >= 0) carry into the next one."""
    count, carry, place = 0, 0, 1
    while any(x // place for x in operands) or carry:
        carry = (sum(x // place % 10 for x in operands) + carry) // 10
        count += carry > 0
        place *= 10
    return count


def problem_class(operands: Sequence[int], ops: str) -> str:
    """The class of a problem for a curriculum (Example.curriculum_key): its operators, each
    operand's digit count and, for a sum, how many carries it takes, e.g. "+ 3x2 digits, 1 carries"
    (what makes a problem hard here: the demo's SFT teacher forgets every carry)."""
    shape = f"{ops} {'x'.join(str(len(str(x))) for x in operands)} digits"
    return f"{shape}, {carries(operands)} carries" if set(ops) == {"+"} else shape


def carry_blind_sum(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry forgotten (a classic pupil's mistake)."""
    total, place = 0, 1
    while a or b:
        total += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return total


class ArithmeticEnv(SingleTurnEnv):
    """Single-turn arithmetic; reward = format (an integer) then exact correctness."""

    name = "arithmetic"
    alphabet = ALPHABET

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config = config or ArithmeticConfig()
        self._eval = self._make_eval()
        self._eval_prompts = frozenset(ex.prompt for ex in self._eval)
        self._reward = format_then_correct(format_integer, self._correct)

    @classmethod
    def from_options(cls, **options: Any) -> ArithmeticEnv:
        return cls(options_to_config(ArithmeticConfig, options, cls.name))

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        """Train: `train_size` examples from `seed`, generated on access; eval: the fixed set."""
        if check_split(split) == "eval":
            return self._eval
        return LazyExamples(self.config.train_size, lambda i: self._make_train(seed, i))

    def score(self, example: Example, completion_text: str) -> tuple[float, dict[str, float]]:
        return self._reward(completion_text, example.answer, example)

    def demonstration(self, example: Example, rng: random.Random) -> str:
        """SFT's assistant text: the target, or — with probability teacher_carry_error — the
        answer of a teacher who forgets every carry (an imperfect demonstrator for RL to fix)."""
        operands = example.meta.get("operands", [])
        if (self.config.teacher_carry_error > 0 and len(operands) == 2 and "+" in example.prompt
                and rng.random() < self.config.teacher_carry_error):
            return format_answer(carry_blind_sum(*operands), self.config.reverse_digits)
        return str(example.meta["target_text"])

    def answer_key(self, example: Example, text: str) -> str | None:
        """The integer a completion states, as text (maj@k of sampled evals votes on it); None
        when it states none."""
        try:
            return str(parse_answer(text, self.config.reverse_digits))
        except ValueError:
            return None

    def _correct(self, text: str, answer: Any, example: Example) -> float:
        return float(text.strip() == format_answer(int(answer), self.config.reverse_digits))

    def _example(
        self, split: str, example_id: str, expr: str, value: int, operands: list[int]
    ) -> Example:
        return Example(
            env=self.name,
            example_id=example_id,
            prompt=expr + "=",
            answer=value,
            curriculum_key=problem_class(operands, "".join(c for c in expr if c in "+-*")),
            meta={
                "split": split,
                "digits": [len(str(x)) for x in operands],
                "operands": operands,
                "n_operands": len(operands),
                "target_text": format_answer(value, self.config.reverse_digits),
            },
        )

    def _acceptable(self, value: int) -> bool:
        return self.config.allow_negative or value >= 0

    def _make_eval(self) -> list[Example]:
        cfg = self.config
        rng = random.Random(f"arithmetic/eval/{cfg.eval_seed}")
        seen: set[str] = set()
        out: list[Example] = []
        for _ in range(cfg.eval_size * 100):
            expr, value, operands = _draw_problem(rng, cfg)
            if expr in seen or not self._acceptable(value):
                continue
            seen.add(expr)
            out.append(self._example("eval", f"eval/{len(out)}", expr, value, operands))
            if len(out) == cfg.eval_size:
                return out
        raise ValueError(
            f"could not draw {cfg.eval_size} distinct eval problems from this config: "
            "lower eval_size or widen digits/operators"
        )

    def _make_train(self, seed: int, index: int) -> Example:
        rng = random.Random(f"arithmetic/train/{seed}/{index}")
        for _ in range(1000):
            expr, value, operands = _draw_problem(rng, self.config)
            if self._acceptable(value) and expr + "=" not in self._eval_prompts:
                return self._example("train", f"train/{seed}/{index}", expr, value, operands)
        raise ValueError(
            f"could not draw a train problem outside the eval set (seed {seed}, index {index})"
        )


def config_at_level(config: ArithmeticConfig, level: int) -> ArithmeticConfig:
    """The same config at another difficulty level (a curriculum steps through levels)."""
    return replace(config, level=level)
