"""The report's plots by step: each a dict of lines (one per run and style) built from a canned query's rows.

dashboards/report.py assembles them into the page; report.js draws them. A plot whose lines have
no value becomes a note (or is left out when optional).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

from rlpipe.core.phases import PHASES

Rows = list[dict[str, Any]]


def clean(value: Any) -> Any:
    """A JSON-ready cell: NaN/inf -> None, floats to 6 significant digits (the page stays small)."""
    if isinstance(value, Decimal):
        value = float(value)
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    return value


def by_run(rows: Rows, order: list[str]) -> list[tuple[str, Rows]]:
    """Rows grouped by run_id, in the runs' order."""
    grouped: dict[str, Rows] = {}
    for row in rows:
        grouped.setdefault(row["run_id"], []).append(row)
    return [(run_id, grouped[run_id]) for run_id in order if run_id in grouped]


def values(rows: Rows, column: str | Callable[[dict], Any]) -> list[Any]:
    get = column if callable(column) else (lambda row: row.get(column))
    return [clean(get(row)) for row in rows]


def series(rows: Rows, order: list[str], y: str | Callable, *, style: str = "solid",
           bands: Iterable[tuple[str | Callable, str | Callable]] = ()) -> list[dict]:
    """One line per run with a value: x = step, y = the column (or function of the row), bands (lo, hi)."""
    bands = list(bands)
    lines = [{"run_id": run_id, "style": style, "x": [row["step"] for row in run_rows],
              "y": values(run_rows, y),
              "bands": [{"lo": values(run_rows, lo), "hi": values(run_rows, hi)} for lo, hi in bands]}
             for run_id, run_rows in by_run(rows, order)]
    return [line for line in lines if any(value is not None for value in line["y"])]


def plot(key: str, title: str, query: str, lines: list[dict], *, y_label: str, subtitle: str = "",
         y_range: tuple[float, float] | None = None, percent: bool = False, optional: bool = False,
         small: bool = False) -> dict | None:
    """A plot's dict; a note instead when no line has a value (None when `optional`: left out)."""
    if not any(line["style"] == "solid" for line in lines):
        if optional:
            return None
        return {"id": key, "title": title, "query": query, "note": "No values in these runs."}
    return {"id": key, "title": title, "query": query, "subtitle": subtitle, "y_label": y_label,
            "series": lines, "y_range": y_range, "percent": percent, "small": small, "x_label": "step"}


PHASE_ORDER = ("pretrain", "sft", "rl")


def run_modes(rows: Rows) -> dict[str, str]:
    """run_id -> its training mode (the `mode` of its loss_by_step rows: pretrain, sft, rl)."""
    modes: dict[str, str] = {}
    for row in rows:
        if row.get("mode"):
            modes.setdefault(row["run_id"], row["mode"])
    return modes


def per_phase(build: Callable[[dict[str, Rows], list[str]], list[dict]], r: dict[str, Rows], order: list[str],
              modes: dict[str, str]) -> list[dict]:
    """A section's plots; when the runs are of several phases (a pipeline's SFT and RL folders),
    one plot per phase, each on that phase's own step axis (SFT step 40 is not RL step 40), titled
    and labelled with the phase, side by side in phase order."""
    phases = [phase for phase in PHASE_ORDER if any(modes.get(run_id) == phase for run_id in order)]
    if len(phases) < 2:
        return build(r, order)
    groups = [(phase, [run_id for run_id in order if modes.get(run_id) == phase]) for phase in phases]
    others = [run_id for run_id in order if modes.get(run_id) not in phases]  # no training rows
    built = [(phase, build(r, runs)) for phase, runs in groups] + ([(None, build(r, others))] if others else [])
    by_id: dict[str, list[dict]] = {}
    for phase, items in built:
        for item in items:
            if phase is not None:
                item = {**item, "title": f"{item['title']} · {phase.upper()}", "x_label": f"{phase.upper()} step"}
            by_id.setdefault(item["id"], []).append(item | {"id": f"{item['id']}_{phase or 'other'}"})
    return [item for items in by_id.values() for item in items]


def present(plots: Iterable[dict | None]) -> list[dict]:
    return [item for item in plots if item is not None]


