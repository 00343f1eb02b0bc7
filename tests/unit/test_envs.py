"""Environment contract, registry, arithmetic and countdown generation and verification."""

from __future__ import annotations

import pytest
from rlpipe.envs.arithmetic import ArithmeticConfig, ArithmeticEnv, format_answer, parse_answer
from rlpipe.envs.base import Environment, Example, completion_text_of
from rlpipe.envs.countdown import CountdownEnv, check_solution
from rlpipe.envs.expr import ExpressionError, evaluate
from rlpipe.envs.registry import build_env


def test_build_env_registry_and_unknown_names():
    env = build_env("arithmetic", max_digits=2, eval_size=20)
    assert isinstance(env, Environment) and env.name == "arithmetic"
    assert isinstance(build_env("countdown", eval_size=10), Environment)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        build_env("nope")
    with pytest.raises(ValueError, match="max_digitz"):
        build_env("arithmetic", max_digitz=3)
    with pytest.raises(ValueError, match="'path'"):
        build_env("dataset")


def test_single_turn_contract_reset_step_reward_on_transcript():
    env = ArithmeticEnv(ArithmeticConfig(max_digits=2, eval_size=20))
    ex = env.examples("train", seed=0)[0]
    messages = env.reset(ex)
    assert messages == [{"role": "user", "content": ex.prompt}]
    text = str(ex.answer)
    result = env.step(ex, [*messages, {"role": "assistant", "content": text}], text)
    assert result.done is True and result.messages_to_append == []
    transcript = [*messages, {"role": "assistant", "content": text}]
    assert env.reward(ex, transcript).reward == 1.0
    assert completion_text_of(transcript) == text
    with pytest.raises(ValueError, match="assistant"):
        completion_text_of(messages)
    with pytest.raises(ValueError, match="split"):
        env.examples("test")  # type: ignore[arg-type]


def test_arithmetic_is_deterministic_with_stable_ids():
    cfg = ArithmeticConfig(max_digits=3, operators="+-*", max_operands=3, eval_size=50)
    a, b = ArithmeticEnv(cfg), ArithmeticEnv(cfg)
    train_a, train_b = a.examples("train", seed=7), b.examples("train", seed=7)
    assert [train_a[i] for i in range(50)] == [train_b[i] for i in range(50)]
    assert train_a[3].example_id == "train/7/3"
    assert train_a[-1] == train_a[len(train_a) - 1]
    other = a.examples("train", seed=8)
    assert [train_a[i].prompt for i in range(20)] != [other[i].prompt for i in range(20)]
    # eval is fixed by eval_seed, whatever the run seed
    assert list(a.examples("eval", seed=1)) == list(b.examples("eval", seed=2))


def test_arithmetic_answers_are_exact_with_precedence():
    env = ArithmeticEnv(
        ArithmeticConfig(max_digits=2, operators="+-*", max_operands=3, eval_size=50)
    )
    for ex in env.examples("train", seed=0)[:200]:
        expr = ex.prompt.rstrip("=")
        assert ex.prompt.endswith("=") and len(ex.prompt) <= 12
        assert ex.answer == int(evaluate(expr).value)
        assert env.reward(ex, format_answer(ex.answer, False)).reward == 1.0


def test_arithmetic_eval_disjoint_from_train_and_distinct():
    env = ArithmeticEnv(ArithmeticConfig(max_digits=2, eval_size=200))
    eval_prompts = [ex.prompt for ex in env.examples("eval")]
    assert len(eval_prompts) == 200 == len(set(eval_prompts))
    train = env.examples("train", seed=0)
    assert not {train[i].prompt for i in range(3000)} & set(eval_prompts)


def test_arithmetic_config_validation_and_level():
    assert ArithmeticConfig(level=2, min_digits=3).max_digits == 2
    assert ArithmeticConfig(level=2, min_digits=3).min_digits == 2
    assert ArithmeticConfig(operators=["+", "-", "+"]).operators == "+-"
    with pytest.raises(ValueError, match="operators"):
        ArithmeticConfig(operators="/")
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticConfig(max_digits=1, eval_size=500)  # only 100 one-digit sums exist
    no_neg = ArithmeticEnv(ArithmeticConfig(operators="-", eval_size=20, allow_negative=False))
    assert all(ex.answer >= 0 for ex in no_neg.examples("train")[:200])


def test_arithmetic_verifier_correct_wrong_malformed_malicious():
    env = ArithmeticEnv(ArithmeticConfig(max_digits=2, eval_size=20))
    ex = Example("arithmetic", "x", "12+345=", 357, {})
    assert env.reward(ex, "357").components == {"format": 1.0, "correct": 1.0}
    assert env.reward(ex, " 357\n").reward == 1.0
    wrong = env.reward(ex, "358")
    assert wrong.reward == 0.0 and wrong.components == {"format": 1.0, "correct": 0.0}
    for bad in ["", "35 7", "357+", "three", "0357x", "__import__('os').system('true')", "3.57e2"]:
        r = env.reward(ex, bad)
        assert r.reward == 0.0 and r.components["format"] == 0.0 and r.error is None, bad


