"""Re-scoring a run's stored rollouts with another reward function, without regenerating them:
counterfactual `scores`, `groups`, `advantages` and `decisions` tables beside the originals.

    rlpipe rescore runs/demo/rl --reward mypkg.rewards:strict      # → runs/demo/rl/rescore/strict/
    rlpipe sql runs/demo/rl/rescore/strict --query rescore_compare

The rollouts go through training's own scoring path (rollouts/scoring.py `score_rollouts`, with the
run's `task.reward_timeout_s` and DAPO overlong penalty); a reward function that raises or times
out is recorded in `scores.error` with reward 0, as in training, but never stops the re-scoring.
The function replaces the env's whole reward (and any `task.reward_models`); the per-turn rewards
an episode's environment steps gave (multi-turn) are still added, as in training.
Groups are rebuilt as the run built them (rollouts/source.py: completions whose new reward raised
left out as `reward_error`, then `make_groups` per step and sampling round) and their advantages
recomputed with the run's `[rl]` section (rollouts/advantages.py). A distilled run's advantages
take in the teacher's term as training did (rollouts/distill.py `mean_advantage`), from the
`teacher_logprobs` its rollouts hold (`rlpipe rescore --teacher SPEC|URL`: another teacher's, scored
now; rescore.json names it): `type = "advantage"` ones do not move with the reward.

What stays fixed is the run's batches. Each row of the run's `groups` table is replayed with the
new rewards: a group that was trained (or carried) stays so unless its rewards now have zero
variance (then `zero_variance`, and its later rows go); a group dropped for zero variance that
now has variance becomes `carried` (valid, but re-sampling and the batch cap are not replayed, so
it is not trained); `stale` and `over_cap` stay. `advantages` holds the new advantages of trained
groups, `decisions` each completion's new fate (so the folder's `fates` view is the counterfactual's).

The rescore folder holds `rescore.json` (source run, reward), `tables/{scores,groups,advantages,
decisions}` and a `catalog.duckdb` whose other tables are the source run's, plus `original_<table>`
views of the run's own four (storage/catalog.py).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlpipe.core.files import atomic_write
from rlpipe.core.user_code import import_user_object
from rlpipe.envs.base import Environment, Example, Messages, RewardResult, completion_text_of
from rlpipe.envs.rewards import RewardFn, evaluate_reward, get_reward
from rlpipe.envs.timeout import with_reward_timeout
from rlpipe.rollouts.advantages import (
    ZERO_VARIANCE_EPS,
    Group,
    group_advantages,
    group_row,
    make_groups,
)
from rlpipe.rollouts.distill import Teacher, mean_advantage, pulls, with_teacher
from rlpipe.rollouts.fates import DropOptions, decide_groups, drop_rows, fate_rows, sample_drop
from rlpipe.rollouts.group_buffer import GroupDecision
from rlpipe.rollouts.options import RolloutOptions
from rlpipe.rollouts.records import Rollout, Score
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts
from rlpipe.storage.catalog import RESCORE_MARKER, ensure_catalog, rescore_source
from rlpipe.storage.compaction import stored_steps
from rlpipe.storage.writer import read_table, write_table

TABLES = ("scores", "groups", "advantages", "decisions")


def load_reward(spec: str) -> RewardFn:
    """`module:function` (imported), or the name of a registered reward (envs/rewards.py)."""
    if ":" not in spec:
        return get_reward(spec)
    fn = import_user_object(spec, "--reward")
    if not callable(fn):
        module_name, _, attribute = spec.partition(":")
        raise ValueError(f"--reward {spec!r}: module {module_name!r} has no function {attribute!r}")
    return fn


class RewardFnEnv:
    """`env` judged by another reward function `fn(completion_text, answer, example)`."""

    def __init__(self, env: Environment, fn: RewardFn) -> None:
        self.inner, self.fn = env, fn

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        return evaluate_reward(self.fn, completion_text_of(transcript), example.answer, example)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def scoring_env(env: Environment, fn: RewardFn, timeout_s: float) -> Environment:
    """The env that re-scores: `fn` in place of the env's reward, under the run's deadline."""
    return with_reward_timeout(RewardFnEnv(env, fn), timeout_s)


def find_examples(train: Sequence[Example], ids: Iterable[str], known: dict[str, Example]) -> None:
    """Add to `known` the train examples named by `ids`: by the index an id ends with when it
    names that example (`train/<seed>/<index>`), else by a scan; ValueError for ids not found."""
    wanted = {i for i in ids if i not in known}
    for example_id in list(wanted):
        tail = example_id.rsplit("/", 1)[-1]
        if tail.isdigit() and int(tail) < len(train) and train[int(tail)].example_id == example_id:
            known[example_id] = train[int(tail)]
            wanted.discard(example_id)
    for example in train if wanted else ():
        if example.example_id in wanted:
            known[example.example_id] = example
            wanted.discard(example.example_id)
            if not wanted:
                break
    if wanted:
        raise ValueError(f"{len(wanted)} example id(s) of the rollouts, e.g. {sorted(wanted)[0]!r}, are not in "
                         "the env's train examples: was the run's task config changed?")


def round_groups(rollouts: Sequence[Rollout], scores: Sequence[Score], options: DropOptions
                 ) -> tuple[list[Group], list[dict]]:
    """The groups a step's sampling rounds formed (rollouts/source.py: completions whose reward
    raised, or truncated ones with rl.filter.drop_truncated, left out, then make_groups per round), and
    the `decisions` rows of those left out."""
    score_of = {s.sample_id: s for s in scores}
    groups: list[Group] = []
    drops: list[tuple[Rollout, str, str]] = []
    for attempt in sorted({r.attempt for r in rollouts}):
        kept = []
        for r in (r for r in rollouts if r.attempt == attempt):
            drop = sample_drop(r, score_of[r.sample_id], options)
            if drop is None:
                kept.append({"group_id": r.group_id, "env": r.env, "example_id": r.example_id,
                             "policy_version": r.policy_version, "sample_id": r.sample_id,
                             "reward": score_of[r.sample_id].reward})
            else:
                drops.append((r, *drop))
        groups += make_groups(kept, attempt)
    return groups, drop_rows(drops)


def counterfactual(original: Sequence[dict], groups: dict[str, Group], options: RolloutOptions,
                   emptied: Iterable[str] = (), pulls: Mapping[str, list[float]] | None = None
                   ) -> tuple[list[dict], list[dict], list[dict]]:
    """The run's `groups` rows replayed with new rewards (module docstring): (groups rows,
    advantages rows of the trained groups, `decisions` rows of their completions), each row with
    run_id and step. `emptied`: groups whose every completion was left out (their reward now
    raised): they have no row left. `pulls`: with on-policy distillation, each completion's
    per-token teacher term (rollouts/distill.py `pulls`), which its advantage takes in as training did."""
    distill = options.advantages.distill
    group_rows, advantage_rows, decisions, gone = [], [], [], set(emptied)
    by_step: dict[int, list[dict]] = {}
    for row in original:
        by_step.setdefault(row["step"], []).append(row)
    for step in sorted(by_step):
        batch, step_decisions = [], []
        for row in by_step[step]:
            group_id, status = row["group_id"], row["status"] or ("trained" if row["kept"] else "carried")
            if group_id in gone:
                continue
            if group_id not in groups:
                raise ValueError(f"group {group_id!r} of the groups table has no rollouts in the run's tables")
            group = groups[group_id]
            stats = group.stats(ZERO_VARIANCE_EPS)
            reason = ""
            if status == "stale":
                reason = "stale in the run (a group's age does not depend on its reward)"
            elif stats.zero_variance and options.buffer.drop_zero_variance:
                status, reason = "zero_variance", f"re-scored: group reward std {stats.std:.3g} <= eps {ZERO_VARIANCE_EPS:g}"
                gone.add(group_id)
            elif status == "zero_variance":
                status = "carried"
            elif status == "over_cap":
                reason = "the run's step used up rl.buffer.max_attempts without filling its batch and failed"
            key = {"run_id": row["run_id"], "step": step}
            group_rows.append({**key, **group_row(group), "attempts": row["attempts"], "kept": status == "trained",
                               "status": status})
            if status == "trained":
                batch.append(group)
                advantages = group_advantages([group], options.advantages)
                if distill.type != "none":
                    advantages = {sid: mean_advantage(advantages[sid], (pulls or {})[sid], distill)
                                  for sid in group.sample_ids}
                advantage_rows += [{**key, "sample_id": sid, "group_id": group_id, "advantage": advantages[sid]}
                                   for sid in group.sample_ids]
            else:
                step_decisions.append(GroupDecision(group, stats, "valid" if status == "carried" else status, reason))
        run_id = by_step[step][0]["run_id"]
        decisions += [{"run_id": run_id, "step": step, **row}
                      for row in fate_rows(decide_groups(batch, step_decisions, step=step))]
    return group_rows, advantage_rows, decisions


def prepare_out(run_dir: Path, out_dir: Path, reward: str, teacher: dict | None = None) -> None:
    """Create the rescore folder with its `rescore.json` (`teacher`: the lineage of the teacher that
    re-scored the teacher term, if one did); ValueError if `out_dir` is a run or holds another
    re-scoring."""
    existing = rescore_source(out_dir)
    if existing is not None:
        info = json.loads((out_dir / RESCORE_MARKER).read_text())
        if existing[0] != run_dir or info["reward"] != reward or info.get("teacher") != teacher:
            raise ValueError(f"{out_dir} already holds a rescore of {existing[0]} with {info['reward']!r}"
                             f"{' and teacher ' + repr(info['teacher']) if info.get('teacher') else ''}; "
                             "choose another --name or --out")
    elif (out_dir / "tables").exists():
        raise ValueError(f"{out_dir} holds tables of its own (a run?); choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    # inside the run (the default rescore/<name>): relative, so the run folder moves or copies whole
    source = os.path.relpath(run_dir, out_dir) if out_dir.is_relative_to(run_dir) else str(run_dir)
    info = {"source_run_dir": source, "reward": reward, "tables": list(TABLES),
            "created_at": dt.datetime.now(dt.UTC).isoformat(), **({"teacher": teacher} if teacher else {})}
    atomic_write(out_dir / RESCORE_MARKER, lambda tmp: tmp.write_text(json.dumps(info, indent=2)), durable=False)


def rescore_run(run_dir: Path, out_dir: Path, *, reward: str, env: Environment, scorer: Environment,
                options: RolloutOptions, seed: int, length_penalty: Callable[[int], float] | None = None,
                tick: Callable[[int], None] = lambda n: None, teacher: Teacher | None = None) -> dict[str, int]:
    """Re-score every stored rollout of `run_dir` with `scorer` into `out_dir` (module docstring);
    `env` gives the examples, `options` are the run's (rollouts/options.py, from its `[rl]` section),
    `tick(n)` reports n rollouts done; `teacher`: a distilled run's teacher term re-scored by
    this teacher instead of read from the run. Returns rollout and error counts."""
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    steps = stored_steps(run_dir, "rollouts")
    if not steps:
        raise ValueError(f"{run_dir} has no rollouts table to re-score (an RL run folder, e.g. runs/demo/rl)")
    if teacher is not None and options.advantages.distill.type == "none":
        raise ValueError(f"{run_dir} was not distilled (rl.distill.type = 'none'): there is no teacher term to "
                         "re-score; leave out --teacher")
    prepare_out(run_dir, out_dir, reward, teacher.lineage() if teacher is not None else None)
    train, examples = env.examples("train", seed=seed), {}
    groups: dict[str, Group] = {}
    drops: dict[int, list[dict]] = {}
    counts = {"rollouts": 0, "errors": 0}
    distilled, pull_of = options.advantages.distill.type != "none", {}
    for step in steps:
        rollouts = [Rollout.from_row(row) for row in read_table(run_dir, "rollouts", step).to_pylist()]
        if distilled:  # the teacher term, from the teacher log-probs the run stored (or `teacher`'s)
            scored = rollouts if teacher is None else with_teacher(rollouts, teacher)
            pull_of.update((r.sample_id, pulls(r)) for r in scored)
        find_examples(train, {r.example_id for r in rollouts}, examples)
        scores: list[Score] = score_rollouts(scorer, examples, rollouts, ScoreOptions(1.0, length_penalty))
        write_table(out_dir, "scores", step, [s.row() for s in scores], run_id=_run_id(rollouts, run_dir),
                    durable=False)
        step_groups, drops[step] = round_groups(rollouts, scores, options.drops)
        groups.update({g.group_id: g for g in step_groups})
        counts["rollouts"] += len(rollouts)
        counts["errors"] += sum(s.error is not None for s in scores)
        tick(len(rollouts))
    last = steps[-1]  # the run as of its last step re-scored here (a running run writes on)
    original = read_table(run_dir, "groups", as_of_step=last).to_pylist()
    emptied = {row["group_id"] for rows in drops.values() for row in rows} - set(groups)
    run_id = _run_id(original, run_dir)
    tables = dict(zip(("groups", "advantages", "decisions"), counterfactual(original, groups, options, emptied, pull_of),
                      strict=True))
    tables["decisions"] += [{"run_id": run_id, "step": step, **row} for step, rows in drops.items() for row in rows]
    by_step = {table: _by_step(rows) for table, rows in tables.items()}
    for step in sorted({s for s in stored_steps(run_dir, "groups") if s <= last} | set(drops)):
        for table, rows in by_step.items():
            write_table(out_dir, table, step, rows.get(step, []), run_id=run_id, durable=False)
    ensure_catalog(out_dir)
    return counts


def _by_step(rows: list[dict]) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["step"], []).append(row)
    return grouped


def _run_id(rows: Sequence[Any], run_dir: Path) -> str:
    if rows:
        first = rows[0]
        return first["run_id"] if isinstance(first, dict) else first.run_id
    return json.loads((run_dir / "run.json").read_text())["run_id"]
