"""The report's rollout sections: the fate of sampled completions per step, and the rollout browser.

Both read the `fates` view (one row per sampled completion: its final status and reason) through
canned queries, fates_by_step.sql and rollout_browser.sql, so `rlpipe sql --query NAME` shows the
same rows. A run whose `fates` view is empty or missing (written before fates were recorded)
gets a stand-in derived from `groups.status`, flagged with a visible note.

The browser inlines every completion compactly: columnar JSON, group-level values (group id,
prompt, step, policy version) stored once per group, repeated strings (status, reason,
finish_reason, env) as indexes into a list of distinct values, and texts cut to a length chosen
so that all texts together stay within TEXT_BUDGET characters (short texts are never cut).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Hashable, Iterable
from typing import Any

import duckdb

Rows = list[dict[str, Any]]

PENDING = "pending"  # the queries' status of a completion without a decision yet (its step was being filled)
# the fates in the order they stack, each with its colour (docs/DESIGN.md, "Steps and versions")
FATES: tuple[tuple[str, str], ...] = (
    ("trained", "#2ca02c"),
    ("carried", "#1f77b4"),
    ("zero_variance", "#9aa3ae"),
    ("stale", "#8c564b"),
    ("over_cap", "#9467bd"),
    ("reward_error", "#d62728"),
    ("truncated", "#ff7f0e"),
    ("cut_in_thinking", "#bcbd22"),
    ("filtered", "#e377c2"),
    (PENDING, "#d9dde3"),
)
OTHER_COLOR = "#4d4d4d"  # a status outside FATES (a newer rlpipe): still drawn, never dropped
MAX_BROWSER_ROWS = 100_000  # more: whole steps are left out, evenly spread, with a note
TEXT_BUDGET = 4_000_000  # characters of all inlined texts together
MIN_TEXT, MAX_TEXT = 300, 4000  # bounds of the per-text cut

# The stand-in for runs without fates: a group's newest `groups` row is its fate (a carried
# group gets a row again at the step that trains or drops it); a reward error overrides it.
FATES_FROM_GROUPS = """
CREATE OR REPLACE TEMP VIEW fates AS
WITH last AS (
    SELECT run_id, group_id, max(step) AS decided_step,
           arg_max(coalesce(status, CASE WHEN zero_variance THEN 'zero_variance'
                                         WHEN kept THEN 'trained' ELSE 'carried' END), step) AS status,
           arg_max(reward_std, step) AS reward_std
    FROM groups GROUP BY ALL
)
SELECT r.run_id, r.sample_id, r.group_id, r.step, r.policy_version,
       CASE WHEN s.error IS NOT NULL THEN 'reward_error' ELSE coalesce(l.status, 'carried') END AS status,
       CASE WHEN s.error IS NOT NULL THEN 'reward function failed: ' || s.error
            WHEN l.status IS NULL THEN 'no group decision recorded: the run ended first'
            WHEN l.status = 'trained' THEN 'trained at step ' || l.decided_step
            WHEN l.status = 'zero_variance' THEN printf('group reward std %.3f: no learning signal', l.reward_std)
            ELSE l.status || ' (groups.status at step ' || l.decided_step || ')' END AS reason,
       CASE WHEN s.error IS NULL AND l.status = 'trained' THEN l.decided_step END AS trained_step,
       CASE WHEN s.error IS NULL THEN CAST(s.reward AS DOUBLE) END AS reward
