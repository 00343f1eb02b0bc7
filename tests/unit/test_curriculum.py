"""The pass-rate curriculum: pass history, which prompts rest, skips and re-tests, and the history
rebuilt from a run's tables equal to the one the run kept."""

from __future__ import annotations

import pytest
from rlpipe.envs.base import Example
from rlpipe.envs.prompts import PromptSource
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.curriculum import (
    Curriculum,
    CurriculumOptions,
    PassHistory,
    history_rows,
    resting,
    retest_draw,
)
from rlpipe.rollouts.fates import select_step
from rlpipe.rollouts.group_buffer import GroupBuffer
from rlpipe.rollouts.options import curriculum_options, rollout_options
from rlpipe.rollouts.records import Score
from rlpipe.rollouts.source import RolloutSource
from rlpipe.storage.writer import write_table

from tests.rollout_rows import rollout

ON = CurriculumOptions(kind="pass_rate", window=4, retest=0.25, seed=3)


def examples(n: int) -> list[Example]:
    return [Example("e", str(i), f"q{i}", None) for i in range(n)]


def scored(step: int, attempt: int, outcomes: dict[str, list[float]], error_at: tuple[str, int] | None = None):
    """One round's rollouts and scores: `outcomes` maps example id -> the rewards of its group."""
    rollouts, scores = [], []
    for g, (example_id, rewards) in enumerate(outcomes.items()):
        for j, reward in enumerate(rewards):
            sid = f"r:s{step:06d}:a{attempt}:g{g:04d}:{j:03d}"
            rollouts.append(rollout(step=step, attempt=attempt, env="e", example_id=example_id,
                                    group_id=sid[:-4], sample_id=sid))
            error = "boom" if error_at == (example_id, j) else None
            scores.append(Score(run_id="r", step=step, sample_id=sid, group_id=sid[:-4], reward=reward,
                                components={}, error=error))
    return rollouts, scores


@pytest.mark.parametrize(("passed", "counted", "want"), [
    (4, 4, "solved"), (0, 4, "hopeless"), (3, 4, None), (1, 4, None), (3, 3, None), (0, 0, None)])
def test_a_prompt_rests_only_on_a_full_window_that_all_passed_or_all_failed(passed, counted, want):
    assert resting(passed, counted, window=4) == want


def test_the_window_keeps_the_newest_completions_so_one_failure_wakes_a_solved_prompt():
    curriculum = Curriculum(ON)
    curriculum.observe(*scored(1, 1, {"a": [1.0, 1.0, 1.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0]}))
    assert curriculum.history.counts(("e", "a")) == (4, 4)
    assert curriculum.history.counts(("e", "b")) == (0, 4)
    curriculum.observe(*scored(2, 1, {"a": [0.0, 1.0]}))
    assert curriculum.history.counts(("e", "a")) == (3, 4)  # the two oldest passes fell out
    assert resting(*curriculum.history.counts(("e", "a")), 4) is None


def test_reward_errors_are_not_counted_and_pass_reward_is_a_floor():
    options = CurriculumOptions(kind="pass_rate", window=4, pass_reward=0.7)
    curriculum = Curriculum(options)
    curriculum.observe(*scored(1, 1, {"a": [0.7, 0.9, 0.69, 0.0]}, error_at=("a", 3)))
    assert curriculum.history.counts(("e", "a")) == (2, 3)


