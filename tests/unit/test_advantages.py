"""Advantage estimators, zero-variance filtering, and the over-sampling group buffer."""

from __future__ import annotations

import json
import math

import pytest
from rlpipe.rollouts.advantages import (
    Group,
    compute_advantages,
    group_advantages,
    group_row,
    group_stats,
    make_groups,
)
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.group_buffer import BatchFillError, GroupBuffer
from rlpipe.rollouts.options import rollout_options


def fill_batch(buffer, version, sample):
    buffer.fill(version, sample)
    return buffer.take()


def BufferConfig(groups_per_batch, max_off_policy_steps=0, **buffer):  # noqa: N802 - reads like the section it builds
    rl = RLConfig(prompts_per_step=groups_per_batch, buffer=buffer, off_policy={"max_steps": max_off_policy_steps})
    return rollout_options(rl).buffer


def _close(a, b):
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=1e-9) for x, y in zip(a, b, strict=True)
    )


def test_grpo_hand_computed():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]  # mean 0.6, std sqrt(0.24)
    assert _close(compute_advantages(rewards, "grpo"), [0.4, -0.6, -0.6, 0.4, 0.4])
    std = math.sqrt(0.24)
    assert _close(
        compute_advantages(rewards, "grpo", normalize_std=True, eps=0.0),
        [0.4 / std, -0.6 / std, -0.6 / std, 0.4 / std, 0.4 / std],
    )
    assert _close(compute_advantages(rewards, "grpo", positive_only=True), [0.4, 0, 0, 0.4, 0.4])


def test_rloo_hand_computed():
    rewards = [1.0, 0.0, 0.5, 0.5]
    # leave-one-out baselines: 1/3, 2/3, 1/2, 1/2
    expected = [1 - 1 / 3, 0 - 2 / 3, 0.0, 0.0]
    assert _close(compute_advantages(rewards, "rloo"), expected)
    assert _close(compute_advantages(rewards, "rloo", positive_only=True), [2 / 3, 0, 0, 0])


def test_groups_of_one_and_all_equal():
    for est in ("grpo", "rloo"):
        assert compute_advantages([0.7], est) == [0.0]
        assert compute_advantages([1.0, 1.0, 1.0], est, normalize_std=True) == [0.0, 0.0, 0.0]
    assert group_stats([0.7]).zero_variance
    assert group_stats([1.0, 1.0]).zero_variance
    assert not group_stats([1.0, 0.0]).zero_variance
    s = group_stats([1.0, 0.0])
    assert (s.n, s.mean, s.std) == (2, 0.5, 0.5)
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages([1.0, 0.0], "ppo")
    with pytest.raises(ValueError, match="empty"):
        group_stats([])


def _rows(example_id, rewards, version=0, prefix="s"):
    return [
        {
            "group_id": f"g-{example_id}-{version}",
            "env": "arithmetic",
            "example_id": example_id,
            "policy_version": version,
            "sample_id": f"{prefix}-{example_id}-{i}",
            "reward": r,
        }
        for i, r in enumerate(rewards)
    ]


def test_make_groups_and_group_advantages():
    rows = _rows("a", [1, 0]) + _rows("b", [1, 1]) + _rows("a", [1], version=1)
    groups = make_groups(rows, attempt=2)
    assert [g.key for g in groups] == [
        ("arithmetic", "a", 0),
        ("arithmetic", "b", 0),
        ("arithmetic", "a", 1),
    ]
    assert groups[0].sample_ids == ["s-a-0", "s-a-1"] and groups[0].attempt == 2
    adv = group_advantages(groups[:1], rollout_options(RLConfig(advantages={"estimator": "rloo"})).advantages)
    assert adv == {"s-a-0": 1.0, "s-a-1": -1.0}
    row = group_row(groups[1])
    assert row["zero_variance"] and row["n"] == 2 and row["reward_mean"] == 1.0


def _group(i, rewards, version=0, attempt=1):
    return Group(
        group_id=f"g{i}",
        env="arithmetic",
        example_id=f"e{i}",
        policy_version=version,
        sample_ids=[f"g{i}-{j}" for j in range(len(rewards))],
        rewards=list(rewards),
        attempt=attempt,
    )


def test_buffer_drops_zero_variance_and_counts():
    buf = GroupBuffer(BufferConfig(groups_per_batch=3))
    buf.start_batch(0)
    decisions = buf.add([_group(0, [1, 1]), _group(1, [1, 0]), _group(2, [0]), _group(3, [0, 1])])
    assert [d.status for d in decisions] == ["zero_variance", "valid", "zero_variance", "valid"]
    assert buf.need() == 1
    buf.add([_group(4, [0, 0.5])])
    batch, metrics = buf.take()
    assert [g.group_id for g in batch] == ["g1", "g3", "g4"]
    assert metrics["rollout/zero_var_groups"] == 2
    assert metrics["rollout/valid_groups"] == 3
    assert metrics["rollout/zero_var_fraction"] == 2 / 5


