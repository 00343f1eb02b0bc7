"""`rlpipe lineage models:/NAME/VERSION | models:/NAME@alias`: the data behind a registered model
version — its MLflow run, the steps and the rollouts that trained it, with counts — and, up the
chain, the checkpoint and version it started from (an RL version → its SFT version).

    rlpipe lineage models:/demo@best --runs-root runs
    rlpipe lineage models:/demo/3 --samples 20 --format json

How versions link to data: every registered checkpoint carries the tags `run_dir`, `run_id`,
`step` and `policy_version` (tasks/checkpoint.py), and a run that started from a checkpoint adds
`parent_checkpoint`, `parent_model_name`, `parent_model_version`, ... (tasks/origin.py, also on
the MLflow run as `rlpipe.parent_*` and in the run's `origins` table). The samples that trained
version v of a run at step s are the run's trained samples at steps <= s (`fates` where the run's
run recorded them, else the `advantages` rows: one per trained sample). The canned query
`lineage_by_version` gives the same per checkpoint in SQL.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import duckdb
from rlpipe.storage.catalog import connect, has_data
from rlpipe.storage.cliargs import fail, parse_args
from rlpipe.storage.schemas import TABLES

PROG = "rlpipe lineage"
_MAX_DEPTH = 8  # a chain longer than this is a cycle in hand-made tags


def checkpoint_origin(checkpoint: str | Path) -> dict[str, Any]:
    """What is known of a checkpoint folder a run starts from: the `origins` columns. The run
    that wrote it and its registered version come from that run's tables when it is an rlpipe
    checkpoint (`<run_dir>/checkpoints/step_<k>`), else they are null."""
    path = Path(checkpoint).resolve()
    row: dict[str, Any] = {"parent_checkpoint": str(path)}
    run_dir = path.parent.parent
    if path.parent.name != "checkpoints" or not (run_dir / "tables" / "checkpoints").is_dir():
        return row
    found = connect([run_dir]).execute(
        "select run_id, step, mlflow_model_name, mlflow_model_version from checkpoints where path = ? "
        "order by created_at desc limit 1", [str(path)]).fetchall()
    if found:
        run_id, step, name, version = found[0]
        row |= {"parent_run_dir": str(run_dir), "parent_run_id": run_id, "parent_step": step,
                "parent_model_name": name, "parent_model_version": version}
    return row


def trained_by_step(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """Per step <= `step`: samples and groups trained, their mean reward and advantage."""
    con = connect([run_dir])
    if _has_fates(run_dir):
        sql = """select trained_step as step, count(*) as samples, count(distinct group_id) as groups,
                        avg(reward) as reward_mean, null::double as advantage_mean
                 from fates where status = 'trained' and trained_step <= ? group by 1 order by 1"""
    else:
        sql = """select a.step, count(*) as samples, count(distinct a.group_id) as groups,
                        avg(s.reward) as reward_mean, avg(a.advantage) as advantage_mean
                 from advantages a left join scores s on s.run_id = a.run_id and s.sample_id = a.sample_id
                 where a.step <= ? group by 1 order by 1"""
    return _rows(con.execute(sql, [step]))


def sampled_counts(run_dir: str | Path, step: int) -> dict[str, int]:
    """Rollouts sampled for steps <= `step`, and (where the run recorded fates) their fates as of
    that step: a fate decided later was still `carried` then."""
    con = connect([run_dir])
    counts = {"sampled": con.execute("select count(*) from rollouts where step <= ?", [step]).fetchone()[0]}
    if _has_fates(run_dir):
        counts |= dict(con.execute(
            "select case when decided_step > ? then 'carried' else coalesce(status, 'undecided') end, count(*) "
            "from fates where step <= ? group by 1 order by 1", [step, step]).fetchall())
    return counts


def trained_samples(run_dir: str | Path, step: int, limit: int) -> list[dict[str, Any]]:
    """The first `limit` rollouts trained at steps <= `step` (step order): ids, reward, text."""
    sql = """select a.step as trained_step, r.step as sampled_step, a.sample_id, a.advantage, s.reward,
                    r.example_id, r.prompt_text, r.completion_text
             from advantages a
             join rollouts r on r.run_id = a.run_id and r.sample_id = a.sample_id
             left join scores s on s.run_id = a.run_id and s.sample_id = a.sample_id
             where a.step <= ? order by a.step, a.sample_id limit ?"""
    return _rows(connect([run_dir]).execute(sql, [step, limit]))


def train_steps(run_dir: str | Path, step: int) -> dict[str, Any]:
    """Optimizer steps <= `step` of the run, their mode and tokens (SFT versions have no rollouts)."""
    con = connect([run_dir])
    found = con.execute("select count(*), any_value(mode), sum(tokens) from train_steps where step <= ?",
                        [step]).fetchone()
    return {"steps": found[0], "mode": found[1], "tokens": found[2]}


def _has_fates(run_dir: str | Path) -> bool:
    """Whether the run recorded fates (`decisions`, behind the `fates` view); older runs did not."""
    return "decisions" in TABLES and has_data([run_dir], "decisions")


def _rows(result: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in result.description]
    return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def version_lineage(client: Any, model_uri: str, samples: int = 5) -> list[dict[str, Any]]:
    """The chain from `model_uri` up through the versions it started from, one dict per version:
    model, MLflow run, run dir and step, steps and samples trained, and the parent."""
    from rlpipe.storage.model_versions import resolve_model_version
    from rlpipe.storage.tracking import WEIGHTS_REMOVED_TAG

    chain: list[dict[str, Any]] = []
    while model_uri and len(chain) < _MAX_DEPTH:
        version = resolve_model_version(client, model_uri)
        tags = dict(version.tags or {})
        if "run_dir" not in tags or "step" not in tags:
            raise ValueError(f"{model_uri} (version {version.version}) has no run_dir/step tags: it was not "
                             "registered by an rlpipe run")
        run_dir, step = Path(tags["run_dir"]), int(tags["step"])
        run = client.get_run(version.run_id) if version.run_id else None
        entry = {
            "model": f"models:/{version.name}/{version.version}",
            "mlflow_run_id": version.run_id,
            "mlflow_run_name": run.info.run_name if run else None,
            "run_dir": str(run_dir), "run_id": tags.get("run_id"), "step": step,
            "parent_checkpoint": tags.get("parent_checkpoint"), "parent_model": None,
        }
        if (removed := tags.get(WEIGHTS_REMOVED_TAG)) is not None:  # the data below still holds
            entry["weights_removed"] = removed
        if not run_dir.is_dir():
            entry["missing"] = f"run folder {run_dir} is gone: its tables cannot be read"
        else:
            entry |= {"train": train_steps(run_dir, step), "rollouts": sampled_counts(run_dir, step),
                      "trained_by_step": trained_by_step(run_dir, step),
                      "samples": trained_samples(run_dir, step, samples)}
        if tags.get("parent_model_name") and tags.get("parent_model_version"):
            entry["parent_model"] = f"models:/{tags['parent_model_name']}/{tags['parent_model_version']}"
        chain.append(entry)
        model_uri = entry["parent_model"]
    return chain


# ---------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="The run, steps and rollouts that trained a "
                                     "registered model version, and the versions it started from.")
    parser.add_argument("model_uri", metavar="models:/NAME/VERSION|models:/NAME@alias")
    parser.add_argument("--runs-root", default="runs",
                        help="where the MLflow database is (sqlite:///RUNS_ROOT/mlflow.db; default runs; "
                             "$MLFLOW_TRACKING_URI wins)")
    parser.add_argument("--tracking-uri", help="an MLflow tracking URI (instead of --runs-root)")
    parser.add_argument("--samples", type=int, default=5, help="trained rollouts shown per version (default 5)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help or a usage error
        return args
    from mlflow import MlflowClient

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        database = Path(args.runs_root).resolve() / "mlflow.db"
        if not database.is_file():
            return fail(PROG, f"no MLflow database at {database} (give --runs-root or --tracking-uri)")
        uri = f"sqlite:///{database}"
    try:
        chain = version_lineage(MlflowClient(tracking_uri=uri, registry_uri=uri), args.model_uri, args.samples)
    except ValueError as error:
        return fail(PROG, str(error))
    if args.format == "json":
        print(json.dumps(chain, indent=2, default=str))
    else:
        print("\n".join(render(chain)))
    return 0


def render(chain: list[dict[str, Any]]) -> list[str]:
    """The chain as text: the asked version first, then each version it started from."""
    lines: list[str] = []
    for depth, entry in enumerate(chain):
        head = entry["model"] if depth == 0 else f"started from {entry['model']}"
        lines += [head, f"  mlflow run   {entry['mlflow_run_name']} ({entry['mlflow_run_id']})",
                  f"  run          {entry['run_dir']} (run_id {entry['run_id']}), checkpoint of step {entry['step']}"]
        if "weights_removed" in entry:
            lines.append(f"  weights      removed: {entry['weights_removed']}")
        if "missing" in entry:
            lines.append(f"  {entry['missing']}")
        else:
            train = entry["train"]
            lines.append(f"  trained      {train['steps']} {train['mode'] or ''} step(s), {train['tokens'] or 0} tokens")
            lines += _render_rollouts(entry)
        if entry["parent_checkpoint"] and not entry["parent_model"]:
            lines.append(f"  started from checkpoint {entry['parent_checkpoint']} (not a registered version)")
        elif entry["parent_model"]:
            lines.append(f"  parent       {entry['parent_model']} (checkpoint {entry['parent_checkpoint']})")
    return lines


def _render_rollouts(entry: dict[str, Any]) -> list[str]:
    counts, by_step = entry["rollouts"], entry["trained_by_step"]
    if not counts["sampled"]:
        return []
    fates = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "sampled")
    trained = sum(row["samples"] for row in by_step)
    lines = [f"  rollouts     {counts['sampled']} sampled, {trained} trained" + (f" ({fates})" if fates else ""),
             "  step  samples  groups  reward_mean"]
    lines += [f"  {r['step']:>4}  {r['samples']:>7}  {r['groups']:>6}  {r['reward_mean'] or 0:>11.3f}" for r in by_step]
    for sample in entry["samples"]:
        text = (sample["completion_text"] or "").replace("\n", " ")[:40]
        lines.append(f"    step {sample['trained_step']}  {sample['sample_id']}  example {sample['example_id']}  "
                     f"reward {sample['reward']:.3g}  advantage {sample['advantage']:+.3g}  completion {text!r}")
    if entry["samples"]:
        lines.append(f"    (all of them: rlpipe sql {entry['run_dir']} \"select r.* from advantages a join rollouts r "
                     f"using (run_id, sample_id) where a.step <= {entry['step']}\")")
    return lines