def _within(value, low, high):
    """`value` clipped to [low, high]; None stays None."""
    if value is None or low is None or high is None:
        return value
    return min(max(value, low), high)


def reward_plots(r: dict[str, Rows], order: list[str]) -> list[dict]:
    rows = r["reward_by_step"]
    # ±1 std, kept within the rewards the step saw (a 0/1 reward's band stays in [0, 1])
    band = (lambda row: _within(_minus(row["reward_mean"], row["reward_std"]), row["reward_min"], row["reward_max"]),
            lambda row: _within(_plus(row["reward_mean"], row["reward_std"]), row["reward_min"], row["reward_max"]))
    return present([
        plot("reward", "Reward", "reward_by_step",
             series(rows, order, "reward_mean", bands=[band]) + series(rows, order, "reward_min", style="dotted")
             + series(rows, order, "reward_max", style="dotted"),
             y_label="reward", subtitle="mean; band ±1 std; dotted: min and max"),
        plot("reward_errors", "Reward function errors", "reward_by_step",
             series(rows, order, lambda row: row["n_errors"] / row["n"] if row["n"] else None),
             y_label="share of completions", y_range=(0, 1), percent=True,
             optional=not any(row["n_errors"] for row in rows)),
    ])


def group_plots(r: dict[str, Rows], order: list[str]) -> list[dict]:
    rows = r["zero_variance_by_step"]
    return present([
        plot("zero_variance", "Zero-variance groups", "zero_variance_by_step",
             series(rows, order, "zero_variance_fraction"), y_label="share of groups", y_range=(0, 1),
             percent=True, subtitle="groups whose completions all got one reward: no learning signal"),
        plot("attempts", "Sampling attempts per step", "zero_variance_by_step",
             series(rows, order, "attempts_total") + series(rows, order, "n_kept", style="dashed")
             + series(rows, order, "n_groups", style="dotted"),
             y_label="count", subtitle="solid: attempts; dashed: groups kept; dotted: groups"),
    ])


def completion_plots(r: dict[str, Rows], order: list[str]) -> list[dict]:
    rows = r["completion_length_by_step"]
    return present([
        plot("completion_length", "Completion length", "completion_length_by_step",
             series(rows, order, "tokens_mean", bands=[("tokens_p10", "tokens_p90"), ("tokens_p25", "tokens_p75")])
             + series(rows, order, "tokens_max", style="dotted"),
             y_label="tokens", subtitle="mean; bands p10–p90 and p25–p75; dotted: max"),
        plot("truncated", "Truncated completions", "completion_length_by_step",
             series(rows, order, "truncated_fraction"), y_label="share of completions",
             y_range=(0, 1), percent=True, subtitle="finish_reason = 'length': cut at the token limit"),
        plot("thinking", "Reasoning and answer", "thinking_by_step",
             series(r.get("thinking_by_step", []), order, "thinking_tokens_mean")
             + series(r.get("thinking_by_step", []), order, "answer_tokens_mean", style="dashed")
             + series(r.get("thinking_by_step", []), order, "cut_in_thinking_fraction", style="dotted"),
             y_label="tokens", optional=True,
             subtitle="solid: mean tokens of the <think> block; dashed: after </think>; "
                      "dotted: share cut inside the block"),
        plot("length_reward_corr", "Length–reward correlation", "length_vs_reward",
             series(r["length_vs_reward"], order, "length_reward_corr"), y_label="Pearson r", y_range=(-1, 1),
             subtitle="per step, over all scored completions"),
    ])


def optim_plots(r: dict[str, Rows], order: list[str]) -> list[dict]:
    rows = r["loss_by_step"]
    return present([
        plot("loss", "Loss", "loss_by_step", series(rows, order, "loss"), y_label="loss"),
        plot("grad_norm", "Gradient norm", "loss_by_step", series(rows, order, "grad_norm"),
             y_label="norm", subtitle="before clipping"),
        plot("lr", "Learning rate", "loss_by_step", series(rows, order, "lr"), y_label="lr"),
        plot("clip_fraction", "Clipped tokens", "loss_by_step", series(rows, order, "clip_fraction"),
             y_label="share of tokens", percent=True, optional=True),
        plot("ratio_mean", "Importance ratio", "loss_by_step", series(rows, order, "ratio_mean"),
             y_label="mean ratio", optional=True),
        plot("logprob_gap", "Trainer–generator log-prob gap", "loss_by_step",
             series(rows, order, "logprob_gap"), y_label="mean |Δ log-prob|", optional=True),
        plot("entropy", "Policy entropy", "loss_by_step", series(rows, order, "entropy"),
             y_label="nats", subtitle="mean over loss tokens; a fall to ~0 = collapse", optional=True),
        plot("kl", "KL to the reference policy", "loss_by_step", series(rows, order, "kl"),
             y_label="mean per-token estimate", optional=True),
    ])


