"""The rows and metrics a training step reports: its `train_steps` row and its MLflow metrics
(train/*, rollout/*, perf/*; names from core/metric_names.py), the same for RL and supervised steps.
"""

from __future__ import annotations

from rlpipe.core import metric_names as m
from rlpipe.core.phases import PHASES


def train_step_row(run_id: str, step: int, mode: str, metrics: dict, seconds: dict[str, float]) -> dict:
    row = {
        "run_id": run_id, "step": step, "mode": mode,
        "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "lr": metrics.get("lr"),
        "tokens": int(metrics.get("tokens", 0)),
        "tokens_per_second": metrics.get("tokens_per_second"),
        "clip_fraction": metrics.get("clip_fraction"), "ratio_mean": metrics.get("ratio_mean"),
        "logprob_gap": metrics.get("logprob_gap"),
        "entropy": metrics.get("entropy"), "kl": metrics.get("kl"),
    }
    for phase in PHASES:
        row[f"seconds_{phase}"] = seconds.get(phase)
    row["seconds_total"] = sum(seconds.values())
    return row


def step_metrics(train: dict, rollout: dict[str, float], seconds: dict[str, float]) -> dict[str, float]:
    """The MLflow metrics of one RL step: train/*, rollout/*, perf/* (core.metric_names)."""
    out = {m.train(k): float(v) for k, v in train.items() if isinstance(v, int | float)
           and k not in ("seconds", "tokens_per_second", "compile_seconds")}
    out |= {k: float(v) for k, v in rollout.items()}
    out[m.TOKENS_PER_SECOND] = float(train.get("tokens_per_second", 0.0))
    if "compile_seconds" in train:  # only a step that compiled (train.compile) has it
        out[m.COMPILE_SECONDS] = float(train["compile_seconds"])
    out |= {m.seconds(k): v for k, v in seconds.items()}
    out[m.SECONDS_TOTAL] = sum(seconds.values())
    return out
