"""`verifiers` (v1, PyPI `verifiers>=0.4`) tasksets as rlpipe environments: an optional extra.

    pip install -e '.[verifiers]'       # in the checkout
    [task]
    env = "verifiers"
    options = { taskset = "my_package.my_env:load_taskset", eval_size = 100 }

The adapter takes the data and the judging from verifiers and leaves generation to rlpipe: each
`vf.Task` becomes an `Example` (its system prompt and prompt as chat messages); rlpipe samples the
completion with its own engine (exact token ids and log-probs, envs/multiturn.py for episodes);
the transcript becomes a `vf.Trace` (prompt messages, then the sampled turns marked `sampled`)
and the task's own `@vf.reward` / `@vf.metric` functions and plugged judges score it offline
(`Task.score(trace)` without a runtime). Rewards land in `scores.components` by name (unweighted
scores; the reward is their weighted sum, `trace.reward`), metrics as `metric/<name>`.

Not covered: verifiers' harness programs, sandboxes and MCP tool servers (its agent side), which
run each episode as a program behind an interception proxy; rewards that need a runtime are
skipped by verifiers itself when scoring offline.

`taskset` names a callable or a `vf.Taskset` subclass as "module:attribute" (a class is built
with its default config). Tasks are read once (an infinite taskset is cut at `max_tasks`); the
last `eval_size` are the eval split, the rest train.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlpipe.core.user_code import import_user_object
from rlpipe.envs.base import (
    Example,
    Messages,
    RewardResult,
    Split,
    StepResult,
    check_split,
    options_to_config,
    prompt_messages,
)
from rlpipe.envs.rewards import format_traceback


@dataclass(frozen=True, kw_only=True)
class VerifiersConfig:
    """Options of the verifiers adapter (`task.options`)."""

    taskset: str
    """"module:attribute" of a vf.Taskset subclass, or of a callable returning a Taskset."""
    eval_size: int = 50
    """The last this-many tasks form the eval split."""
    max_tasks: int = 100_000
    """Tasks read from the taskset at most (bounds an infinite one)."""

    def __post_init__(self) -> None:
        if ":" not in self.taskset:
            raise ValueError(f"taskset must be 'module:attribute', got {self.taskset!r}")
        if self.eval_size < 1 or self.max_tasks <= self.eval_size:
            raise ValueError(f"need 1 <= eval_size < max_tasks, got {self.eval_size}, {self.max_tasks}")


def import_taskset(path: str) -> Any:
    """The Taskset named by "module:attribute" (a class is instantiated with its default config)."""
    import verifiers.v1 as vf

    target = import_user_object(path, "taskset")
    if isinstance(target, type) and issubclass(target, vf.Taskset):
        from verifiers.v1.utils.generic import concrete_type

        config_type = concrete_type(target, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return target(config_type())
    taskset = target() if callable(target) and not isinstance(target, vf.Taskset) else target
    if not isinstance(taskset, vf.Taskset):
        raise ValueError(f"{path!r} gave a {type(taskset).__name__}, not a verifiers Taskset")
    return taskset


def task_messages(task: Any) -> Messages:
    """A task's opening as rlpipe chat messages (system prompt first)."""
    from verifiers.v1.types import content_text

    data = task.data
    messages: Messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    for message in data.prompt or []:
        messages.append({"role": message.role, "content": content_text(message.content)})
    return messages


def _vf_message(message: dict[str, Any], index: int) -> Any:
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

    role, content = message.get("role"), str(message.get("content") or "")
    if role == "system":
        return SystemMessage(content=content)
    if role == "user":
        return UserMessage(content=content)
    if role == "assistant":
        return AssistantMessage(content=content)
    if role == "tool":
        return ToolMessage(tool_call_id=f"call_{index}", content=content)
    raise ValueError(f"message {index} has role {role!r}, which verifiers has no type for")


def build_trace(task: Any, transcript: Messages, n_prompt: int) -> Any:
    """A vf.Trace of the transcript: a chain of message nodes, the messages after the prompt's
    first `n_prompt` that the policy wrote marked `sampled`."""
    import verifiers.v1 as vf
    from verifiers.v1.trace import AgentInfo, TraceTask

    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=_vf_message(m, i),
                            sampled=i >= n_prompt and m.get("role") == "assistant")
             for i, m in enumerate(transcript)]
    return vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)


def _result(trace: Any) -> RewardResult:
    if any(r is None for r in trace.rewards.values()):
        missing = sorted(k for k, r in trace.rewards.items() if r is None)
        return RewardResult(0.0, {}, f"verifiers did not score {missing}")
    components = {name: float(r.score) for name, r in trace.rewards.items()}
    components |= {f"metric/{name}": float(v) for name, v in trace.metrics.items() if v is not None}
    return RewardResult(float(trace.reward), components)


def _run(coroutine) -> Any:
    """Run a coroutine to completion from sync code, also under an already running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class VerifiersEnv:
    """A verifiers taskset as a single-turn rlpipe environment (see the module docstring)."""

    name = "verifiers"

    def __init__(self, taskset: Any, eval_size: int = 50, max_tasks: int = 100_000) -> None:
        tasks = []
        for task in taskset:
            tasks.append(task)
            if len(tasks) >= max_tasks:
                break
        if len(tasks) <= eval_size:
            raise ValueError(f"the taskset has {len(tasks)} tasks: too few for eval_size={eval_size} "
                             "and a train split")
        self._examples = [self._example(i, task, "eval" if i >= len(tasks) - eval_size else "train")
                          for i, task in enumerate(tasks)]
        self._tasks = {e.example_id: t for e, t in zip(self._examples, tasks, strict=True)}
        self._n_eval = eval_size

    @classmethod
    def from_options(cls, **options: Any) -> VerifiersEnv:
        config = options_to_config(VerifiersConfig, options, cls.name)
        return cls(import_taskset(config.taskset), config.eval_size, config.max_tasks)

    def _example(self, index: int, task: Any, split: str) -> Example:
        example_id = str(task.data.id) if task.data.id is not None else f"task/{index}"
        return Example(self.name, example_id, task_messages(task), None, {"split": split, "task_key": task.key})

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        if check_split(split) == "eval":
            return self._examples[-self._n_eval:]
        return self._examples[: -self._n_eval]

    def reset(self, example: Example) -> Messages:
        return prompt_messages(example)

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult:
        return StepResult(messages_to_append=[], done=True)

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        return self.reward_batch([example], [transcript])[0]

    def reward_batch(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[RewardResult]:
        """Score a batch concurrently in one event loop (judges and async rewards overlap)."""
        jobs = []
        for example, transcript in zip(examples, transcripts, strict=True):
            opening = prompt_messages(example)
            messages = transcript if isinstance(transcript, list) else opening + [
                {"role": "assistant", "content": transcript}]
            task = self._tasks[example.example_id]
            jobs.append((task, build_trace(task, messages, len(opening))))

        async def score_all() -> list[Any]:
            return await asyncio.gather(*(task.score(trace) for task, trace in jobs), return_exceptions=True)

        outcomes = _run(score_all())
        return [RewardResult(0.0, {}, format_traceback(out)) if isinstance(out, BaseException) else _result(trace)
                for (_task, trace), out in zip(jobs, outcomes, strict=True)]