def time_plots(r: dict[str, Rows], order: list[str]) -> list[dict]:
    rows = r["throughput_by_step"]
    phases = [plot(f"seconds_{phase}", f"Seconds: {phase}", "throughput_by_step",
                   series(rows, order, f"seconds_{phase}"), y_label="s", optional=True, small=True)
              for phase in PHASES]
    return present([
        plot("train_tps", "Training tokens/s", "throughput_by_step",
             series(rows, order, "train_tokens_per_second"), y_label="tokens/s"),
        plot("generate_tps", "Generation tokens/s", "throughput_by_step",
             series(rows, order, "generate_tokens_per_second"), y_label="tokens/s", optional=True,
             subtitle="completion tokens / generate seconds"),
        plot("seconds_total", "Seconds per step", "throughput_by_step",
             series(rows, order, "seconds_total"), y_label="s", subtitle="all phases; per phase below"),
        *phases,
    ])


def eval_plots(r: dict[str, Rows], order: list[str]) -> list[dict]:
    rows = r["eval_by_step"]
    envs = sorted({row["env"] for row in rows})
    plots = []
    if len(envs) > 1:
        plots.append(plot("eval_all", "Eval accuracy, all environments", "eval_by_step",
                          series(pooled(rows), order, "accuracy"), y_label="accuracy", y_range=(0, 1),
                          percent=True, subtitle="mean over environments, weighted by samples"))
    for env in envs:
        env_rows = [row for row in rows if row["env"] == env]
        if any(row["accuracy"] is not None for row in env_rows):
            plots.append(plot(f"eval_{env}", f"Eval accuracy: {env}", "eval_by_step",
                              series(env_rows, order, "accuracy"), y_label="accuracy", y_range=(0, 1), percent=True))
        else:  # an environment without a notion of correct: its mean reward
            plots.append(plot(f"eval_{env}", f"Eval reward: {env}", "eval_by_step",
                              series(env_rows, order, "reward_mean"), y_label="mean reward"))
    return present(plots + pass_at_k_plots(r.get("pass_at_k_by_step", []), order))


def pass_at_k_plots(rows: Rows, order: list[str]) -> list[dict | None]:
    """Per environment with sampled evals (eval.samples): pass@1, pass@K and maj@K over steps."""
    plots = []
    for env in sorted({row["env"] for row in rows}):
        mine = [row for row in rows if row["env"] == env]
        first = [row for row in mine if row["k"] == 1]
        last = [row for row in mine if row["k"] == row["samples"]]
        top = max(row["samples"] for row in mine)
        plots.append(plot(f"pass_at_k_{env}", f"Sampled evals: {env}", "pass_at_k_by_step",
                          series(first, order, "pass_at_k") + series(last, order, "pass_at_k", style="dashed")
                          + series(last, order, "maj_at_k", style="dotted"),
                          y_label="share of prompts", y_range=(0, 1), percent=True, optional=True,
                          subtitle=f"solid: pass@1; dashed: pass@{top}; dotted: maj@{top} "
                                   "(unbiased estimator over each prompt's samples)"))
    return plots


def pooled(rows: Rows) -> Rows:
    """eval_by_step rows pooled over environments: accuracy weighted by n, per (run_id, step)."""
    pooled: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row["accuracy"] is not None:
            total = pooled.setdefault((row["run_id"], row["step"]), [0.0, 0.0])
            total[0] += row["accuracy"] * row["n"]
            total[1] += row["n"]
    return [{"run_id": run_id, "step": step, "accuracy": hits / n}
            for (run_id, step), (hits, n) in sorted(pooled.items()) if n]


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b
