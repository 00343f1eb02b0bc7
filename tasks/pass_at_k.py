"""pass@k and maj@k of sampled evals (`eval.samples`): pure functions over `evals` rows.

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained
on Code"): from n samples of a prompt, c of them correct, the chance that at least one of k drawn
without replacement is correct, 1 - C(n-c, k) / C(n, k), averaged over prompts. It is computed as
the product 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the binomials (C(200, 100) has 59
digits), so it stays exact to float rounding for any n.

maj@k: the most common answer among a prompt's k samples (ties: the smallest answer text) is the
prompt's answer; the prompt counts when the samples giving it were judged correct. Only samples
whose environment gave a comparable answer (`evals.answer`) vote; a prompt without any scores 0.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `c` correct among `n` samples (1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_correct(samples: Iterable[tuple[str | None, bool]]) -> bool:
    """Whether the majority answer of (answer, correct) samples is a correct one (None: no answer)."""
    samples = list(samples)
    votes = Counter(answer for answer, _ in samples if answer is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = min(answer for answer, count in votes.items() if count == top)
    return any(correct for answer, correct in samples if answer == winner)


def sampled_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The sampled evals among `rows` (`sample` set; the greedy row has none)."""
    return [row for row in rows if row.get("sample") is not None]


def by_prompt(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    """Sampled rows grouped by (env, example_id)."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for row in sampled_rows(rows):
        groups[(str(row["env"]), str(row["example_id"]))].append(row)
    return dict(groups)


def pass_at_ks(rows: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """k -> mean pass@k over prompts, for k = 1 .. the fewest samples any prompt has; {} when none."""
    groups = by_prompt(rows)
    if not groups:
        return {}
    counts = [(len(group), sum(bool(row["correct"]) for row in group)) for group in groups.values()]
    top = min(n for n, _ in counts)
    return {k: sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) for k in range(1, top + 1)}


def maj_at_k(rows: Iterable[Mapping[str, Any]]) -> tuple[int, float] | None:
    """(k, share of prompts whose majority answer is correct) over each prompt's samples; None when
    no sample has a comparable answer."""
    groups = by_prompt(rows)
    if not any(row.get("answer") is not None for group in groups.values() for row in group):
        return None
    k = min(len(group) for group in groups.values())
    hits = sum(majority_correct((row.get("answer"), bool(row["correct"])) for row in group)
               for group in groups.values())
    return k, hits / len(groups)
