"""`rlpipe rescore RUN_DIR --reward module:function [--teacher SPEC|URL] [--name NAME | --out DIR]`:
re-score a run's stored rollouts with another reward function and recompute their advantages
(tasks/rescoring.py; a distilled run's teacher term too, from its stored teacher log-probs or, with
--teacher, another teacher's), then print the per-step comparison (canned query `rescore_compare`).

    rlpipe rescore runs/demo/rl --reward envs.rewards:exact_match
    rlpipe sql runs/demo/rl/rescore/exact_match --query rescore_compare

No Prefect flow: a command over finished tables. Exit status 2 with a one-line message for a bad
run folder, a --reward that does not import, a --teacher that cannot teach the run's student (or a
run that was not distilled), or an output folder that holds something else.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
from rlpipe.storage.cliargs import fail, parse_args

PROG = "rlpipe rescore"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Re-score a run's stored rollouts with another "
                                     "reward function; write counterfactual scores, groups and advantages.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="an RL run folder (e.g. runs/demo/rl)")
    parser.add_argument("--reward", required=True, metavar="MODULE:FUNCTION",
                        help="fn(completion_text, answer, example) -> float | (float, components), "
                             "or a registered reward name")
    parser.add_argument("--teacher", metavar="SPEC|URL",
                        help="a distilled run: re-score the teacher term with this teacher (a checkpoint folder, "
                             "models:/NAME@alias, a hub id, or a server URL as rl.distill.url takes)")
    parser.add_argument("--name", help="folder name under RUN_DIR/rescore/ (default: the function's name)")
    parser.add_argument("--out", metavar="DIR", help="write the rescore folder here instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help or a usage error
        return args
    from rlpipe.core.environment import quiet_defaults

    quiet_defaults()
    try:
        out_dir, counts = rescore(Path(args.run_dir), args.reward, args.name, args.out, args.teacher)
    except (ValueError, FileNotFoundError) as error:
        return fail(PROG, str(error))
    print(f"re-scored {counts['rollouts']} rollouts of {Path(args.run_dir).resolve()} with {args.reward} "
          f"into {out_dir}")
    if counts["errors"]:
        print(f"{PROG}: {counts['errors']} reward call(s) raised or timed out: recorded in scores.error "
              f"(reward 0); see `rlpipe sql {out_dir} \"select sample_id, error from scores where error is not null\"`",
              file=sys.stderr)
    from rlpipe.storage.queries import run_canned
    from rlpipe.storage.sqlcli import main as sql_main

    print(summary(run_canned([out_dir], "rescore_compare").to_pylist()))
    return sql_main([str(out_dir), "--query", "rescore_compare"])


def summary(rows: list[dict]) -> str:
    """The comparison's totals in two lines (rows of the canned query rescore_compare)."""
    total = {key: sum(row[key] for row in rows) for key in rows[0] if key.startswith(("groups_", "samples_"))} \
        if rows else {}
    if not total:
        return "nothing was trained in the run: no comparison"
    return (f"groups trained {total['groups_trained']}: {total['groups_kept']} kept, {total['groups_dropped']} "
            f"dropped (zero variance), {total['groups_gained']} dropped groups would now pass\n"
            f"samples trained {total['samples_trained']}: {total['samples_kept']} kept, {total['samples_flipped']} "
            f"with their advantage's sign flipped, {total['samples_zeroed']} zeroed")


def rescore(run_dir: Path, reward: str, name: str | None, out: str | None,
            teacher_spec: str | None = None) -> tuple[Path, dict[str, int]]:
    """Load the run's config, the reward (and teacher), re-score into the rescore folder; (folder, counts)."""
    from rlpipe.flows.common import say_code_trusted
    from rlpipe.flows.progress import progress
    from rlpipe.rollouts.options import rollout_options
    from rlpipe.rollouts.source_setup import overlong_penalty_fn
    from rlpipe.storage.compaction import table_files
    from rlpipe.tasks.config import read_run_config
    from rlpipe.tasks.rescoring import load_reward, rescore_run, scoring_env
    from rlpipe.tasks.setup import task_env

    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"not a run directory: {run_dir} has no config.json")
    config = read_run_config(json.loads(config_path.read_text()), str(config_path))
    say_code_trusted(PROG, config, run_dir)
    fn = load_reward(reward)
    teacher = None
    if teacher_spec:
        from rlpipe.tasks.teacher import teacher_for

        teacher = teacher_for(teacher_spec, config)
        default = f"{reward.rpartition(':')[2]}-teacher-{teacher_spec.rstrip('/').rpartition('/')[2]}"
    else:
        default = reward.rpartition(":")[2]
    name = name or re.sub(r"[^A-Za-z0-9_.-]+", "_", default) or "rescore"
    out_dir = Path(out) if out else run_dir / "rescore" / name
    env = task_env(config.task, reward_models=False)
    total = sum(pq.read_metadata(path).num_rows for path in table_files(run_dir, "rollouts"))
    bar = progress(total=total, desc="rescore", unit="rollout")
    try:
        counts = rescore_run(run_dir, out_dir, reward=reward, env=env,
                             scorer=scoring_env(env, fn, config.task.reward_timeout_s),
                             options=rollout_options(config.rl),
                             seed=config.seed, length_penalty=overlong_penalty_fn(config.rl.scoring, config.rl.sampling.max_new_tokens), tick=bar.update,
                             teacher=teacher)
    finally:
        bar.close()
        if callable(getattr(teacher, "close", None)):
            teacher.close()
    return out_dir.resolve(), counts
