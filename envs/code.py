"""Code: write a Python function from a spec; the reward is the share of hidden unit tests that
pass when the function runs in the sandbox (envs/sandbox.py).

    user:      Write a Python function f(x) that returns x plus 7.
    assistant: def f(x):
                   return x + 7
    reward = share of the task's hidden tests (5 by default) the function passes

The tasks are the built-in set of envs/code_tasks.py (a dozen specs with a parameter each). The
completion is the code itself, or the last ```python block of it (a chat model's habit); with a
thinking model the answer after `</think>` is what is judged.

With `tools = true` the episode is multi-turn: before answering, the model may call the
`run_python` tool in the hermes format (models/tool_calls.py; `rlpipe serve --tool-call-parser
hermes` serves it the same way):

    assistant: <tool_call>{"name": "run_python", "arguments": {"source": "print(3 + 7)"}}</tool_call>
    tool:      10                             ← stdout, stderr and the exit status, from the sandbox
    assistant: def f(x): ...                  ← a turn without a call is the answer, judged as above

The tool runs the model's code in the sandbox with the same limits as the tests; the hidden tests
are never shown. Turns beyond `max_turns` end the episode, its last turn judged as the answer.

How the tests are judged (the checker's contract): one sandboxed run per completion receives the
tests' arguments, never their expected values; it runs the code, calls `f` on each test's
arguments and reports what came back as one JSON record per test (`{"test": i, "value": v}`, or
`"raised"` with the exception's name). The expected values stay in rlpipe's process, which
compares each reported value with the expected one there (`judge_results`): the value must be
plain JSON (null, bool, int, float, str, list, dict with string keys) that parses strictly (no
NaN or Infinity, no int over 4,300 digits, no duplicate keys), of the expected type at every level
(`True` is not `1`, `3.0` is not `3`, a tuple is not a list), equal to it, and reported exactly
once. Nothing the sandbox prints or its exit status decides a test, and there is nothing secret in
the sandbox to find: code that reads its checker, forges result lines, patches builtins or `==`,
returns an object equal to everything, or exits early gains nothing, because the most it can
report is a value, and only the right value passes. A test that raises, a run that times out
before a test reports, or code that does not define `f`, fails those tests. A batch runs each distinct
(tests, code) pair once: a group's identical samples share one run's result. All of this holds
in the sandbox only: with `sandbox = "auto"` running unisolated, the code sees the host's files,
rlpipe's own included, and could draw the hidden tests again from their fixed seed. The components
other than `passed` (`defined`, `timed_out`) come from the sandbox's own report and are for
diagnosis only.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
from rlpipe.envs.code_results import (
    defined_reported,
    judge_results,
)
from rlpipe.envs.code_tasks import FAMILIES, FUNCTION, CodeTask, make_task
from rlpipe.envs.sandbox import SandboxLimits, SandboxResult, isolation_problem, run_python
from rlpipe.models.tool_calls import HermesParser

TOOL_NAME = "run_python"
PARSER = HermesParser()
# The tool in OpenAI's `tools` shape, for clients driving a served model.
TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "run a Python program in a sandbox; returns its stdout, stderr and exit code",
    "parameters": {"type": "object", "properties": {"source": {"type": "string"}}, "required": ["source"]}}}
SANDBOXES = ("bwrap", "auto")

# Runs in the sandbox: reads the function's name and the tests' arguments (one JSON line) and the
# solution from stdin, runs the solution with its prints sent to stderr, and reports each call's
# result as a JSON record on the saved stdout. It holds nothing secret: the expected values never
# leave rlpipe's process, so whatever the solution does to this harness it can only report values.
_HARNESS = """\
import json, os, sys
_report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
_calls = json.loads(sys.stdin.readline())
_source = sys.stdin.read()
_type, _str, _list, _dict, _float, _int, _bool = type, str, list, dict, float, int, bool

