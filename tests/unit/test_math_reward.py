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
    """sympy would spend minutes on a power tower: the pre-check refuses it before any worker
    sees it, from a thread too (the kill of an overrunning worker is tested below with a
    stand-in worker that never answers)."""
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


# ---- adversarial answers and how graders read numbers ----

@pytest.mark.parametrize(("completion", "answer", "correct"), [
    ("\\boxed{3,5}", "35", 0.0),            # a list {3, 5}, not 35 (no thousands separator)
    ("\\boxed{1,2,3}", "123", 0.0),         # a list, not 123
    ("\\boxed{3,5}", "5, 3", 1.0),          # lists compare as sets, as math-verify does
    ("\\boxed{1, 2, 3}", "\\{1,2,3\\}", 1.0),
    ("\\boxed{3,5}", "3.5", 0.0),           # never a decimal comma
    ("\\boxed{1,234}", "1234", 1.0),        # a thousands separator: groups of three
    ("#### 12,345,678", "12345678", 1.0),
    ("\\boxed{1e-300}", "0", 0.0),          # zero matches only zero
    ("\\boxed{0.0}", "0", 1.0),
    ("\\boxed{1.0000001}", "1", 1.0),       # 1e-7 relative: within 1e-6
    ("\\boxed{1e-300}", "1e-300", 1.0),
])
def test_numbers_are_read_as_the_gsm8k_and_math_graders_read_them(completion, answer, correct):
    assert MATH(completion, answer, None)[0] == correct


@pytest.mark.parametrize("answer", ["9^{9^{9^{9}}}", "9^9^9", "2**10**8", "2^{10^{6}}", "10000!", "(5!)!",
                                    "\\binom{100000}{50000}", "0.5^{10^{9}}", "(10^{10})!", "(20000)!", "\\sqrt[9^{9^{9}}]{2}",
                                    "{" * 60 + "1" + "}" * 60, "\\left(9\\right)^{9^{99}}"])
def test_the_pre_check_refuses_what_cannot_be_evaluated_in_time(answer):
    from rlpipe.envs.math_answers import too_costly

    started = time.monotonic()
    assert too_costly(answer)
    reward = MATH(f"\\boxed{{{answer}}}", "\\frac{1}{\\sqrt{2}}", None)  # never reaches a worker
    assert reward[0] == 0.0 and time.monotonic() - started < 0.5


@pytest.mark.parametrize("answer", ["2^{10}", "10^{100}", "x^{y^{z}}", "100!", "(2+3)!", "\\binom{10}{5}",
                                    "1" * 300, "e^{i\\pi}", "2^{10^{3}}"])
def test_the_pre_check_lets_ordinary_answers_through(answer):
    from rlpipe.envs.math_answers import too_costly

    assert not too_costly(answer)


def _serve_slowly(connection):
    """A stand-in worker: "slow" never answers (as sympy on a power tower), anything else at once."""
    connection.send("ready")
    while True:
        prediction, reference, _ = connection.recv()
        if prediction == "slow":
            time.sleep(600)
        connection.send(prediction == reference)


@pytest.mark.slow
def test_each_answer_has_its_own_time_and_a_killed_worker_is_replaced():
    from rlpipe.envs.math_answers import _VerifierPool

    pool = _VerifierPool(4, _serve_slowly)
    try:
        assert pool.compare("a", "a", 1)  # the pool starts its workers
        for _ in range(300):
            with pool.changed:
                if len(pool.idle) == 4:
                    break
            time.sleep(0.1)
        results: dict[int, tuple[bool, float]] = {}

        def one(i: int, answer: str) -> None:
            started = time.monotonic()
            results[i] = (pool.compare(answer, "x", 1), time.monotonic() - started)

        answers = ["slow", "slow", "x", "x", "x", "x", "x", "x"]  # two adversarial among eight
        threads = []
        for i, answer in enumerate(answers):
            threads.append(threading.Thread(target=one, args=(i, answer)))
            threads[-1].start()
            time.sleep(0.05)  # in order, as a scorer calls them
        for thread in threads:
            thread.join(60)
        assert [results[i][0] for i in range(8)] == [False, False] + [True] * 6
        assert all(results[i][1] < 1.0 for i in range(2, 8)), results  # never waited on the slow ones
        assert all(1.9 < results[i][1] < 10 for i in range(2)), results  # killed at twice the timeout
        for _ in range(100):  # the killed workers are replaced
            with pool.changed:
                if len(pool.idle) == 4 and pool.live == 4:
                    break
            time.sleep(0.1)
        assert pool.live == 4 and len(pool.idle) == 4 and pool.compare("y", "y", 1)
    finally:
        pool.close()


@pytest.mark.slow
def test_adversarial_neighbours_do_not_time_out_innocent_answers():
    """A hostile batch: reward_timeout_s = 2, two power towers among eight answers; the six
    innocent ones (which need math-verify) all score 1."""
    from rlpipe.envs import math_answers
    from rlpipe.envs.timeout import call_with_timeout

    MATH("\\boxed{\\sqrt{4}}", "2.0", None)  # the pool starts its workers
    for _ in range(600):
        with math_answers._POOL.changed:
            if len(math_answers._POOL.idle) == math_answers._POOL.size:
                break
        time.sleep(0.1)
    answers = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^{10})!}"] + ["\\boxed{\\frac{\\sqrt{2}}{2}}"] * 6
    scores = []
    for answer in answers:
        finished, value = call_with_timeout(MATH, (answer, "\\frac{1}{\\sqrt{2}}", None), 2.0)
        scores.append(value[0] if finished else "timeout")
    assert scores == [0.0, 0.0] + [1.0] * 6
