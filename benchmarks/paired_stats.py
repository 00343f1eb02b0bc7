"""Statistics of bench_trl's reward comparison: means with standard errors over prompts and seeds,
paired differences, and a non-inferiority verdict. Pure functions over per-prompt figures.

Non-inferiority (rlpipe is not worse than TRL by more than a margin δ): with d = rlpipe − TRL,
paired by seed and prompt, and its standard error SE (`estimate`), the one-sided 95% lower bound
d − t·SE must clear −δ (t from Student's t with S − 1 degrees of freedom when the seed spread
sets SE, else ~normal). [d − t·SE, d + t·SE] is the two-sided 90% confidence interval that goes
with it. Verdicts: `non-inferior` (lower bound > −δ), `inferior` (upper bound < −δ), else
`inconclusive` (more seeds needed). A significance test of d = 0 answers another question: with
enough seeds any tiny gap is 'significant', and with few none is.
"""

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


# one-sided 95% quantiles of Student's t by degrees of freedom (1.645 beyond 30)
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
        10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 25: 1.708, 30: 1.697}
MARGIN = 0.02  # greedy accuracy (and mean sampled reward, both in [0, 1])


def t95(df: int) -> float:
    """One-sided 95% t quantile for `df` degrees of freedom (the table's next lower df: conservative)."""
    if df < 1:
        raise ValueError(f"t95 needs df >= 1, got {df}")
    if df > 30:
        return 1.645
    return _T95[max(k for k in _T95 if k <= df)]


def non_inferiority(a: list[list[float]], b: list[list[float]], margin: float = MARGIN) -> dict:
    """Is `a` non-inferior to `b` by `margin`? Per-prompt figures [S][N] of each side, paired by
    seed and prompt; returns the delta, its SE, the 90% CI, the margin and the verdict."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    e = estimate(differences(a, b), "delta")
    seeds_rule = e["se_seeds"] is not None and e["se_seeds"] >= e["se_prompts"]
    df = len(a) - 1 if seeds_rule else len(a[0]) - 1
    t = t95(max(df, 1))
    low, high = e["delta"] - t * e["se"], e["delta"] + t * e["se"]
    verdict = "non-inferior" if low > -margin else "inferior" if high < -margin else "inconclusive"
    return {**e, "margin": margin, "ci90": [low, high], "t": t, "df": df, "verdict": verdict,
            "non_inferior": verdict == "non-inferior"}


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


def reward_verdict(rlpipe: list[dict], trl: list[dict], margin: float = MARGIN) -> dict:
    """rlpipe minus TRL on both figures (paired by seed and prompt), each with its non-inferiority
    test at `margin`; the verdict is greedy accuracy's (the primary figure)."""
    figures = {figure: non_inferiority([run[key] for run in rlpipe], [run[key] for run in trl], margin)
               for figure, key in FIGURES.items()}
    primary = figures["greedy_accuracy"]
    return {**figures, "margin": margin, "primary": "greedy_accuracy", "verdict": primary["verdict"],
            "non_inferior": primary["non_inferior"]}


def pooled_median(runs: list[dict], key: str) -> float | None:
    """Median over every seed's steps 2 .. N-1 of a per-step series."""
    window = [x for r in runs if r.get(key) for x in (r[key][1:-1] if len(r[key]) >= 3 else r[key])]
    return statistics.median(window) if window else None
