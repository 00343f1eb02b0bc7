"""A deadline on reward calls (`task.reward_timeout_s`), so a user reward that hangs cannot
stall a run forever.

    env = with_reward_timeout(env, 5.0)     # env.reward(...) now returns within ~5 s

A call over the deadline returns reward 0 with an `error` saying so: the scores table records it
like a reward that raised, and it counts in the share that fails a step
(`rl.scoring.max_reward_error_fraction`). Python cannot kill a thread: the overrunning call is left on
its daemon thread (it dies with the process) and later calls go on without it.
"""

from __future__ import annotations

import threading
from typing import Any

from rlpipe.envs.base import Environment, Example, Messages, RewardResult


def call_with_timeout(fn: Any, args: tuple, timeout_s: float) -> tuple[bool, Any]:
    """(True, fn(*args)) if it returned in time, (False, None) if not; its exception re-raised."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="rlpipe-reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return False, None
    if "error" in outcome:
        raise outcome["error"]
    return True, outcome["value"]


class TimedRewardEnv:
    """An environment whose `reward` answers within `timeout_s`; everything else is delegated."""

    def __init__(self, env: Environment, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout_s}")
        self.inner = env
        self.timeout_s = timeout_s

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        finished, result = call_with_timeout(self.inner.reward, (example, transcript), self.timeout_s)
        if finished:
            return result
        return RewardResult(0.0, {}, f"RewardTimeout: the reward of example {example.example_id!r} took longer "
                                     f"than task.reward_timeout_s={self.timeout_s:g}s and was abandoned")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def with_reward_timeout(env: Environment, timeout_s: float) -> Environment:
    """`env` with a deadline on reward calls; `env` itself when timeout_s is 0 (no limit)."""
    return TimedRewardEnv(env, timeout_s) if timeout_s else env  # type: ignore[return-value]
