"""The statistics behind bench_trl's 'reward no worse' verdict."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.paired_stats import differences, estimate, no_worse, pooled_median, reward_verdict


def test_estimate_takes_the_larger_of_prompt_and_seed_error():
    # two runs that agree per prompt: the seed spread is 0, the prompt spread decides
    same = [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]]
    e = estimate(same)
    assert e["mean"] == 0.5 and e["se_seeds"] == 0.0
    assert e["se"] == pytest.approx(statistics.stdev([0, 1, 0, 1]) / 2)
    # runs that disagree as wholes: the seed spread dominates
    apart = [[0.0] * 4, [1.0] * 4]
    e = estimate(apart)
    assert e["se_prompts"] == 0.0 and e["se"] == pytest.approx(0.5)


def test_differences_pair_by_seed_and_prompt_and_broadcast_a_single_start():
    assert differences([[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0]]) == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(ValueError, match="as many runs"):
        differences([[1.0]], [[1.0], [2.0], [3.0]])
    with pytest.raises(ValueError, match="same N"):
        estimate([[1.0, 2.0], [1.0]])


def test_verdict_needs_both_figures_within_two_standard_errors():
    assert no_worse(-0.01, 0.01) and not no_worse(-0.03, 0.01) and no_worse(0.2, 0.0)
    good = {"correct": [1.0, 0.0, 1.0, 1.0], "sampled": [0.5, 0.5, 0.5, 0.5]}
    worse = {"correct": [0.0, 0.0, 0.0, 0.0], "sampled": [0.5, 0.5, 0.5, 0.5]}
    assert reward_verdict([good, good], [good, good])["reward_no_worse"]
    verdict = reward_verdict([worse, worse], [good, good])
    assert verdict["greedy_accuracy"]["delta"] == pytest.approx(-0.75)
    assert not verdict["reward_no_worse"] and verdict["sampled_reward"]["no_worse"]


def test_pooled_median_drops_each_runs_first_and_last_step():
    runs = [{"s": [9.0, 1.0, 2.0, 9.0]}, {"s": [9.0, 3.0, 9.0]}]
    assert pooled_median(runs, "s") == 2.0
