"""Statistics of bench_trl's reward comparison: means with standard errors over prompts and seeds,
paired differences, and the 'no worse' verdict. Pure functions over per-prompt figures."""

from __future__ import annotations

import statistics


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample stdev / sqrt(n); 0 for fewer than 2 values)."""
    if not values:
        raise ValueError("mean_se needs at least one value")
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return statistics.mean(values), se


def estimate(by_seed: list[list[float]], name: str = "mean") -> dict:
    """A figure measured per prompt in each of S runs, [S][N] (the same N prompts): its mean and a
    standard error covering both the prompts and the run-to-run spread, the larger of the SE over
    prompts of the seed-averaged values and the SE of the S run means (S >= 2 only; one run shows
    no spread, and a few runs can show too little by chance)."""
    if not by_seed or not by_seed[0] or any(len(v) != len(by_seed[0]) for v in by_seed):
        raise ValueError(f"estimate needs S >= 1 runs of the same N >= 1 prompts, got {[len(v) for v in by_seed]}")
    mean, se_prompts = mean_se([statistics.mean(column) for column in zip(*by_seed, strict=True)])
    run_means = [statistics.mean(v) for v in by_seed]
    se_seeds = mean_se(run_means)[1] if len(by_seed) > 1 else None
    return {name: mean, "se": max(se_prompts, se_seeds or 0.0), "se_prompts": se_prompts, "se_seeds": se_seeds,
            "by_seed": run_means}


def differences(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """a - b per seed and prompt, [S][N]; a single run `b` (the start) is subtracted from every seed's."""
    b = b * len(a) if len(b) == 1 else b
    if len(a) != len(b):
        raise ValueError(f"differences needs as many runs on both sides, got {len(a)} and {len(b)}")
    return [[x - y for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]


def no_worse(delta: float, se: float, k: float = 2.0) -> bool:
    """'No worse': the delta is positive or within `k` standard errors of zero."""
    return delta >= -k * se


FIGURES = {"greedy_accuracy": "correct", "sampled_reward": "sampled"}  # report name -> evaluator's key


def summarize_eval(by_seed: list[dict], start: dict | None) -> dict:
    """One side's runs ([S] evaluator outputs): each figure's mean and SE (`estimate`), and with
    `start`, the gain over it (paired by prompt)."""
    out = {}
    for figure, key in FIGURES.items():
        value = estimate([run[key] for run in by_seed])
        out |= {figure: value["mean"], f"{figure}_se": value["se"], f"{figure}_by_seed": value["by_seed"]}
    if start is not None:
        out["gain_over_start"] = {figure: estimate(differences([run[key] for run in by_seed], [start[key]]), "delta")
                                  for figure, key in FIGURES.items()}
    return out


def reward_verdict(rlpipe: list[dict], trl: list[dict], k: float = 2.0) -> dict:
    """rlpipe minus TRL on both figures (paired by seed and prompt), and 'reward no worse' = every
    delta >= -k standard errors."""
    figures = {figure: estimate(differences([run[key] for run in rlpipe], [run[key] for run in trl]), "delta")
               for figure, key in FIGURES.items()}
    for figure in figures.values():
        figure["no_worse"] = no_worse(figure["delta"], figure["se"], k)
    return {**figures, "k_se": k, "reward_no_worse": all(f["no_worse"] for f in figures.values())}


def pooled_median(runs: list[dict], key: str) -> float | None:
    """Median over every seed's steps 2 .. N-1 of a per-step series."""
    window = [x for r in runs if r.get(key) for x in (r[key][1:-1] if len(r[key]) >= 3 else r[key])]
    return statistics.median(window) if window else None
