"""A verifiers Taskset defined here (no hub download) for tests/unit/test_verifiers_env.py, in a
module of its own so that only the test process that runs those tests imports verifiers (about 3
CPU seconds)."""

from __future__ import annotations

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: int


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def correct(self, task: AddData, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(task.answer))

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 2)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class AddTaskset(vf.Taskset[AddTask]):
    def load(self):
        for i in range(12):
            yield AddTask(AddData(prompt=f"{i}+{i}=", system_prompt="Add.", answer=2 * i, id=f"add{i}"))
