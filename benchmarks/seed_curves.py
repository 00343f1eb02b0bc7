"""What the multi-seed learning benchmarks share: a shipped config set up for one seeded run
(its own folder, tracking off, stages as plain calls), and a run's learning curve read back from
its tables.

    config = seeded_config("configs/demo.toml", root, "rl-0", seed=0, rl={"steps": 60})
    curve = eval_curve(config.run_dir / "rl")     # [{"step", "sampled", "accuracy", "reward_mean"}, ...]
    seed = pipeline_seed("configs/multiturn.toml", root, seed=0, sft={}, rl={})  # SFT then RL, measured
    reached = first_reaching(curve, 0.95)          # the first point at or above it, or None
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CURVE_SQL = """
WITH sampled AS (SELECT step, count(*) AS n FROM rollouts GROUP BY step),
     evals AS (SELECT step, accuracy, reward_mean FROM ({eval_by_step}))
SELECT e.step,
       CAST(coalesce((SELECT sum(n) FROM sampled s WHERE s.step <= e.step), 0) AS BIGINT) AS sampled,
       e.accuracy, e.reward_mean
FROM evals e ORDER BY e.step
"""


def seeded_config(path: str | Path, root: Path, name: str, seed: int, **sections: dict[str, Any]) -> dict:
    """The config file at `path` (relative to the repository) as a dict for one run named `name`
    under `root` with `seed`, tracking off, and each of `sections` (e.g. rl={...}) laid over the
    file's table of that name."""
    config = tomllib.loads((ROOT / path).read_text())
    config.update(runs_root=str(root), run_name=name, seed=seed)
    config["tracking"] = {"enabled": False, "report": False, "prefect_task_runs": False}
    for key, values in sections.items():
        config[key] = {**config.get(key, {}), **values}
    return config


def eval_curve(run_dir: Path) -> list[dict[str, Any]]:
    """Per greedy eval of an RL run: its step, the completions sampled through that step, and the
    held-out accuracy and mean reward (all environments together)."""
    from rlpipe.storage.queries import canned_sql, run_sql

    by_step = (f"SELECT step, sum(accuracy * n) / sum(n) AS accuracy, sum(reward_mean * n) / sum(n) AS reward_mean "
               f"FROM ({canned_sql('eval_by_step')}) GROUP BY step")
    return run_sql([run_dir], CURVE_SQL.format(eval_by_step=by_step)).to_pylist()


def pipeline_seed(path: str | Path, root: Path, seed: int, **sections: dict[str, Any]) -> dict[str, Any]:
    """One seed of a shipped pipeline config (SFT, then RL from its checkpoint): held-out greedy
    accuracy and mean reward after each phase, the RL curve, each phase's seconds, and the RL
    run's folder."""
    import time

    import torch
    from rlpipe.flows.rl import run_rl
    from rlpipe.flows.supervised import run_supervised
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    config = validate_config(seeded_config(path, root, f"seed-{seed}", seed, **sections))
    began = time.perf_counter()
    sft = run_supervised(config, "sft")
    sft_seconds, began = time.perf_counter() - began, time.perf_counter()
    rl = run_rl(config, start_checkpoint=str(sft["checkpoint"]))
    return {"seed": seed, "sft_accuracy": sft["eval"].get("eval/accuracy"),
            "sft_reward": sft["eval"].get("eval/reward_mean"), "sft_seconds": sft_seconds,
            "rl_accuracy": rl["eval"].get("eval/accuracy"), "rl_reward": rl["eval"].get("eval/reward_mean"),
            "rl_seconds": time.perf_counter() - began, "curve": eval_curve(config.run_dir / "rl"),
            "run_dir": str(config.run_dir / "rl")}


def first_reaching(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point of `curve` whose accuracy is at least `target`, or None."""
    return next((point for point in curve if point["accuracy"] is not None and point["accuracy"] >= target), None)