def _plain(value, depth=0):
    kind = _type(value)
    if depth > 100:
        raise ValueError("nested too deep")
    if value is None or kind is _bool or kind is _int or kind is _str:
        return value
    if kind is _float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("not a finite float")
        return value
    if kind is _list:
        return [_plain(item, depth + 1) for item in value]
    if kind is _dict and all(_type(key) is _str for key in value):
        return {key: _plain(item, depth + 1) for key, item in value.items()}
    raise TypeError(f"a {kind.__name__} is not a JSON value")

def _send(line):
    _report.write("\\n" + line + "\\n")
    _report.flush()

_namespace = {"__name__": "solution"}
try:
    exec(compile(_source, "solution.py", "exec"), _namespace)
    _fn = _namespace[_calls["function"]]
except BaseException as _error:
    _send(json.dumps({"error": _type(_error).__name__}))
    raise SystemExit(0)
_send(json.dumps({"defined": True}))
for _i, _args in enumerate(_calls["arguments"]):
    try:
        _line = json.dumps({"test": _i, "value": _plain(_fn(*_args))}, allow_nan=False)
    except BaseException as _error:
        _line = json.dumps({"test": _i, "raised": _type(_error).__name__})
    _send(_line)
"""

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class CodeConfig:
    """Options of the code environment (`task.options`)."""

    families: tuple[str, ...] = tuple(FAMILIES)
    """Spec families to draw from (envs/code_tasks.py); all by default."""
    tests_per_task: int = 5
    """Hidden unit tests per task."""
    tools: bool = False
    """Multi-turn: the model may call the `run_python` tool before answering."""
    max_turns: int = 3
    """With tools: assistant turns per episode (tool calls plus the answer)."""
    sandbox: str = "bwrap"
    """"bwrap": code runs only under bubblewrap, and the environment refuses to build where it
    cannot; "auto": bubblewrap where it runs, else unisolated (trusted code only)."""
    timeout_s: float = 5.0
    """Wall-clock seconds of one sandboxed run (the tests of a completion, or one tool call)."""
    memory_mb: int = 256
    """Address space of a sandboxed run."""
    cpu_s: int = 5
    """CPU seconds of a sandboxed run."""
    output_bytes: int = 65536
    """stdout + stderr read from a sandboxed run."""
    tool_output_chars: int = 1000
    """Characters of a tool call's output shown to the model (the end is kept)."""
    workers: int = 4
    """Completions judged at once (each in its own sandbox)."""
    instruction: str = ""
    """Text appended to every prompt, e.g. how to format the answer for a chat model."""
    teacher_error_rate: float = 0.3
    """SFT demonstrations only: the share that give the family's plausible wrong solution."""
    teacher_tool_rate: float = 0.5
    """SFT demonstrations with tools only: the share that call `run_python` before answering."""
    train_size: int = 100_000
    """Number of train examples (generated lazily)."""
    eval_size: int = 40
    """Number of held-out eval tasks (never in train)."""
    eval_seed: int = 1234
    """Seed of the eval split (fixed across runs)."""

    def __post_init__(self) -> None:
        families = (self.families,) if isinstance(self.families, str) else tuple(self.families)
        object.__setattr__(self, "families", families)
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown:
            raise ValueError(f"families: unknown {unknown or 'none given'}; known: {', '.join(FAMILIES)}")
        if self.sandbox not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {', '.join(SANDBOXES)}, got {self.sandbox!r}")
        for name in ("tests_per_task", "max_turns", "memory_mb", "cpu_s", "output_bytes", "tool_output_chars",
                     "workers", "train_size", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("teacher_error_rate", "teacher_tool_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def extract_code(text: str) -> str:
    """The code of a completion: its last ```python block, else the whole text."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def harness_input(arguments: Sequence[Sequence[Any]], code: str) -> str:
    """The harness's stdin: the function's name and each test's arguments as one JSON line, then
    the solution. The expected values are not in it."""
    calls = {"function": FUNCTION, "arguments": [list(a) for a in arguments]}
    return json.dumps(calls) + "\n" + code


def tool_reply(result: SandboxResult, max_chars: int) -> str:
    """What the model sees of a `run_python` call: output, then how the run ended."""
    if result.timed_out:
        status = "timed out"
    elif result.over_memory:
        status = "killed: over its memory limit"
    elif result.output_truncated:
        status = "output cut at the limit"
    else:
        status = f"exit code {result.exit_code}"
    text = result.stdout + (f"\n[stderr]\n{result.stderr}" if result.stderr else "")
    if len(text) > max_chars:
        text = "..." + text[-max_chars:]
    return f"{text.rstrip()}\n[{status}]".lstrip("\n")


def _answer_of(transcript: str | Messages) -> tuple[str, int]:
    """The code judged in a transcript (its last assistant turn's) and how many earlier turns called a tool."""
    if isinstance(transcript, str):
        return extract_code(transcript), 0
    assistant = [str(m.get("content", "")) for m in transcript if m.get("role") == "assistant"]
    calls = sum(bool(PARSER.parse(a).calls) for a in assistant[:-1])
    return extract_code(assistant[-1] if assistant else ""), calls


class CodeEnv:
    """Write a function from a spec, judged by hidden tests in the sandbox; see the module docstring."""

    name = "code"

    def __init__(self, config: CodeConfig | None = None) -> None:
        self.config = config or CodeConfig()
        if self.config.sandbox == "bwrap" and (problem := isolation_problem()) is not None:
            raise ValueError(f"task.options.sandbox = \"bwrap\": {problem}")
        self.max_turns = self.config.max_turns if self.config.tools else 1
        self.limits = SandboxLimits(cpu_s=self.config.cpu_s, output_bytes=self.config.output_bytes)
        self._eval = self._make_eval()
        self._eval_prompts = frozenset(e.prompt for e in self._eval)

    @classmethod
    def from_options(cls, **options: Any) -> CodeEnv:
        """Build from `task.options` (unknown names raise, naming them)."""
        return cls(options_to_config(CodeConfig, options, cls.name))

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        """Train: `train_size` tasks from `seed`, generated on access; eval: the fixed set."""
        if check_split(split) == "eval":
            return self._eval
        return LazyExamples(self.config.train_size, lambda i: self._make_train(seed, i))

    def reset(self, example: Example) -> Messages:
        """The spec as one user message (with tools: after a system message naming the tool)."""
        messages = prompt_messages(example)
        if not self.config.tools:
            return messages
        system = (f"You may call the tool {TOOL_NAME} to run Python code before answering: "
                  f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {{"source": "..."}}}}</tool_call>. '
                  "Answer with the function alone.")
        return [{"role": "system", "content": system}, *messages]

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult:
        """With tools, a turn's `run_python` call runs in the sandbox and its output comes back as a
        tool message; a turn without a call is the answer and ends the episode."""
        calls = PARSER.parse(completion_text).calls if self.config.tools else ()
        if not calls:
            return StepResult(messages_to_append=[], done=True)
        call = calls[0]
        if call.name != TOOL_NAME:
            reply = f"error: unknown tool {call.name!r}; the tool is {TOOL_NAME}"
        else:
            source = call.arguments.get("source", call.arguments.get("code"))
            if not isinstance(source, str):
                reply = 'error: run_python needs {"source": "<python code>"}'
            else:
                reply = tool_reply(self._run(source, ""), self.config.tool_output_chars)
        return StepResult(messages_to_append=[{"role": "tool", "content": reply}], done=False)

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        """The share of the hidden tests the answer's function passes (components: `passed`, the
        same share; `defined`, whether the run got to the tests; `timed_out`; `tool_calls`)."""
        return self.reward_batch([example], [transcript])[0]

    def reward_batch(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[RewardResult]:
        """`reward` of each pair, `workers` sandboxes at a time. The same code for the same tests
        (a group's identical samples) runs once and each copy gets that run's result."""
        answers = [_answer_of(t) for t in transcripts]
        keys = [(json.dumps(e.answer), code, calls) for e, (code, calls) in zip(examples, answers, strict=True)]
        first: dict[tuple, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            results = pool.map(self._judge, [examples[i] for i in first.values()], [answers[i] for i in first.values()])
            judged = dict(zip(first, results, strict=True))
        return [judged[key] for key in keys]

    def _judge(self, example: Example, answer: tuple[str, int]) -> RewardResult:
        code, calls = answer
        arguments = [list(args) for args, _ in example.answer]
        expected = [value for _, value in example.answer]
        result = self._run(_HARNESS, harness_input(arguments, code))
        passed = judge_results(result.stdout, expected)
        share = sum(passed) / len(expected)
        return RewardResult(share, {"passed": share, "defined": float(defined_reported(result.stdout)),
                                    "timed_out": float(result.timed_out), "tool_calls": float(calls)})

    def _run(self, source: str, stdin: str) -> SandboxResult:
        return run_python(source, timeout_s=self.config.timeout_s, memory_mb=self.config.memory_mb,
                          stdin=stdin, limits=self.limits, allow_unisolated=self.config.sandbox == "auto")

    def demonstration(self, example: Example, rng: random.Random) -> str:
        """SFT's answer: the reference solution, or with probability teacher_error_rate the
        family's plausible wrong one."""
        wrong = self.config.teacher_error_rate > 0 and rng.random() < self.config.teacher_error_rate
        return str(example.meta["wrong_solution" if wrong else "solution"])

    def demonstration_messages(self, example: Example, rng: random.Random) -> Messages:
        """With tools, a teacher's whole episode: (with probability teacher_tool_rate) a
        `run_python` call trying the solution on a test's arguments and the tool's reply (what the
        sandbox prints for it, computed here from the teacher's own code), then the answer.
        Without tools, the prompt and `demonstration`."""
        answer = self.demonstration(example, rng)
        messages = self.reset(example)
        if self.config.tools and rng.random() < self.config.teacher_tool_rate:
            args = example.answer[0][0]
            source = f"{answer}print({FUNCTION}(*{json.dumps(args)}))"
            call = json.dumps({"name": TOOL_NAME, "arguments": {"source": source}})
            namespace: dict[str, Any] = {}
            exec(answer, namespace)  # noqa: S102 - the teacher's own solution (envs/code_tasks.py), not a model's
            printed = SandboxResult(f"{namespace[FUNCTION](*args)}\n", "", 0, False)
            messages += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                         {"role": "tool", "content": tool_reply(printed, self.config.tool_output_chars)}]
        return messages + [{"role": "assistant", "content": answer}]

    def _prompt(self, spec: str) -> str:
        return f"{spec} {self.config.instruction}".strip()

    def _example(self, split: str, example_id: str, rng: random.Random) -> Example:
        family = FAMILIES[rng.choice(self.config.families)]
        task = make_task(family, rng.choice(family.params), rng, self.config.tests_per_task)
        return self.example_of(task, split, example_id)

    def example_of(self, task: CodeTask, split: str, example_id: str) -> Example:
        """The example of a task: its spec (and `instruction`) as the prompt, its hidden tests as
        the answer, the family and both teacher solutions in meta."""
        return Example(env=self.name, example_id=example_id, prompt=self._prompt(task.spec),
                       answer=[[list(a), e] for a, e in task.tests],
                       meta={"split": split, "family": task.family, "spec": task.spec,
                             "solution": task.solution, "wrong_solution": task.wrong_solution})

    def _make_eval(self) -> list[Example]:
        rng = random.Random(f"code/eval/{self.config.eval_seed}")
        out: list[Example] = []
        seen: set[str] = set()
        for _ in range(self.config.eval_size * 100):
            example = self._example("eval", f"eval/{len(out)}", rng)
            if example.prompt in seen:
                continue
            seen.add(str(example.prompt))
            out.append(example)
            if len(out) == self.config.eval_size:
                return out
        raise ValueError(f"could not draw {self.config.eval_size} distinct eval tasks from families "
                         f"{', '.join(self.config.families)}: lower eval_size")

    def _make_train(self, seed: int, index: int) -> Example:
        rng = random.Random(f"code/train/{seed}/{index}")
        for _ in range(1000):
            example = self._example("train", f"train/{seed}/{index}", rng)
            if example.prompt not in self._eval_prompts:
                return example
        raise ValueError(f"could not draw a code task outside the eval set (seed {seed}, index {index}): "
                         "lower eval_size or add families")
