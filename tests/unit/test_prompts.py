"""PromptSource: deterministic epoch shuffling, epoch crossing, state round trip."""

from __future__ import annotations

import json

import pytest
from rlpipe.envs.base import Example
from rlpipe.envs.prompts import PromptSource


def _examples(n):
    return [Example("t", str(i), f"p{i}", i, {}) for i in range(n)]


def _ids(batch):
    return [ex.example_id for ex in batch]


def test_epochs_are_permutations_and_deterministic():
    examples = _examples(10)
    a, b = PromptSource(examples, seed=3), PromptSource(examples, seed=3)
    first, second = _ids(a.next_batch(10)), _ids(a.next_batch(10))
    assert sorted(first) == sorted(second) == sorted(ex.example_id for ex in examples)
    assert first != second  # each epoch reshuffled (seed + epoch)
    assert _ids(b.next_batch(20)) == first + second
    assert _ids(PromptSource(examples, seed=4).next_batch(10)) != first
    assert _ids(PromptSource(examples, shuffle=False).next_batch(3)) == ["0", "1", "2"]


def test_batches_cross_epochs_and_default_batch_size():
    src = PromptSource(_examples(5), batch_size=3, seed=0)
    batches = [_ids(src.next_batch()) for _ in range(4)]  # 12 = 2 epochs + 2
    flat = sum(batches, [])
    assert sorted(flat[:5]) == sorted(flat[5:10]) == [str(i) for i in range(5)]
    assert src.epoch == 2 and src.offset == 2
    big = PromptSource(_examples(2), seed=0).next_batch(7)  # larger than the dataset
    assert len(big) == 7


def test_state_round_trip_through_json():
    examples = _examples(7)
    src = PromptSource(examples, seed=11)
    src.next_batch(5)
    src.next_batch(4)  # into epoch 1
    state = json.loads(json.dumps(src.state_dict()))
    expected = _ids(src.next_batch(9))
    resumed = PromptSource(examples, seed=0)
    resumed.load_state_dict(state)
    assert _ids(resumed.next_batch(9)) == expected
    with pytest.raises(ValueError, match="dataset changed"):
        PromptSource(_examples(8)).load_state_dict(state)


def test_empty_and_bad_arguments():
    with pytest.raises(ValueError, match="empty"):
        PromptSource([])
    with pytest.raises(ValueError, match="k >= 1"):
        PromptSource(_examples(3)).next_batch()