def test_resting_prompts_are_skipped_or_retested_with_a_reason_and_the_rest_sampled():
    curriculum = Curriculum(ON)
    outcomes = {str(i): [1.0] * 4 if i % 3 == 0 else [0.0] * 4 if i % 3 == 1 else [0.0, 1.0, 1.0, 1.0]
                for i in range(30)}
    curriculum.observe(*scored(1, 1, outcomes))
    chosen, rows = curriculum.choose(PromptSource(examples(30), seed=0, shuffle=False).next_batch, 10, step=2,
                                     attempt=1)
    assert len(chosen) == 10
    by_id = {r["example_id"]: r for r in rows}
    for example in chosen:  # every prompt sampled is awake, or a re-test recorded as one
        i = int(example.example_id)
        assert i % 3 == 2 or by_id[example.example_id]["status"] == "retested"
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert skipped and all(r["example_id"] not in {e.example_id for e in chosen} for r in skipped)
    for row in rows:
        i = int(row["example_id"])
        assert row["state"] == ("solved" if i % 3 == 0 else "hopeless")
        assert (row["passed"], row["counted"]) == ((4, 4) if i % 3 == 0 else (0, 4))
        assert row["reason"].startswith(f"{row['state']}: {row['passed']} of its last 4 completions passed")
        draw = retest_draw(ON.seed, 2, 1, ("e", row["example_id"]))
        assert (row["status"] == "retested") == (draw < ON.retest)
    # the same round with the same history chooses the same prompts (a resumed step)
    again = Curriculum(ON, curriculum.history).choose(PromptSource(examples(30), seed=0, shuffle=False).next_batch,
                                                     10, step=2, attempt=1)
    assert [e.example_id for e in again[0]] == [e.example_id for e in chosen] and again[1] == rows


def test_retest_draws_are_uniform_enough_and_depend_on_the_round():
    draws = [retest_draw(0, 5, 1, ("e", str(i))) for i in range(4000)]
    assert all(0 <= d < 1 for d in draws)
    assert abs(sum(d < 0.1 for d in draws) / len(draws) - 0.1) < 0.02
    assert retest_draw(0, 5, 1, ("e", "1")) != retest_draw(0, 6, 1, ("e", "1"))


def test_off_takes_the_stream_as_it_comes():
    curriculum = Curriculum(CurriculumOptions())
    curriculum.observe(*scored(1, 1, {"0": [1.0] * 8}))
    chosen, rows = curriculum.choose(PromptSource(examples(5), seed=0, shuffle=False).next_batch, 3, step=2,
                                     attempt=1)
    assert [e.example_id for e in chosen] == ["0", "1", "2"] and rows == []
    assert curriculum.history.recent == {}


def test_a_round_reads_the_stream_once_round_and_samples_no_prompt_twice():
    curriculum = Curriculum(CurriculumOptions(kind="pass_rate", window=1, retest=1e-9))
    curriculum.observe(*scored(1, 1, {str(i): [1.0] for i in range(3)}))  # 0, 1, 2 rest; 3, 4 awake
    chosen, rows = curriculum.choose(PromptSource(examples(5), seed=0, shuffle=False).next_batch, 4, step=2,
                                     attempt=1)
    assert [e.example_id for e in chosen] == ["3", "4"]
    assert [(r["example_id"], r["status"]) for r in rows] == [("0", "skipped"), ("1", "skipped"), ("2", "skipped")]
    # every prompt resting: the round still samples one, the first it met, as a re-test that says why
    curriculum.observe(*scored(2, 1, {"3": [1.0], "4": [1.0]}))
    chosen, rows = curriculum.choose(PromptSource(examples(5), seed=0, shuffle=False).next_batch, 4, step=3,
                                     attempt=1)
    assert [e.example_id for e in chosen] == ["0"]
    assert [r["status"] for r in rows] == ["retested"] + ["skipped"] * 4
    assert "every prompt of the stream rests" in rows[0]["reason"]


def test_history_rebuilt_from_the_tables_equals_the_live_one_through_a_step(tmp_path):
    options = CurriculumOptions(kind="pass_rate", window=3)
    live = Curriculum(options)
    rounds = [(1, 1, {"a": [1.0, 0.0], "b": [1.0, 1.0]}), (1, 2, {"a": [1.0, 1.0], "c": [0.0, 0.0]}),
              (2, 1, {"b": [0.0, 1.0], "a": [0.0, 0.0]}), (3, 1, {"c": [1.0, 1.0]})]
    by_step: dict[int, tuple[list, list]] = {}
    for step, attempt, outcomes in rounds:
        rows, scores = scored(step, attempt, outcomes)
        if step <= 2:
            live.observe(rows, scores)
        kept = by_step.setdefault(step, ([], []))
        kept[0].extend(rows)
        kept[1].extend(scores)
    for step, (rows, scores) in by_step.items():
        write_table(tmp_path, "rollouts", step, [r.row() for r in rows], run_id="r")
        write_table(tmp_path, "scores", step, [s.row() for s in scores], run_id="r")
    rebuilt = PassHistory.from_rows(history_rows(tmp_path, through_step=2), 3, options.pass_reward)
    assert {k: list(v) for k, v in rebuilt.recent.items()} == {k: list(v) for k, v in live.history.recent.items()}
    assert list(rebuilt.recent[("e", "a")]) == [True, False, False]  # newest three, in scoring order
    (tmp_path / "empty" / "tables").mkdir(parents=True)
    assert history_rows(tmp_path / "empty", through_step=5) == []  # a run that never scored


