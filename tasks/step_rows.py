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


def trained_samples(samples) -> int:
    """Completions of a step's batch that carry a training signal: a non-zero advantage (a kept
    zero-variance group's completions have none, so they change no weight)."""
    return sum(1 for sample in samples if sample.advantage != 0)


def decided_fates(rollout: dict[str, float]) -> dict[str, int]:
    """Completions whose fate a step decided, per status (its rollout/fate_* counters; `carried`
    left out: those still wait for a later step)."""
    prefix = m.fate("")
    return {key[len(prefix):]: int(value) for key, value in rollout.items()
            if key.startswith(prefix) and key != m.fate("carried") and value}


def trained_share(trained: int, rollout: dict[str, float]) -> str:
    """The progress line's `trained` field: the share of the completions the step decided that it
    trained on, with both counts ("25% of 64")."""
    decided = sum(decided_fates(rollout).values())
    return f"{trained / decided:.0%} of {decided}" if decided else "0 of 0"


def untrained_step_warning(step: int, rollout: dict[str, float]) -> str:
    """The warning line of a step that trained on no completion: what became of its completions."""
    fates = ", ".join(f"{status} {n}" for status, n in sorted(decided_fates(rollout).items(), key=lambda kv: -kv[1]))
    return (f"rlpipe: warning: RL step {step} trained on no sample, its weights are unchanged "
            f"(its completions' fates: {fates or 'none sampled'}); rewards must differ within a group to train")


def trained_before(run_dir, step: int) -> bool:
    """Whether any step of a run up to `step` trained on a sample (its `train_steps` rows: a step
    that trained nothing has 0 tokens); False for a run that has not started."""
    if step <= 0:
        return False
    from rlpipe.storage.writer import read_table

    rows = read_table(run_dir, "train_steps").select(["step", "tokens"]).to_pylist()
    return any(row["tokens"] and row["step"] <= step for row in rows)