def test_fill_batch_oversamples_carries_surplus_and_round_trips_json():
    cfg = BufferConfig(groups_per_batch=3, oversample_factor=2.0, max_staleness=1)
    buf = GroupBuffer(cfg)
    requested = []

    def sample(attempt, n):
        requested.append((attempt, n))
        # every other group has zero variance
        return [_group(100 * attempt + i, [1, 1] if i % 2 else [1, 0]) for i in range(n)]

    batch, metrics = fill_batch(buf, 0, sample)
    assert requested == [(1, 6)]  # 3 needed × 2: 3 valid, 3 zero-variance → full
    assert len(batch) == 3 and metrics["rollout/attempts_per_batch"] == 1
    assert metrics["rollout/carried_groups"] == 0

    requested.clear()
    buf2 = GroupBuffer(cfg)
    buf2.start_batch(0)
    buf2.add([_group(i, [0, 1]) for i in range(5)])  # 2 surplus
    batch, metrics = buf2.take()
    assert [g.group_id for g in batch] == ["g0", "g1", "g2"]
    assert metrics["rollout/carried_groups"] == 2

    state = json.loads(json.dumps(buf2.state_dict()))
    restored = GroupBuffer(cfg)
    restored.load_state_dict(state)
    assert restored.pending == buf2.pending
    assert restored.total_counts == buf2.total_counts

    batch, metrics = fill_batch(restored, 1, sample)
    assert requested == [(1, 2)]  # only the missing group, over-sampled
    assert [g.group_id for g in batch][:2] == ["g3", "g4"]  # carried groups first
    assert metrics["rollout/attempts_per_batch"] == 1


def test_staleness_and_latest_only_retention():
    buf = GroupBuffer(BufferConfig(groups_per_batch=10, max_staleness=1))
    buf.start_batch(0)
    buf.add([_group(0, [0, 1], version=0), _group(1, [0, 1], version=0)])
    buf.start_batch(1)
    assert len(buf.pending) == 2  # one version old: kept
    newer = _group(0, [1, 0], version=1)
    newer.group_id = "g0-v1"
    buf.add([newer])  # same example, newer policy: replaces the old group
    assert sorted(g.group_id for g in buf.pending) == ["g0-v1", "g1"]
    buf.add([_group(0, [0, 1], version=0)])  # older than what is held for e0: dropped
    assert len(buf.pending) == 2
    buf.start_batch(3)  # both are now too old
    assert buf.pending == []
    _, metrics = buf.take()
    assert metrics["rollout/stale_dropped"] == 2
    assert buf.total_counts["stale_dropped"] == 4  # replaced, refused, 2 too old

    no_carry = GroupBuffer(BufferConfig(groups_per_batch=1, max_staleness=0))
    no_carry.start_batch(0)
    no_carry.add([_group(0, [0, 1]), _group(1, [0, 1])])
    no_carry.take()
    no_carry.start_batch(1)
    assert no_carry.pending == []


def test_staleness_bound_is_the_larger_of_carry_and_async_bounds():
    buf = GroupBuffer(BufferConfig(groups_per_batch=10, max_staleness=1, max_off_policy_steps=2))
    buf.start_batch(0)
    buf.add([_group(0, [0, 1], version=0)])
    assert buf.start_batch(2) == [] and len(buf.pending) == 1  # lag 2 <= max(1, 2)
    stale = buf.start_batch(3)
    assert [d.status for d in stale] == ["stale"] and buf.pending == []


def test_partial_batches_train_on_what_the_rounds_found():
    buf = GroupBuffer(BufferConfig(groups_per_batch=4, max_attempts=2, partial_batches=True))
    batch, metrics = fill_batch(buf, 0, lambda attempt, n: [_group(10 * attempt, [0, 1]),
                                                            _group(10 * attempt + 1, [1, 1])])
    assert len(batch) == 2 and metrics["rollout/attempts_per_batch"] == 2


def test_max_attempts_raises_clear_error():
    buf = GroupBuffer(BufferConfig(groups_per_batch=16, max_attempts=4))
    calls = []

    def all_zero_variance(attempt, n):
        calls.append(attempt)
        return [_group(100 * attempt + i, [1, 1, 1]) for i in range(n)]

    with pytest.raises(BatchFillError) as err:
        fill_batch(buf, 0, all_zero_variance)
    assert calls == [1, 2, 3, 4]
    msg = str(err.value)
    assert "could not fill 16 groups with non-zero reward variance after 4 attempts" in msg
    assert "400 had zero variance" in msg  # rounds grow as the valid share stays at 0


def test_config_validation():
    with pytest.raises(ValueError, match="oversample_factor"):
        BufferConfig(groups_per_batch=2, oversample_factor=0.5)
    with pytest.raises(ValueError, match="estimator"):
        RLConfig(advantages={"estimator": "ppo"})


def test_prompts_to_sample_scales_with_the_valid_share():
    buffer = GroupBuffer(BufferConfig(groups_per_batch=10, oversample_factor=1.0, max_attempts=5))
    buffer.start_batch(0)
    assert buffer.prompts_to_sample() == 10  # nothing sampled yet: the plain need
    buffer.begin_attempt()
    groups = [Group(f"g{i}", "e", str(i), 0, ["a", "b"], [1.0, 0.0] if i < 2 else [1.0, 1.0]) for i in range(10)]
    buffer.add(groups)  # 2 valid of 10
    assert buffer.need() == 8
    assert buffer.prompts_to_sample() == 40  # 8 needed at a 20% valid share
    assert buffer.prompts_to_sample(max_boost=2.0) == 16