def test_reverse_digits_format_and_reward():
    assert format_answer(357, True) == "753" and format_answer(-120, True) == "-021"
    assert parse_answer("-021", True) == -120 and parse_answer("753", True) == 357
    env = ArithmeticEnv(ArithmeticConfig(max_digits=2, eval_size=20, reverse_digits=True))
    ex = Example("arithmetic", "x", "12+345=", 357, {})
    assert env.reward(ex, "753").reward == 1.0
    assert env.reward(ex, "357").reward == 0.0
    train_ex = env.examples("train")[0]
    assert train_ex.meta["target_text"] == format_answer(train_ex.answer, True)


def test_safe_expression_evaluator_rejects_code():
    assert evaluate("(8-2)*4").value == 24
    assert evaluate("7/2*2").value == 7
    assert evaluate("3*(4+5)").literals == (3, 4, 5)
    for bad in [
        "__import__('os')",
        "2**100",
        "8//2",
        "1.5+1",
        "abs(3)",
        "(1).__class__",
        "1 if 1 else 2",
        "-3+4",
        "4/0",
        "(" * 300 + "1" + ")" * 300,
        "",
    ]:
        with pytest.raises(ExpressionError):
            evaluate(bad)
    assert evaluate("-3+4", allow_unary_minus=True).value == 1


def test_countdown_problems_are_solvable_and_deterministic():
    env = CountdownEnv()
    train = env.examples("train", seed=3)
    again = CountdownEnv().examples("train", seed=3)
    for i in range(100):
        ex = train[i]
        assert ex == again[i]
        assert 1 <= ex.answer["target"] <= 100
        assert env.reward(ex, ex.meta["target_text"]).reward == 1.0, ex
    assert not {train[i].prompt for i in range(500)} & {e.prompt for e in env.examples("eval")}


def test_countdown_verifier_cases():
    numbers, target = [3, 4, 8, 2], 24
    assert check_solution("3*8", numbers, target) == (True, True)
    assert check_solution("(8-2)*4", numbers, target) == (True, True)
    assert check_solution("8*3+2-2", numbers, target) == (True, False)  # 2 used twice
    assert check_solution("4*6", numbers, target) == (True, False)  # 6 not given
    assert check_solution("3*8+1", numbers, target) == (True, False)  # wrong value
    assert check_solution("8/0", numbers, target) == (False, False)
    assert check_solution("3*8", numbers, target, use_all=True) == (True, False)
    assert check_solution("(8-2)*4/2*2+3-3", [8, 2, 4, 2, 2, 3, 3], target, use_all=True) == (
        True,
        True,
    )
    for bad in ["__import__('os').system('rm -rf /')", "3 8", "24", "3*8=24", "exec('1')"]:
        well_formed, correct = check_solution(bad, numbers, target)
        assert not correct, bad
    env = CountdownEnv()
    ex = Example("countdown", "x", "24 from 3 4 8 2:", {"numbers": numbers, "target": target}, {})
    assert env.reward(ex, "3*8").components == {"format": 1.0, "correct": 1.0}
    assert env.reward(ex, "__import__('os')").components == {"format": 0.0, "correct": 0.0}
    assert env.reward(ex, "4*6").components == {"format": 1.0, "correct": 0.0}


def test_reversed_padded_operands_and_carry_forgetting_teacher():
    import random

    from rlpipe.envs.arithmetic import ArithmeticEnv, carry_blind_sum

    assert carry_blind_sum(347, 586) == 823  # 7+6=13→3, 4+8=12→2, 3+5=8
    assert carry_blind_sum(12, 34) == 46
    env = ArithmeticEnv.from_options(min_digits=1, max_digits=3, operators="+", pad_operands=True,
                                     reverse_operands=True, reverse_digits=True, teacher_carry_error=1.0)
    example = env.examples("train", seed=0)[0]
    a, b = example.meta["operands"]
    assert example.prompt == f"{a:03d}"[::-1] + "+" + f"{b:03d}"[::-1] + "="
    assert example.meta["target_text"] == str(a + b)[::-1]
    rng = random.Random(0)
    assert env.demonstration(example, rng) == str(carry_blind_sum(a, b))[::-1]
    honest = ArithmeticEnv.from_options(max_digits=3, teacher_carry_error=0.0)
    sample = honest.examples("train", seed=0)[0]
    assert honest.demonstration(sample, rng) == sample.meta["target_text"]
    # the verifier always wants the true sum, whatever the teacher wrote
    assert env.reward(example, str(a + b)[::-1]).reward == 1.0
