"""The code environment (envs/code.py): specs judged by hidden unit tests run in the sandbox, the
built-in task set, the `run_python` tool of the multi-turn variant."""

from __future__ import annotations

import json
import random

import pytest
from rlpipe.engines.base import SamplingParams
from rlpipe.envs import sandbox
from rlpipe.envs.code import CodeConfig, CodeEnv, extract_code
from rlpipe.envs.code_results import judge_results
from rlpipe.envs.code_tasks import FAMILIES, make_task
from rlpipe.envs.multiturn import episode_reward, run_episodes
from rlpipe.envs.registry import build_env
from rlpipe.models.tokenizer import build_tokenizer

from tests.scripted_engine import ScriptedEngine

PROBLEM = sandbox.isolation_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return CodeEnv(CodeConfig(eval_size=24, timeout_s=2.0))


def test_the_task_set_has_a_dozen_families_whose_references_pass_and_wrong_solutions_do_not(env):
    assert len(FAMILIES) == 12
    rng = random.Random(0)
    tasks = [make_task(family, family.params[-1], rng) for family in FAMILIES.values()]
    examples = [env.example_of(task, "eval", task.family) for task in tasks]
    references = env.reward_batch(examples, [e.meta["solution"] for e in examples])
    wrong = env.reward_batch(examples, [e.meta["wrong_solution"] for e in examples])
    assert [r.reward for r in references] == [1.0] * len(examples)
    assert all(r.components["defined"] == 1.0 for r in references)
    assert sum(r.reward for r in wrong) < 0.5 * len(examples)  # the teacher's mistakes fail most tests
    assert {e.meta["family"] for e in examples} == set(FAMILIES)


def test_the_reward_is_the_share_of_hidden_tests_passed(env):
    example = next(e for e in env.examples("train", seed=0) if e.meta["family"] == "smaller")
    param = example.meta["solution"].split(", ")[1].rstrip(")\n")
    args = [args[0] for args, _ in example.answer]
    below = sum(x < int(param) for x in args)
    # a solution right only for inputs below the parameter: exactly those tests pass
    partial = f"def f(x):\n    return x if x < {param} else None\n"
    result = env.reward(example, partial)
    assert result.reward == pytest.approx(below / len(args))
    assert result.components["passed"] == result.reward


def test_hostile_and_broken_answers_score_zero(env):
    example = env.examples("eval")[0]
    n = len(example.answer)
    fake_lines = "\n".join(f"{i} 1" for i in range(n))
    answers = {
        "loop": "def f(*a):\n    while True:\n        pass\n",
        "forges results": f"print('''{fake_lines}''')\nimport sys\nsys.exit(0)\n",
        "no f": "def g(x):\n    return x\n",
        "syntax": "def f(x) return x",
        "exits": "import os\nos._exit(0)\n",
        "reads the tests": "import sys\nprint(sys.stdin.read())\ndef f(*a):\n    return None\n",
    }
    results = dict(zip(answers, env.reward_batch([example] * len(answers), list(answers.values())), strict=True))
    assert {name: r.reward for name, r in results.items()} == dict.fromkeys(answers, 0.0)
    assert results["loop"].components["timed_out"] == 1.0
    assert results["no f"].components["defined"] == 0.0 and results["syntax"].components["defined"] == 0.0


def test_a_fenced_answer_is_judged_by_its_last_python_block(env):
    example = env.examples("eval")[1]
    text = f"Here it is:\n```python\ndef f(*a):\n    return None\n```\nBetter:\n```python\n{example.meta['solution']}```\n"
    assert extract_code(text) == example.meta["solution"]
    assert env.reward(example, text).reward == 1.0
    assert judge_results('{"test": 1, "value": 2}\n{"test": 7, "value": 1}\nabc 0 1', [1, 2]) == [False, True]


def test_splits_are_fixed_disjoint_and_options_are_checked():
    env = CodeEnv(CodeConfig(eval_size=24))
    again = build_env("code", eval_size=24)
    assert [e.prompt for e in env.examples("eval")] == [e.prompt for e in again.examples("eval")]
    eval_prompts = {e.prompt for e in env.examples("eval")}
    assert len(eval_prompts) == 24
    train = env.examples("train", seed=3)
    assert not eval_prompts & {train[i].prompt for i in range(300)}
    assert train[5] == env.examples("train", seed=3)[5]
    assert env.max_turns == 1 and CodeEnv(CodeConfig(tools=True, eval_size=4)).max_turns == 3
    for options, field in [({"families": ["nope"]}, "families"), ({"sandbox": "docker"}, "sandbox"),
                           ({"workers": 0}, "workers"), ({"timeout_s": 0}, "timeout_s"),
                           ({"teacher_error_rate": 2}, "teacher_error_rate"), ({"colour": 1}, "colour")]:
        with pytest.raises(ValueError, match=field):
            build_env("code", **options)