FROM rollouts AS r
LEFT JOIN scores AS s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
LEFT JOIN last AS l ON l.run_id = r.run_id AND l.group_id = r.group_id
"""
STAND_IN_NOTE = ("These runs have no recorded fates (no `decisions` rows: written before rlpipe recorded them): "
                 "the statuses here are derived from groups.status (trained, carried, zero_variance, stale) "
                 "and scores.error.")


def ensure_fates(con: duckdb.DuckDBPyConnection) -> bool:
    """Make `fates` answer on `con`; True when it had to be derived from groups (the stand-in).

    The stand-in replaces a `fates` view without a single decided row (a run written before
    decisions were recorded), or a missing one.
    """
    try:
        decided = con.sql("SELECT count(status) FROM fates").fetchall()[0][0]
    except duckdb.CatalogException:
        decided = None
    if decided:
        return False
    sampled = con.sql("SELECT count(*) FROM rollouts").fetchall()[0][0] > 0
    if sampled or decided is None:  # no rollouts, no fates view: an empty stand-in keeps the queries valid
        con.execute(FATES_FROM_GROUPS)
    return sampled


# ---------------------------------------------------------------- fates per step


def status_order(statuses: Iterable[str]) -> list[str]:
    """The statuses present, in FATES order, unknown ones after (sorted)."""
    present = set(statuses)
    known = [name for name, _ in FATES if name in present]
    return known + sorted(present - set(known))


def fates_section(rows: Rows, order: list[str], notes: list[str]) -> dict[str, Any]:
    """The fate chart's data from fates_by_step rows: per run, counts by status and step, and totals."""
    colors = dict(FATES)
    statuses = status_order(row["status"] for row in rows)
    runs = []
    for run_id in order:
        run_rows = [row for row in rows if row["run_id"] == run_id]
        if not run_rows:
            continue
        steps = sorted({row["step"] for row in run_rows})
        at = {step: i for i, step in enumerate(steps)}
        counts = {status: [0] * len(steps) for status in statuses}
        for row in run_rows:
            counts[row["status"]][at[row["step"]]] += row["n"]
        totals = {status: sum(values) for status, values in counts.items()}
        runs.append({"run_id": run_id, "steps": steps, "counts": counts, "totals": totals,
                     "total": sum(totals.values())})
    return {"id": "fates", "title": "Fate of sampled completions", "notes": notes,
            "statuses": [{"name": s, "color": colors.get(s, OTHER_COLOR)} for s in statuses], "runs": runs}


# ---------------------------------------------------------------- the rollout browser


def browser_section(rows: Rows, notes: list[str], *, max_rows: int = MAX_BROWSER_ROWS,
                    text_budget: int = TEXT_BUDGET) -> dict[str, Any]:
    """The browser's data from rollout_browser rows: columnar, group values once, texts cut to a budget."""
    notes = list(notes)
    n_all = len(rows)
    rows, dropped = cap_rows(rows, max_rows)
    if dropped:
        notes.append(f"{n_all:,} completions: only {len(rows):,} are inlined, from {dropped[0]} of {dropped[1]} "
                     f"steps evenly spread (the others: rlpipe sql --query rollout_browser).")
    limit = text_limit(_text_lengths(rows), text_budget)
    n_cut = sum(len(row[key] or "") > limit for row in rows for key in ("prompt_text", "completion_text"))
    if n_cut:
        notes.append(f"{n_cut:,} text(s) longer than {limit:,} characters are cut here, each with a note of "
                     "how much; the tables hold them whole.")
    groups: dict[Hashable, int] = {}
    group_rows: Rows = []
    sample: dict[str, list] = {key: [] for key in
                               ("g", "sid", "status", "reason", "trained_step", "reward", "advantage",
                                "tokens", "finish", "completion")}
    full_ids, episodes = [], {}
    for i, row in enumerate(rows):
        key = (row["run_id"], row["group_id"], row["step"], row["policy_version"], row["env"],
               row["example_id"], row["prompt_text"])
        if key not in groups:
            groups[key] = len(group_rows)
            group_rows.append(row)
        sid = row["sample_id"]
        if sid.startswith(row["group_id"]):
            sid = sid[len(row["group_id"]):]
        else:
            full_ids.append(i)
        for column, value in (("g", groups[key]), ("sid", sid), ("status", row["status"]),
                              ("reason", row["reason"]), ("trained_step", row["trained_step"]),
                              ("reward", _round(row["reward"], 6)), ("advantage", _round(row["advantage"], 5)),
                              ("tokens", row["n_completion_tokens"]), ("finish", row["finish_reason"]),
                              ("completion", cut(row["completion_text"], limit))):
            sample[column].append(value)
        if row["n_turns"] is not None:
            episodes[str(i)] = episode(row, limit)
    for column in ("status", "reason", "finish"):
        sample[column] = dict_encode(sample[column])
    sample["g"] = numbers([g - previous for previous, g in itertools.pairwise([0, *sample["g"]])])  # rows come by group
    for column in ("trained_step", "reward", "advantage", "tokens"):
        sample[column] = numbers(sample[column])
    group = {"run_id": dict_encode([row["run_id"] for row in group_rows]),
             "group_id": affix_encode([row["group_id"] for row in group_rows]),
             "step": numbers([row["step"] for row in group_rows]),
             "policy_version": numbers([row["policy_version"] for row in group_rows]),
             "env": dict_encode([row["env"] for row in group_rows]),
             "example_id": affix_encode([row["example_id"] for row in group_rows]),
             "prompt": dict_encode([cut(row["prompt_text"], limit) for row in group_rows])}
    group["prompt"]["values"] = affix_encode(group["prompt"]["values"])
    return {"id": "rollouts", "title": "Rollout browser", "notes": notes, "n": len(rows), "n_all": n_all,
            "text_limit": limit, "statuses": status_order(row["status"] for row in rows),
            "groups": group, "rows": sample, "full_ids": full_ids, "episodes": episodes}