def test_config_fields_reach_the_options_and_bad_values_name_the_field():
    rl = RLConfig(curriculum={"type": "pass_rate", "window": 5, "retest": 0.5, "pass_reward": 0.5})
    assert curriculum_options(rl, seed=9) == CurriculumOptions(kind="pass_rate", window=5, retest=0.5,
                                                               pass_reward=0.5, seed=9)
    for bad, field in [({"curriculum": {"type": "easy_first"}}, r"curriculum\.type"),
                       ({"curriculum": {"window": 0}}, r"curriculum\.window"),
                       ({"curriculum": {"retest": 0}}, r"curriculum\.retest"),
                       ({"curriculum": {"retest": 1.5}}, r"curriculum\.retest"), ({"prompt_pool": -1}, "prompt_pool")]:
        with pytest.raises(ValueError, match=field):
            RLConfig(**bad)


class SolvedStages:
    """Two completions per prompt: prompts 0-4 always solved, the others half right."""

    def __init__(self) -> None:
        self.fills = []
        self.sampled: list[str] = []

    def generate(self, examples, *, step, attempt, policy_version, previous):
        self.sampled += [e.example_id for e in examples]
        return [rollout(step=step, policy_version=policy_version, env=e.env, example_id=e.example_id,
                        group_id=f"s{step}a{attempt}g{i}", sample_id=f"s{step}a{attempt}g{i:04d}:{j}",
                        attempt=attempt, completion_text=str(int(int(e.example_id) < 5 or j)))
                for i, e in enumerate(examples) for j in range(2)]

    def score(self, examples, rollouts, *, step, previous):
        return [Score(run_id="r", step=step, sample_id=r.sample_id, group_id=r.group_id,
                      reward=float(r.completion_text), components={}, error=None) for r in rollouts]

    def select(self, fill, rows, options, *, step, empty):
        self.fills.append((step, fill))
        return select_step(fill, rows, options, step=step)


def test_the_rollout_source_skips_solved_prompts_and_hands_the_rows_to_the_filter_stage():
    stages = SolvedStages()
    rl = RLConfig(steps=3, prompts_per_step=5, curriculum={"type": "pass_rate", "window": 2, "retest": 0.01})
    options = rollout_options(rl)
    source = RolloutSource(options, PromptSource(examples(10), seed=0, shuffle=False), GroupBuffer(options.buffer),
                           stages, start_step=0, published_version=0,
                           curriculum=Curriculum(curriculum_options(rl, seed=0)))
    with source:
        batches = []
        for step in (1, 2, 3):  # each step trains, then the engines take its weights (as a run does)
            batches.append(source.batch(step))
            source.publish(step)
    assert stages.sampled[:10] == [str(i) for i in range(10)]  # step 1 meets every prompt once
    rested = [r for _, fill in stages.fills for r in fill.rested]
    retested = sorted(r["example_id"] for r in rested if r["status"] == "retested")
    assert sorted(e for e in stages.sampled[10:] if int(e) < 5) == retested  # solved ones: re-tests only
    assert len(rested) > 5 * len(retested) and len(stages.sampled[10:]) >= 10
    for _, fill in stages.fills:  # no prompt twice in a round: every group has its 2 completions
        assert all(len(g.sample_ids) == 2 for g in fill.batch)
    step3 = dict(stages.fills)[3]
    assert {r["example_id"] for r in step3.rested if r["status"] == "skipped"} == {str(i) for i in range(5)}
    assert batches[2].metrics["rollout/curriculum_skipped"] == len([r for r in step3.rested
                                                                     if r["status"] == "skipped"]) >= 5
