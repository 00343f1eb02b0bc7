"""Reward registry, built-ins, format-then-correct composition, error capture and threshold."""

from __future__ import annotations

import pytest
from rlpipe.envs.base import Example, RewardResult
from rlpipe.envs.rewards import (
    RewardError,
    RewardRegistry,
    evaluate_reward,
    exact_match,
    format_integer,
    format_number,
    format_then_correct,
    get_reward,
    numeric_match,
    register_reward,
    reward_metrics,
    score_completions,
)
from rlpipe.envs.single_turn import SingleTurnEnv

EX = Example("t", "0", "1+1=", 2, {})


def test_builtins():
    assert exact_match(" 2\n", 2, EX) == 1.0 and exact_match("2.0", 2, EX) == 0.0
    assert numeric_match("so it is 2.0", 2, EX) == (1.0, {"format": 1.0, "correct": 1.0})
    assert numeric_match("7/2", "3.5", EX)[0] == 1.0
    assert numeric_match("no number", 2, EX) == (0.0, {"format": 0.0, "correct": 0.0})
    assert format_integer("-12") == 1.0 and format_integer("1 2") == 0.0
    assert format_number("1e3") == 1.0 and format_number("x1") == 0.0
    assert get_reward("integer_match")("2", 2, EX) == (1.0, {"format": 1.0, "correct": 1.0})
    assert get_reward("integer_match")("two", 2, EX) == (0.0, {"format": 0.0, "correct": 0.0})


def test_hostile_numbers_are_format_failures_not_errors():
    for text in ["1e999999999", "7/0", "9" * 5000, "1" * 2000 + "/3"]:
        r = evaluate_reward(numeric_match, text, 2, EX)
        assert r.error is None and r.reward == 0.0, text[:20]
    r = evaluate_reward(get_reward("integer_match"), "9" * 5000, 2, EX)
    assert r.error is None and r.components == {"format": 1.0, "correct": 0.0}
    assert get_reward("integer_match")("-0", 0, EX)[0] == 1.0
    assert get_reward("integer_match")("-7", -7, EX)[0] == 1.0
    assert get_reward("integer_match")("7", -7, EX)[0] == 0.0
    assert numeric_match("1e300", "1e300", EX)[0] == 1.0


def test_registry_decorator_and_call_forms():
    registry = RewardRegistry()

    @register_reward("starts", registry=registry)
    def starts(text, answer, example):
        return float(text.startswith(str(answer)))

    register_reward("always_half", lambda t, a, e: 0.5, registry=registry)
    assert registry.names() == ["always_half", "starts"]
    assert registry.get("starts")("23", 2, EX) == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("starts", lambda t, a, e: 0.0, registry=registry)
    register_reward("starts", lambda t, a, e: 0.0, registry=registry, replace=True)
    assert registry.get("starts")("23", 2, EX) == 0.0
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        registry.get("nope")


def test_format_then_correct_short_circuits():
    calls = []

    def correct(text, answer, example):
        calls.append(text)
        return text.strip() == str(answer)

    fn = format_then_correct(format_integer, correct, format_reward=0.1)
    assert fn("x", 2, EX) == (0.0, {"format": 0.0, "correct": 0.0})
    assert calls == []  # correctness not evaluated when the format fails
    assert fn("3", 2, EX) == (0.1, {"format": 1.0, "correct": 0.0})
    assert fn("2", 2, EX) == (1.1, {"format": 1.0, "correct": 1.0})
    assert calls == ["3", "2"]


def _boom(text, answer, example):
    if text == "boom":
        raise KeyError("the reward function has a bug")
    return 1.0


def test_raising_reward_is_caught_with_traceback():
    r = evaluate_reward(_boom, "boom", 2, EX)
    assert r.reward == 0.0
    assert r.error.splitlines()[0] == "KeyError: 'the reward function has a bug'"
    assert "Traceback" in r.error and "_boom" in r.error
    nan = evaluate_reward(lambda t, a, e: float("nan"), "x", 2, EX)
    assert nan.reward == 0.0 and "not finite" in nan.error


class _BoomEnv(SingleTurnEnv):
    name = "boom"

    def score(self, example, completion_text):
        return _boom(completion_text, example.answer, example)


def test_score_completions_counts_errors_and_threshold():
    env = _BoomEnv()
    texts = ["ok", "boom", "ok", "ok"]
    results = score_completions(env, [EX] * 4, texts, max_error_fraction=0.25)
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 1.0]
    assert [r.error is not None for r in results] == [False, True, False, False]
    m = reward_metrics(results)
    assert m["rollout/reward_errors"] == 1.0 and m["rollout/reward_error_fraction"] == 0.25
    with pytest.raises(RewardError, match=r"1 of 4 reward calls raised(.|\n)*KeyError"):
        score_completions(env, [EX] * 4, texts, max_error_fraction=0.2)
    with pytest.raises(ValueError, match="2 examples for 1"):
        score_completions(env, [EX] * 2, ["ok"])


def test_score_completions_catches_env_reward_that_raises():
    class BadEnv(SingleTurnEnv):
        name = "bad"

        def reward(self, example, transcript) -> RewardResult:
            raise RuntimeError("env bug")

    results = score_completions(BadEnv(), [EX], ["x"], max_error_fraction=1.0)
    assert results[0].reward == 0.0 and results[0].error.startswith("RuntimeError: env bug")
