"""One seed per test that draws at random (kill points, data): `RLPIPE_TEST_SEED` replays a
failure, otherwise a fresh one is drawn; the test names it in each assertion message."""

from __future__ import annotations

import os
import random


def draw_seed(name: str) -> int:
    """The seed for `name`'s draws: `$RLPIPE_TEST_SEED` when set, else a fresh one; printed (pytest
    shows it beside a failure) with the line that replays it."""
    seed = int(os.environ["RLPIPE_TEST_SEED"]) if os.environ.get("RLPIPE_TEST_SEED") else random.randrange(1 << 30)
    print(f"{name}: seed {seed} (replay: RLPIPE_TEST_SEED={seed} pytest -k {name})")
    return seed
