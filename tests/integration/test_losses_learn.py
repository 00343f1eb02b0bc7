"""Every RL loss (and the KL variant) learns a trivially learnable task from a random start: the
learning check behind benchmarks/bench_losses.py's table, at test size."""

from __future__ import annotations

import pytest

from benchmarks.bench_losses import VARIANTS, learning_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_raises_reward(variant):
    run = learning_run(variant, seed=0, steps=30, task="digits")
    # a random policy writes ~20% digits; every loss reaches > 50% within 30 steps
    assert run["gain"] > 0.3, (variant, run["rewards"])
    measured = [e for e in run["entropy"] if e is not None]
    assert measured and all(e >= 0 for e in measured)
