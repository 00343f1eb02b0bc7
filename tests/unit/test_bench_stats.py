"""The statistics behind bench_trl's 'reward no worse' verdict."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.paired_stats import (
    differences,
    estimate,
    no_worse,
    non_inferiority,
    pooled_median,
    reward_verdict,
    t95,
)


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


def test_non_inferiority_by_hand():
    # 4 seeds x 2 prompts, rlpipe − TRL = −0.01 everywhere but one seed's prompt 0 (−0.03)
    trl = [[0.5, 0.5]] * 4
    rl = [[0.49, 0.49], [0.49, 0.49], [0.47, 0.49], [0.49, 0.49]]
    v = non_inferiority(rl, trl, margin=0.02)
    assert v["delta"] == pytest.approx(-0.0125)
    # SE: over prompts of the seed means (−0.015, −0.01): 0.0025; over seeds' run means
    # (−0.01, −0.01, −0.02, −0.01): 0.0025: seeds rule, t(3 df) = 2.353
    assert v["se"] == pytest.approx(0.0025) and v["df"] == 3 and v["t"] == 2.353
    assert v["ci90"] == pytest.approx([-0.0125 - 2.353 * 0.0025, -0.0125 + 2.353 * 0.0025])
    assert v["verdict"] == "non-inferior"  # −0.0184 > −0.02
    assert non_inferiority(rl, trl, margin=0.015)["verdict"] == "inconclusive"
    assert non_inferiority([[0.0, 0.0]] * 4, trl, margin=0.02)["verdict"] == "inferior"
    with pytest.raises(ValueError, match="margin"):
        non_inferiority(rl, trl, margin=0.0)
    assert t95(40) == 1.645 and t95(11) == 1.812


def test_verdict_is_greedy_accuracy_non_inferiority():
    assert no_worse(-0.01, 0.01) and not no_worse(-0.03, 0.01) and no_worse(0.2, 0.0)
    good = {"correct": [1.0, 0.0, 1.0, 1.0], "sampled": [0.5, 0.5, 0.5, 0.5]}
    worse = {"correct": [0.0, 0.0, 0.0, 0.0], "sampled": [0.5, 0.5, 0.5, 0.5]}
    assert reward_verdict([good, good], [good, good], margin=0.02)["verdict"] == "non-inferior"  # d = 0, SE 0
    verdict = reward_verdict([worse, worse], [good, good])
    assert verdict["greedy_accuracy"]["delta"] == pytest.approx(-0.75)
    assert verdict["verdict"] == "inferior" and not verdict["non_inferior"]


def test_pooled_median_drops_each_runs_first_and_last_step():
    runs = [{"s": [9.0, 1.0, 2.0, 9.0]}, {"s": [9.0, 3.0, 9.0]}]
    assert pooled_median(runs, "s") == 2.0