def cap_rows(rows: Rows, max_rows: int) -> tuple[Rows, tuple[int, int] | None]:
    """All rows if at most max_rows; else the rows of the most evenly spread steps that fit.

    Returns (rows, None) or (kept rows, (steps kept, steps in all)).
    """
    if len(rows) <= max_rows:
        return rows, None
    per_step: dict[int, int] = {}
    for row in rows:
        per_step[row["step"]] = per_step.get(row["step"], 0) + 1
    steps = sorted(per_step)
    chosen: list[int] = []
    for k in range(len(steps), 0, -1):
        chosen = spread(steps, k)
        if sum(per_step[step] for step in chosen) <= max_rows:
            break
    keep = set(chosen)
    return [row for row in rows if row["step"] in keep], (len(keep), len(steps))


def spread(items: list, n: int) -> list:
    """At most n items, evenly spread, first and last included."""
    if len(items) <= n:
        return items
    if n == 1:
        return items[-1:]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def text_limit(lengths: list[int], budget: int, low: int = MIN_TEXT, high: int = MAX_TEXT) -> int:
    """The largest cut L in [low, high] with sum(min(length, L)) <= budget: only texts over L are cut."""
    lengths = sorted(lengths)
    rest = budget
    for i, length in enumerate(lengths):
        remaining = len(lengths) - i  # texts of at least this length, each would take `length`
        if length * remaining > rest:
            return max(low, min(high, rest // remaining))
        rest -= length
    return high


def _text_lengths(rows: Rows) -> list[int]:
    prompts = {(row["run_id"], row["group_id"]): len(row["prompt_text"] or "") for row in rows}
    return list(prompts.values()) + [len(row["completion_text"] or "") + len(row["messages"] or "") for row in rows]


def cut(text: str | None, limit: int) -> str | None:
    """`text` cut to `limit` characters with a note of how much was left out."""
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f" … [{len(text) - limit:,} more characters]"


def episode(row: dict[str, Any], limit: int) -> dict[str, Any]:
    """A multi-turn episode for the detail view: its turns' spans and the transcript as [role, content]."""
    try:
        messages = [[str(m.get("role", "?")), cut(str(m.get("content", "")), limit)]
                    for m in json.loads(row["messages"] or "[]")]
    except (ValueError, AttributeError, TypeError):
        messages = [["transcript", cut(row["messages"], limit)]]
    try:
        spans = [[t["turn"], t["producer"], t["length"], t.get("reward")] for t in json.loads(row["turns"] or "[]")]
    except (ValueError, KeyError, TypeError):
        spans = []
    return {"n_turns": row["n_turns"], "spans": spans, "messages": messages}


def dict_encode(values: list) -> dict[str, list]:
    """{"values": distinct values (first seen first), "index": position of each value in them}."""
    at: dict[Any, int] = {}
    index = [at.setdefault(value, len(at)) for value in values]
    return {"values": list(at), "index": index}


def numbers(values: list[float | int | None]) -> str:
    """A numeric column as one comma-separated string, null as nothing: "1,,0.5" (no "null" per row)."""
    return ",".join("" if value is None else str(value) for value in values)


def affix_encode(values: list[str | None]) -> dict[str, Any]:
    """Strings without the prefix and suffix they all share (a chat template's, a run's id) and those once."""
    present = [value for value in values if value is not None]
    if not present:
        return {"prefix": "", "suffix": "", "values": values}
    prefix = os.path.commonprefix(present)
    suffix = os.path.commonprefix([value[len(prefix):][::-1] for value in present])[::-1]  # never overlaps prefix
    inner = [None if value is None else value[len(prefix):len(value) - len(suffix)] for value in values]
    return {"prefix": prefix, "suffix": suffix, "values": inner}


def _round(value: float | None, digits: int) -> float | None:
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(f"{value:.{digits}g}")
