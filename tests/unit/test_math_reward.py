"""The `math` reward: final answers extracted (####, \\boxed{}, last number) and compared by value."""

import threading
import time

import pytest
from rlpipe.envs.math_answers import final_answer, math_reward, plain_number, reference_answer
from rlpipe.envs.rewards import get_reward

MATH = get_reward("math")
assert MATH is math_reward


@pytest.mark.parametrize(("completion", "answer", "correct"), [
    ("Natalia sold 48/2 = 24 clips in May, 48+24 = 72 in all.\n#### 72", "She sold ... \n#### 72", 1.0),
    ("so she has 1,234 apples left", "#### 1234", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("$18.", "#### 18", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("#### 73", "#### 72", 0.0),
    ("the last number wins: 5 then 7", "#### 5", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),   # math-verify: LaTeX by value
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{x^2+2x}", "(x+1)^2", 0.0),
])
def test_math_reward_compares_final_answers_by_value(completion, answer, correct):
    reward, components = MATH(completion, answer, None)
    assert (reward, components["correct"], components["format"]) == (correct, correct, 1.0)


def test_no_final_answer_is_a_format_miss_and_a_bad_reference_raises():
    assert MATH("I do not know", "#### 3", None) == (0.0, {"format": 0.0, "correct": 0.0})
    with pytest.raises(ValueError, match="holds no final answer"):
        MATH("3", "   ", None)


def test_extraction_rules():
    assert final_answer("x \\boxed{a} then \\boxed{\\frac{1}{2}} end 9") == "\\frac{1}{2}"
    assert final_answer("work\n#### 1,000\n") == "1,000"
    assert final_answer("12 apples and 3.5 pears") == "3.5"
    assert final_answer("\\boxed 5 and {x}") == "5" and final_answer("\\fbox {7}.") == "7"
    assert final_answer("an unclosed \\boxed{3") == "3"  # no box: the last number
    assert reference_answer("\\frac{1}{\\sqrt{2}}") == "\\frac{1}{\\sqrt{2}}"
    assert reference_answer("a long solution with 3 steps\n#### 42") == "42"
    assert plain_number("1,234,567") == 1234567 and plain_number("\\frac{3}{4}") == plain_number("0.75")
    assert plain_number("x+1") is None


@pytest.mark.slow
def test_a_pathological_answer_cannot_hang_a_scorer_thread():
    """sympy would spend minutes on a power tower; the worker is killed and the reward returns
    wrong, from a thread too (math-verify's own alarm works only on a main thread)."""
    out = {}

    def score():
        out["value"] = MATH("\\boxed{9^{9^{9^{9^{9}}}}}", "\\boxed{10^{10^{10^{10}}}}", None)

    MATH("\\boxed{\\sqrt{4}}", "2.0", None)  # the worker is started
    started = time.monotonic()
    worker = threading.Thread(target=score)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and out["value"][0] == 0.0
    assert time.monotonic() - started < 30
    assert MATH("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", None)[0] == 1.0  # a new worker


def test_without_math_verify_numbers_still_compare_by_value_and_the_rest_as_text(monkeypatch):
    import importlib.util

    from rlpipe.envs.math_answers import answers_equal

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    assert answers_equal("1,234", "1234.0") and answers_equal("\\frac{1}{2}", "0.5")
    assert answers_equal("x + 1", "x+1")  # text, whitespace dropped
    assert not answers_equal("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")  # needs math-verify