def test_without_isolation_the_env_refuses_unless_sandbox_is_auto(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    sandbox.isolation_problem.cache_clear()
    try:
        with pytest.raises(ValueError, match="sandbox") as refused:
            build_env("code", eval_size=4)
        assert "\n" not in str(refused.value) and "bubblewrap" in str(refused.value)
        assert 'sandbox = "auto"' in str(refused.value)
        env = build_env("code", eval_size=4, sandbox="auto")
        example = env.examples("eval")[0]
        assert env.reward(example, example.meta["solution"]).reward == 1.0
    finally:
        sandbox.isolation_problem.cache_clear()


def test_the_run_python_tool_runs_in_the_sandbox_and_its_reply_comes_back(env):
    tools = CodeEnv(CodeConfig(tools=True, eval_size=4, timeout_s=2.0))
    example = tools.examples("eval")[0]
    messages = tools.reset(example)
    assert messages[0]["role"] == "system" and "run_python" in messages[0]["content"]
    call = json.dumps({"name": "run_python", "arguments": {"source": "import os\nprint(6 * 7, os.getcwd())"}})
    step = tools.step(example, messages, f"<tool_call>{call}</tool_call>")
    assert not step.done and step.messages_to_append == [{"role": "tool", "content": "42 /scratch\n[exit code 0]"}]
    looping = json.dumps({"name": "run_python", "arguments": {"source": "while True: pass"}})
    assert tools.step(example, messages, f"<tool_call>{looping}</tool_call>").messages_to_append[0]["content"] == "[timed out]"
    other = json.dumps({"name": "search", "arguments": {"q": "x"}})
    assert "unknown tool" in tools.step(example, messages, f"<tool_call>{other}</tool_call>").messages_to_append[0]["content"]
    assert tools.step(example, messages, example.meta["solution"]).done
    # without tools a tool call is just a (wrong) answer
    assert env.step(example, messages, f"<tool_call>{call}</tool_call>").done


def test_a_tool_episode_runs_through_the_multi_turn_loop_and_is_judged_on_its_answer():
    tok = build_tokenizer()
    env = CodeEnv(CodeConfig(tools=True, eval_size=4, timeout_s=2.0))
    example = env.examples("eval")[0]
    args = example.answer[0][0]
    call = json.dumps({"name": "run_python", "arguments": {"source": f"{example.meta['solution']}print(f(*{args}))"}})
    turns = [f"<tool_call>{call}</tool_call>", example.meta["solution"]]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def play(prompt):
        k = sum(prompt[i:i + len(header)] == header for i in range(len(prompt))) - 1
        return tok.encode(turns[k], add_special_tokens=False) + [end]

    params = SamplingParams(n=1, max_new_tokens=256, seed=0)
    ((episode,),) = run_episodes(ScriptedEngine(play, end), tok, env, [example], params, max_turns=3,
                                 max_tokens=2048)
    assert episode.finish_reason == "stop" and episode.n_turns == 2
    assert episode.messages[3] == {"role": "tool", "content": f"{example.answer[0][1]}\n[exit code 0]"}
    reward = episode_reward(env, episode, example)
    assert reward.reward == 1.0 and reward.components["tool_calls"] == 1.0


def test_demonstrations_teach_the_reference_mostly_and_the_tool_call_format():
    env = CodeEnv(CodeConfig(tools=True, eval_size=4, teacher_error_rate=0.3, teacher_tool_rate=0.5))
    rng = random.Random(0)
    train = env.examples("train", seed=0)
    demos = [env.demonstration_messages(train[i], rng) for i in range(200)]
    answers = [d[-1]["content"] for d in demos]
    right = sum(a == train[i].meta["solution"] for i, a in enumerate(answers))
    assert 0.6 < right / 200 < 0.8
    with_tool = [d for d in demos if len(d) == 5]
    assert 0.4 < len(with_tool) / 200 < 0.6
    # the demonstrated tool reply is what the sandbox prints for that call
    demo = with_tool[0]
    source = json.loads(demo[2]["content"][len("<tool_call>"):-len("</tool_call>")])["arguments"]["source"]
    step = env.step(train[0], demo[:3], demo[2]["content"])
    assert step.messages_to_append[0]["content"] == demo[3]["content"]
    assert source.startswith("def f(")


def test_identical_answers_to_the_same_tests_run_once_and_share_the_result(env, monkeypatch):
    from rlpipe.envs import code

    runs: list[str] = []

    def counted(source, **kwargs):
        runs.append(kwargs["stdin"])
        return sandbox.run_python(source, **kwargs)

    monkeypatch.setattr(code, "run_python", counted)
    first, second = env.examples("eval")[:2]
    right, wrong = first.meta["solution"], first.meta["wrong_solution"]
    fenced = f"```python\n{right}```"  # the same code once extracted
    batch = [(first, right), (first, wrong), (first, fenced), (second, right), (first, right), (first, wrong)]
    results = env.reward_batch([e for e, _ in batch], [t for _, t in batch])
    assert len(runs) == 3  # (first, right), (first, wrong), (second, first's code)
    assert [r.reward for r in results][:3] == [1.0, env.reward(first, wrong).reward, 1.0]
    assert results[4] == results[0] and results[5] == results[1]
    assert results[3] == env.reward(second, right)
