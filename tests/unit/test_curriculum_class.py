"""The curriculum keyed by prompt class (rl.curriculum.key = "class"): prompts that never repeat
rest with their solved class, the arithmetic environment's classes (digits and carries), the
solved-rate rule, and the class history rebuilt for a resumed run."""

from __future__ import annotations

import pytest
from rlpipe.envs.arithmetic import ArithmeticConfig, ArithmeticEnv, carries, problem_class
from rlpipe.envs.base import Example
from rlpipe.envs.prompts import PromptSource
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.curriculum import (
    Curriculum,
    CurriculumOptions,
    PassHistory,
    class_keys,
    resting,
)
from rlpipe.rollouts.options import curriculum_options

from tests.unit.test_curriculum import scored

CLASS = CurriculumOptions(kind="pass_rate", window=4, retest=1e-9, seed=0, key="class")


def fresh(n: int, start: int = 0) -> list[Example]:
    """`n` prompts that never repeat: ids from `start`, even ids of class "easy", odd "hard"."""
    return [Example("e", str(i), f"q{i}", None, curriculum_key="easy" if i % 2 == 0 else "hard")
            for i in range(start, start + n)]


@pytest.mark.parametrize(("operands", "want"), [([12, 34], 0), ([15, 5], 1), ([999, 1], 3), ([55, 45], 2),
                                                ([0, 0], 0), ([9, 9, 9], 1), ([99, 99, 99], 2)])
def test_carries_counts_the_columns_that_carry(operands, want):
    assert carries(operands) == want


def test_arithmetic_prompts_carry_their_class_of_digits_and_carries():
    env = ArithmeticEnv(ArithmeticConfig(max_digits=3, pad_operands=True, reverse_operands=True))
    train = env.examples("train", seed=0)
    for example in list(train[:200]) + list(env.examples("eval")[:50]):
        operands = example.meta["operands"]
        assert example.curriculum_key == problem_class(operands, "+")
    keys = {e.curriculum_key for e in train[:2000]}
    assert "+ 3x3 digits, 3 carries" in keys and "+ 1x1 digits, 0 carries" in keys and 20 <= len(keys) <= 40
    assert problem_class([12, 3, 4], "-*") == "-* 2x1x1 digits"  # carries only for a sum


def test_class_keying_falls_back_to_the_example_id_and_example_keying_ignores_the_class():
    with_class, without = fresh(1)[0], Example("e", "7", "q7", None)
    assert CLASS.key_of(with_class) == ("e", "easy") and CLASS.key_of(without) == ("e", "7")
    assert CurriculumOptions(kind="pass_rate").key_of(with_class) == ("e", "0")


def test_never_repeating_prompts_rest_with_their_solved_class_and_the_rows_name_it():
    curriculum = Curriculum(CLASS)
    first, rows = curriculum.choose(PromptSource(fresh(4), seed=0, shuffle=False).next_batch, 4, step=1, attempt=1)
    assert [e.example_id for e in first] == ["0", "1", "2", "3"] and rows == []
    curriculum.observe(*scored(1, 1, {"0": [1.0, 1.0], "1": [1.0, 0.0], "2": [1.0, 1.0], "3": [0.0, 1.0]}))
    assert curriculum.history.counts(("e", "easy")) == (4, 4)  # two prompts fill the class's window
    assert curriculum.history.counts(("e", "hard")) == (2, 4)
    assert ("e", "0") not in curriculum.history.recent
    chosen, rows = curriculum.choose(PromptSource(fresh(8, start=100), seed=0, shuffle=False).next_batch, 4,
                                     step=2, attempt=1)
    assert [e.example_id for e in chosen] == ["101", "103", "105", "107"]  # new prompts of the hard class
    assert [r["example_id"] for r in rows] == ["100", "102", "104", "106"]
    assert all(r["status"] == "skipped" and r["state"] == "solved" for r in rows)
    assert "4 of the last 4 completions of its class 'easy' passed" in rows[0]["reason"]


def test_solved_rate_lets_a_large_window_rest_with_a_few_failures():
    assert resting(60, 64, 64, solved_rate=0.9) == "solved"
    assert resting(57, 64, 64, solved_rate=0.9) is None
    assert resting(6, 64, 64, solved_rate=0.9) == "hopeless"
    assert resting(7, 64, 64, solved_rate=0.9) is None
    assert resting(63, 64, 64) is None and resting(64, 64, 64) == "solved"  # the default: all passed


def test_the_class_history_rebuilt_from_table_rows_equals_the_live_one():
    live = Curriculum(CLASS)
    pool = fresh(6)
    live.choose(PromptSource(pool, seed=0, shuffle=False).next_batch, 6, step=1, attempt=1)
    rollouts, scores = scored(1, 1, {"0": [1.0, 0.0], "1": [1.0, 1.0], "2": [1.0, 1.0], "5": [0.0, 0.0]})
    live.observe(rollouts, scores)
    rows = [(r.env, r.example_id, s.reward) for r, s in zip(rollouts, scores, strict=True)]
    classes = class_keys(pool, {(env, example_id) for env, example_id, _ in rows}, CLASS)
    assert classes == {("e", "0"): ("e", "easy"), ("e", "1"): ("e", "hard"), ("e", "2"): ("e", "easy"),
                       ("e", "5"): ("e", "hard")}
    rebuilt = PassHistory.from_rows(rows, CLASS.window, CLASS.pass_reward, lambda key: classes.get(key, key))
    assert {k: list(v) for k, v in rebuilt.recent.items()} == {k: list(v) for k, v in live.history.recent.items()}
    assert list(rebuilt.recent[("e", "hard")]) == [True, True, False, False]


def test_class_config_fields_reach_the_options_and_bad_values_name_the_field():
    rl = RLConfig(curriculum={"type": "pass_rate", "key": "class", "solved_rate": 0.9})
    options = curriculum_options(rl, seed=1)
    assert (options.key, options.solved_rate) == ("class", 0.9)
    for bad in ({"key": "prompt"}, {"solved_rate": 0.5}, {"solved_rate": 1.1}):
        with pytest.raises(ValueError, match=rf"curriculum\.{next(iter(bad))}"):
            RLConfig(curriculum=bad)


def test_a_round_reads_at_most_its_share_of_the_stream_and_samples_fewer_when_most_prompts_rest():
    history = PassHistory(4)
    for _ in range(4):
        history.add(("e", "easy"), True)  # the easy class rests, the hard one has no history

    def choose(reads: float, n: int) -> list[str]:
        options = CurriculumOptions(kind="pass_rate", window=4, retest=1e-9, key="class", reads=reads)
        chosen, _ = Curriculum(options, history).choose(
            PromptSource(fresh(40, start=100), seed=0, shuffle=False).next_batch, n, step=2, attempt=1)
        return [e.example_id for e in chosen]

    assert choose(0, 4) == ["101", "103", "105", "107"]  # reads on until it has 4 (8 read)
    assert choose(2, 4) == ["101", "103", "105", "107"]  # 8 read: 4 asked for, x2, exactly enough
    assert choose(1, 4) == ["101", "103"]  # 4 read, half of them rest: the round samples fewer
    assert choose(1.5, 4) == ["101", "103", "105"]
