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

How the tests are judged: one sandboxed run per completion executes the code, then calls `f` on
each test's arguments and prints, after a per-run random nonce, whether the result equals the
expected value (same type, equal value). A test that raises, a run that times out before a test
reports, or code that does not define `f`, fails those tests. The nonce stops a solution from
passing by printing lines that look like results; the code runs in the same interpreter as the
checks, so this is a verifier for honest mistakes and ordinary reward hacking, not for code that
inspects its checker.
"""

from __future__ import annotations

import json
import random
import re
import secrets
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

# Runs in the sandbox: reads the tests and the solution from stdin, defines the solution, reports
# each test after the nonce. Nothing of it is secret but the nonce, which arrives on stdin.
_HARNESS = """\
import json, sys
_spec = json.loads(sys.stdin.readline())
_source = sys.stdin.read()
_nonce, _write, _flush = _spec["nonce"], sys.stdout.write, sys.stdout.flush
_namespace = {"__name__": "solution"}
try:
    exec(compile(_source, "solution.py", "exec"), _namespace)
    _fn = _namespace[_spec["function"]]
except BaseException as _error:
    _write(f"\\n{_nonce} error {type(_error).__name__}\\n")
    _flush()
    raise SystemExit(0)
for _i, (_args, _expected) in enumerate(_spec["tests"]):
    try:
        _got = _fn(*_args)
        _ok = type(_got) is type(_expected) and _got == _expected
    except BaseException:
        _ok = False
    _write(f"\\n{_nonce} {_i} {int(_ok)}\\n")
    _flush()
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


def harness_input(nonce: str, tests: Sequence[tuple[list, Any]], code: str) -> str:
    """The harness's stdin: the tests as one JSON line, then the solution."""
    spec = {"nonce": nonce, "function": FUNCTION, "tests": [[list(a), e] for a, e in tests]}
    return json.dumps(spec) + "\n" + code


def passed_tests(stdout: str, nonce: str, n_tests: int) -> list[bool]:
    """Per test, whether the harness reported it passed (unreported: failed)."""
    passed = [False] * n_tests
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and int(parts[1]) < n_tests:
            passed[int(parts[1])] = parts[2] == "1"
    return passed


def tool_reply(result: SandboxResult, max_chars: int) -> str:
    """What the model sees of a `run_python` call: output, then how the run ended."""
    if result.timed_out:
        status = "timed out"
    elif result.output_truncated:
        status = "output cut at the limit"
    else:
        status = f"exit code {result.exit_code}"
    text = result.stdout + (f"\n[stderr]\n{result.stderr}" if result.stderr else "")
    if len(text) > max_chars:
        text = "..." + text[-max_chars:]
    return f"{text.rstrip()}\n[{status}]".lstrip("\n")


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
        """`reward` of each pair, `workers` sandboxes at a time."""
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            return list(pool.map(self._judge, examples, transcripts))

    def _judge(self, example: Example, transcript: str | Messages) -> RewardResult:
        if isinstance(transcript, str):
            answer, calls = transcript, 0
        else:
            assistant = [str(m.get("content", "")) for m in transcript if m.get("role") == "assistant"]
            answer = assistant[-1] if assistant else ""
            calls = sum(bool(PARSER.parse(a).calls) for a in assistant[:-1])
        tests = [(list(args), expected) for args, expected in example.answer]
        nonce = secrets.token_hex(16)
        result = self._run(_HARNESS, harness_input(nonce, tests, extract_code(answer)))
        passed = passed_tests(result.stdout, nonce, len(tests))
        share = sum(passed) / len(tests)
        defined = float(any(line.startswith(f"{nonce} ") and " error " not in line
                            for line in result.stdout.splitlines()))
        return RewardResult(share, {"passed": share, "defined": defined, "timed_out": float(result.timed_out),
                                    "tool_calls": float(calls)})

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
