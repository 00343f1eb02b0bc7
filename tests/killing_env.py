"""An environment whose reward kills the worker process scoring it, for the tests of the score
stage on a cluster (tests/integration/test_cluster_scoring_run.py). A module of the `tests`
package, not of the test file: a Ray worker imports it by name from the repository root, its
working directory, where the test file's own folder is not on its path."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from rlpipe.envs.arithmetic import ArithmeticEnv


class KillingEnv(ArithmeticEnv):
    """Arithmetic whose reward SIGKILLs its own worker process the first time any worker reaches
    the rollout `victim` (a marker file remembers it), or every time when `always`; in the
    process that made it, it only scores."""

    def __init__(self, marker: Path, victim: str, always: bool = False) -> None:
        super().__init__()
        self.marker, self.victim, self.always, self.home = marker, victim, always, os.getpid()

    def reward(self, example, transcript):
        if (example.example_id == self.victim and os.getpid() != self.home
                and (self.always or not self.marker.exists())):
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().reward(example, transcript)
