"""Tool use: multiplication with a calculator tool, over several turns.

    user:      37*48
    assistant: calc 37*48            ← a tool call (the turn starts with "calc ")
    tool:      1776                  ← the environment runs it (envs/expr.py, never `eval`)
    assistant: ans 1776              ← the final answer ends the episode
    reward = 1 when the final answer equals the product, else 0

A tiny model cannot multiply two-digit numbers in its head, but it can learn to call the
calculator and copy its result. The SFT teacher is imperfect in the way that matters here: only
`teacher_tool_rate` of its demonstrations call the tool; the rest answer directly (correctly — the
teacher can multiply — but the student cannot imitate that). After SFT the student mostly answers
directly and is mostly wrong; multi-turn RL, rewarded on the final answer only, learns to call the
tool. The prompt is the bare expression so that a character-level tokenizer keeps episodes short.

Turns beyond `max_turns` (tool calls that never end in an answer) end the episode with reward 0.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlpipe.envs.base import (
    Example,
    LazyExamples,
    Messages,
    RewardResult,
    Split,
    StepResult,
    check_split,
    options_to_config,
    prompt_messages,
)
from rlpipe.envs.expr import ExpressionError, evaluate
from rlpipe.models.tool_calls import CALC_PREFIX, CALC_TOOL, CalculatorParser

CALL, ANSWER = f"{CALC_PREFIX} ", "ans "
# The parser `rlpipe serve --tool-call-parser calculator` uses: a turn is a tool call exactly
# when the environment runs one, so a model trained here is served with its tool working.
PARSER = CalculatorParser()
# The tool in OpenAI's `tools` shape, for clients driving a served model.
TOOL = {"type": "function", "function": {
    "name": CALC_TOOL, "description": "evaluate an integer expression with + - *",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


@dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    """Options of the calculator tool-use environment (`task.options`)."""

    min_digits: int = 2
    """Fewest digits of an operand."""
    max_digits: int = 2
    """Most digits of an operand."""
    operators: str = "*"
    """Operators to draw from (any of '+', '-', '*')."""
    max_turns: int = 3
    """Assistant turns per episode (tool calls plus the final answer)."""
    context: str = "tokens"
    """How each turn's context is built: "tokens" (the stream so far) or "template" (the chat
    template's rendering of the conversation; envs/multiturn.py)."""
    teacher_tool_rate: float = 0.3
    """SFT demonstrations only: the share that call the calculator; the rest answer directly."""
    train_size: int = 100_000
    """Number of train examples (generated lazily)."""
    eval_size: int = 200
    """Number of held-out eval examples (never in train)."""
    eval_seed: int = 1234
    """Seed of the eval split (fixed across runs)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not self.operators or any(o not in "+-*" for o in self.operators):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {self.operators!r}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.context not in ("tokens", "template"):
            raise ValueError(f"context must be 'tokens' or 'template', got {self.context!r}")
        if not 0.0 <= self.teacher_tool_rate <= 1.0:
            raise ValueError(f"teacher_tool_rate must be in [0, 1], got {self.teacher_tool_rate}")
        if self.train_size < 1 or self.eval_size < 1:
            raise ValueError(f"train_size and eval_size must be >= 1, got {self.train_size}, {self.eval_size}")


def run_tool(call_text: str) -> str:
    """The calculator's reply to a call's expression: the integer result, or 'error'."""
    try:
        value = evaluate(call_text.strip(), operators="+-*", max_len=32).value
    except ExpressionError:
        return "error"
    return str(value.numerator) if value.denominator == 1 else "error"


class CalculatorEnv:
    """Multi-turn tool use; see the module docstring."""

    name = "calculator"
    alphabet = "0123456789+-*calns "

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        self.config = config or CalculatorConfig()
        self.max_turns = self.config.max_turns
        self.rollout_context = self.config.context
        self._eval = self._make_eval()
        self._eval_prompts = frozenset(e.prompt for e in self._eval)

    @classmethod
    def from_options(cls, **options: Any) -> CalculatorEnv:
        return cls(options_to_config(CalculatorConfig, options, cls.name))

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        if check_split(split) == "eval":
            return self._eval
        return LazyExamples(self.config.train_size, lambda i: self._make_train(seed, i))

    def reset(self, example: Example) -> Messages:
        return prompt_messages(example)

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult:
        calls = PARSER.parse(completion_text).calls
        if calls:
            reply = run_tool(calls[0].arguments["expression"])
            return StepResult(messages_to_append=[{"role": "tool", "content": reply}], done=False)
        return StepResult(messages_to_append=[], done=True)

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        messages = transcript if isinstance(transcript, list) else [
            {"role": "assistant", "content": transcript}]
        assistant = [str(m.get("content", "")).strip() for m in messages if m.get("role") == "assistant"]
        calls = sum(bool(PARSER.parse(a).calls) for a in assistant)
        final = assistant[-1] if assistant else ""
        answered = final.startswith(ANSWER.strip())
        correct = answered and final[len(ANSWER.strip()):].strip() == str(example.answer)
        components = {"correct": float(correct), "answered": float(answered), "tool_calls": float(calls)}
        return RewardResult(float(correct), components)

    def demonstration_messages(self, example: Example, rng: random.Random) -> Messages:
        """A teacher's whole episode: a tool call, the tool's reply and the answer, or (with
        probability 1 - teacher_tool_rate) the answer alone."""
        answer = [{"role": "assistant", "content": f"{ANSWER}{example.answer}"}]
        if rng.random() >= self.config.teacher_tool_rate:
            return self.reset(example) + answer
        expr = str(example.prompt)
        return self.reset(example) + [{"role": "assistant", "content": f"{CALL}{expr}"},
                                      {"role": "tool", "content": run_tool(expr)}] + answer

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        cfg = self.config

        def operand() -> int:
            d = rng.randint(cfg.min_digits, cfg.max_digits)
            return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

        expr = f"{operand()}{rng.choice(cfg.operators)}{operand()}"
        return expr, int(evaluate(expr, operators="+-*").value)

    def _example(self, split: str, example_id: str, expr: str, value: int) -> Example:
        return Example(env=self.name, example_id=example_id, prompt=expr, answer=value,
                       meta={"split": split})

    def _make_eval(self) -> list[Example]:
        rng = random.Random(f"calculator/eval/{self.config.eval_seed}")
        seen: dict[str, int] = {}
        for _ in range(self.config.eval_size * 100):
            expr, value = self._draw(rng)
            seen.setdefault(expr, value)
            if len(seen) == self.config.eval_size:
                return [self._example("eval", f"eval/{i}", e, v) for i, (e, v) in enumerate(seen.items())]
        raise ValueError(f"could not draw {self.config.eval_size} distinct eval problems: "
                         "lower eval_size or widen digits/operators")

    def _make_train(self, seed: int, index: int) -> Example:
        rng = random.Random(f"calculator/train/{seed}/{index}")
        for _ in range(1000):
            expr, value = self._draw(rng)
            if expr not in self._eval_prompts:
                return self._example("train", f"train/{seed}/{index}", expr, value)
        raise ValueError(f"could not draw a train problem outside the eval set (seed {seed}, index {index})")
