"""The verifiers adapter: a vf.Taskset (tests/verifiers_tasks.py, no hub download) becomes an
rlpipe environment; completions sampled by rlpipe are judged by the task's own @vf.reward
functions."""

from __future__ import annotations

import pytest
from rlpipe.engines.base import SamplingParams
from rlpipe.envs.multiturn import run_episodes
from rlpipe.envs.registry import build_env
from rlpipe.envs.verifiers_env import VerifiersEnv
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts

from tests.rollout_rows import rollout
from tests.scripted_engine import ScriptedEngine


@pytest.fixture
def vf():
    """verifiers.v1 (the optional extra; the tests skip where it is absent), imported when a test
    of this module runs rather than when the session collects it."""
    return pytest.importorskip("verifiers.v1", reason="the optional `verifiers` extra is not installed")


@pytest.fixture
def tasks(vf):
    import tests.verifiers_tasks

    return tests.verifiers_tasks


def test_taskset_becomes_examples_and_rewards(tasks):
    env = build_env("verifiers", taskset="tests.verifiers_tasks:AddTaskset", eval_size=4)
    train, evals = env.examples("train"), env.examples("eval")
    assert [e.example_id for e in evals] == ["add8", "add9", "add10", "add11"] and len(train) == 8
    assert env.reset(train[3]) == [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+3="}]
    right = env.reward(train[3], "6")
    assert right.reward == pytest.approx(1.1) and right.error is None
    assert right.components == {"correct": 1.0, "short": 1.0, "metric/turns": 1.0}
    assert env.reward(train[3], "seven").reward == 0.0


def test_score_stage_batches_sampled_completions_through_the_tasks(vf, tasks):
    env = VerifiersEnv(tasks.AddTaskset(vf.TasksetConfig()), eval_size=2)
    from rlpipe.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answers = iter(["0", "2", "5", "6"])

    def play(prompt):
        return [tok.convert_tokens_to_ids(c) for c in next(answers)] + [end]

    examples = list(env.examples("train"))[:4]
    groups = run_episodes(ScriptedEngine(play, end), tok, env, examples, SamplingParams(), max_turns=1,
                          max_tokens=256)
    rollouts = [rollout(sample_id=f"s{i}", example_id=e.example.example_id,
                        completion_text=tok.decode(e.completion_tokens, skip_special_tokens=True))
                for i, (e,) in enumerate(groups)]
    rows = score_rollouts(env, {e.example_id: e for e in examples}, rollouts, ScoreOptions(max_error_fraction=0.0))
    assert [r.components["correct"] for r in rows] == [1.0, 1.0, 0.0, 1.0]


def test_a_raising_reward_is_recorded_not_raised(vf, tasks):
    class Broken(tasks.AddTask):
        @vf.reward
        async def correct(self, task, trace) -> float:
            raise RuntimeError("grader crashed")

    class BrokenSet(vf.Taskset[Broken]):
        def load(self):
            for i in range(3):
                yield Broken(tasks.AddData(prompt="1+1=", answer=2, id=f"b{i}"))

    env = VerifiersEnv(BrokenSet(vf.TasksetConfig()), eval_size=1)
    result = env.reward(env.examples("train")[0], "2")
    assert result.reward == 0.0 and "grader crashed" in result.error


def test_bad_options_name_the_problem(vf, tasks):
    with pytest.raises(ValueError, match="module:attribute"):
        build_env("verifiers", taskset="nothing")
    with pytest.raises(ValueError, match="taskset .*: cannot import module"):
        build_env("verifiers", taskset="no_such_module:X")
    with pytest.raises(ValueError, match="too few"):
        VerifiersEnv(tasks.AddTaskset(vf.TasksetConfig()), eval_size=12)
