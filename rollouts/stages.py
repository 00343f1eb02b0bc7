"""The stages the rollout source runs (generate, score, filter/advantages), bound to one run.

rollouts/source.py drives sampling rounds and the group buffer without knowing Prefect or the
run directory; `RunStages` is what it calls: each method is one stage (a Prefect task run or a
plain call, see tasks/_prefect.py) that writes its own table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.engines.base import Engine
from rlpipe.envs.base import Environment, Example
from rlpipe.rollouts.advantages import AdvantageOptions
from rlpipe.rollouts.fates import Fill, Selection
from rlpipe.rollouts.generation import GenerateOptions, generate_stage
from rlpipe.rollouts.records import Rollout, Score
from rlpipe.rollouts.scoring import ScoreOptions, score_stage
from rlpipe.rollouts.selection import filter_stage


@dataclass(frozen=True)
class RunStages:
    """generate → score for a sampling round, and the filter/advantages record of a step."""

    engines: list[Engine]
    tokenizer: Any
    env: Environment
    generating: GenerateOptions
    """How each round samples (its seed derived per round from the run's)."""
    scoring: ScoreOptions
    """How each round is scored (the share of reward errors allowed, DAPO's overlong penalty)."""
    run_dir: Path
    run_id: str

    def generate(self, examples: list[Example], *, step: int, attempt: int, policy_version: int,
                 previous: list[Rollout]) -> list[Rollout]:
        return generate_stage(self.engines, self.tokenizer, self.env, examples, self.generating,
                              previous=previous, step=step, attempt=attempt, policy_version=policy_version,
                              run_dir=self.run_dir, run_id=self.run_id)

    def score(self, examples: dict[str, Example], rollouts: list[Rollout], *, step: int,
              previous: list[Score]) -> list[Score]:
        return score_stage(self.env, examples, rollouts, self.scoring, previous=previous, step=step,
                           run_dir=self.run_dir, run_id=self.run_id)

    def select(self, fill: Fill, rows: dict[str, Rollout], options: AdvantageOptions, *, step: int,
               empty: bool) -> Selection:
        return filter_stage(fill, rows, options, step=step, empty=empty, run_dir=self.run_dir, run_id=self.run_id)
