"""`rlpipe report`: one self-contained HTML file with a run's plots by step.

    rlpipe report runs/demo                       # writes runs/demo/report.html
    rlpipe report runs/a runs/b --out cmp.html    # several runs overlaid, one colour per run_id
    write_report([Path("runs/demo")])             # what the flows call at the end of a run

Every plot's data is the result of a canned query, dashboards/<name>.sql, the same files
`rlpipe sql --query NAME` runs: the report and the SQL cannot disagree. The results go into the
page as JSON next to a small hand-written SVG plotting script (report.js), so the file opens
offline with no CDN. The plots are built in report_plots.py; the fate of sampled completions per step and the rollout
browser (every completion, filterable, from the `fates` view) in report_rollouts.py/.js.
A table a run never wrote (an SFT run has no rollouts, scores or groups)
leaves its plots out with a visible note. In the browser, `<html data-rlpipe-report>` becomes
`ok:<plots>:<points>` once everything is drawn, or `error:<message>` (the browser test reads it).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
from rlpipe.core.files import atomic_write
from rlpipe.dashboards import report_plots as plots
from rlpipe.dashboards import report_rollouts as rollouts
from rlpipe.dashboards.report_plots import by_run, pooled
from rlpipe.dashboards.report_plots import clean as _clean
from rlpipe.storage.catalog import connect, run_dirs_list
from rlpipe.storage.cliargs import fail, parse_args
from rlpipe.storage.compaction import table_files
from rlpipe.storage.queries import canned_sql
from rlpipe.storage.schemas import TABLES
from rlpipe.storage.writer import default_run_id

PROG = "rlpipe report"
REPORT_NAME = "report.html"
HERE = Path(__file__).resolve().parent
QUERIES = (
    "reward_by_step", "zero_variance_by_step", "completion_length_by_step", "length_vs_reward",
    "loss_by_step", "throughput_by_step", "eval_by_step", "samples_by_step", "hardest_prompts",
    "fates_by_step", "rollout_browser", "thinking_by_step", "env_by_step", "pass_at_k_by_step",
)
# queries of columns runs of older rlpipe versions lack: no rows there instead of an error
NEWER_COLUMNS = ("thinking_by_step",)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22")
MAX_SAMPLE_STEPS = 40  # per run: the sample table keeps this many steps, evenly spread
MAX_TEXT = 2000  # characters of a prompt or completion kept in the page
HARDEST_PER_RUN = 10
SUPERVISED = ("sft", "pretrain")  # train_steps modes of runs that sample no completions

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    run_dir: str
    color: str
    tables: tuple[str, ...]  # the tables with at least one partition


# ---------------------------------------------------------------- entry points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Write a self-contained HTML report "
                                     "(plots by step, sample completions) of one or several runs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders; several overlay")
    parser.add_argument("--out", "-o", metavar="FILE", help=f"output file (default RUN_DIR/{REPORT_NAME})")
    args = parse_args(parser, argv)
    if isinstance(args, int):  # --help or a usage error
        return args
    try:
        out = write_report([Path(p) for p in args.run_dirs], Path(args.out) if args.out else None)
    except (ValueError, OSError, duckdb.Error) as error:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        return fail(PROG, message)
    print(out)
    return 0


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the report of `run_dirs` to `out` (default `<first run_dir>/report.html`), atomically.

    ValueError naming the culprit for a folder that is not a run folder. Returns the file.
    """
    runs = run_dirs_list(run_dirs)
    out = runs[0] / REPORT_NAME if out is None else Path(out)
    text = render_html(report_data(runs))
    # readers see the old report or the new one, never half of one
    atomic_write(out, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable=False)
    return out


def report_data(run_dirs: list[Path]) -> dict[str, Any]:
    """The page's data (JSON-ready): run the canned queries over the runs and assemble the plots."""
    runs = run_dirs_list(run_dirs)
    return assemble(query_results(runs), run_infos(runs))


# ---------------------------------------------------------------- reading the runs


def run_infos(run_dirs: list[Path]) -> list[RunInfo]:
    """Per run folder: its run_id (from its data, else the folder's name), colour and tables with data."""
    found = []
    for run_dir in run_dirs:
        tables = tuple(table for table in TABLES if table_files(run_dir, table))
        found.append((_run_id_of(run_dir, tables), str(run_dir), tables))
    colors: dict[str, str] = {}
    for run_id, _, _ in found:
        colors.setdefault(run_id, PALETTE[len(colors) % len(PALETTE)])
    return [RunInfo(run_id, run_dir, colors[run_id], tables) for run_id, run_dir, tables in found]


def _run_id_of(run_dir: Path, tables: tuple[str, ...]) -> str:
    for table in tables:
        for path in table_files(run_dir, table):
            column = pq.read_table(path, columns=["run_id"]).column("run_id")
            if len(column):
                return str(column[0].as_py())
    return default_run_id(run_dir)


def query_results(run_dirs: list[Path]) -> dict[str, Rows]:
    """Rows of every canned query in QUERIES over the runs (non-finite floats as None).

    Plus "fates_stand_in": one row {"stand_in": bool}, whether `fates` had to be derived from groups.
    """
    con = connect(run_dirs)
    try:
        stand_in = rollouts.ensure_fates(con)
        return {name: _query_rows(con, name) for name in QUERIES} | {"fates_stand_in": [{"stand_in": stand_in}]}
    finally:
        con.close()


def _query_rows(con, name: str) -> Rows:
    try:
        return [_clean_row(row) for row in con.sql(canned_sql(name)).to_arrow_table().to_pylist()]
    except duckdb.BinderException:
        if name in NEWER_COLUMNS:
            return []
        raise


def _clean_row(row: dict[str, Any]) -> dict[str, Any]:
    return {key: _clean(value) for key, value in row.items()}


# ---------------------------------------------------------------- assembling the page's data


def assemble(results: dict[str, Rows], runs: list[RunInfo]) -> dict[str, Any]:
    """The page's data from the canned queries' rows: overview, plot sections, sample tables.

    results: query name -> rows (QUERIES). Plots are dicts with `series` (one per run and line
    style: x, y, optional bands), or with a `note` instead when there is nothing to draw.
    """
    order = list(dict.fromkeys(run.run_id for run in runs))  # run ids, first seen first
    notes = [f"run_id {run_id!r} is in several run folders: their rows are merged."
             for run_id in order if sum(run.run_id == run_id for run in runs) > 1]
    r = results
    modes = plots.run_modes(r["loss_by_step"])
    supervised = {run.run_id for run in runs if modes.get(run.run_id) in SUPERVISED}
    if supervised and len(supervised) < len(order):  # one note, not one per RL section
        notes += [f"{run_id} is {'an' if modes[run_id] == 'sft' else 'a'} {modes[run_id].upper()} run: it samples "
                  "no completions, so it is only in "
                  f"Optimisation, Throughput and time, and Evaluation, on {'an' if modes[run_id] == 'sft' else 'a'} {modes[run_id].upper()} step axis of "
                  "its own." for run_id in order if run_id in supervised]
    section = lambda *args, **kwargs: _section(*args, quiet=supervised, **kwargs)  # noqa: E731
    phased = lambda build: lambda: plots.per_phase(build, r, order, modes)  # noqa: E731
    sections = [
        section("reward", "Reward", ("scores",), runs, lambda: plots.reward_plots(r, order)),
        section("groups", "Groups and sampling", ("groups",), runs, lambda: plots.group_plots(r, order)),
        section("completions", "Completions", ("rollouts",), runs, lambda: plots.completion_plots(r, order)),
        section("optim", "Optimisation", ("train_steps",), runs, phased(plots.optim_plots)),
        section("time", "Throughput and time", ("train_steps",), runs, phased(plots.time_plots)),
        section("eval", "Evaluation", ("evals",), runs, phased(plots.eval_plots)),
    ]
    samples = section("samples", "Sample completions", ("rollouts", "scores"), runs, None)
    samples["rows"] = _sample_rows(r["samples_by_step"], order)
    hardest = section("hardest", "Hardest prompts", ("rollouts", "scores"), runs, None)
    hardest["rows"] = [_trim(row) for row in r["hardest_prompts"] if row["rank"] <= HARDEST_PER_RUN]
    if not hardest["rows"] and not hardest["notes"]:
        hardest["notes"] = ["No rows: hardest_prompts.sql returned nothing for these runs."]
    environments = {"id": "environments", "title": "Environments", "notes": [],
                    "rows": environment_rows(r["env_by_step"], order)}
    fate_notes = section("fates", "", ("rollouts",), runs, None)["notes"]
    fate_notes += [rollouts.STAND_IN_NOTE] if r["fates_stand_in"][0]["stand_in"] else []
    return {
        "title": "rlpipe report: " + ", ".join(order),
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "runs": [asdict(run) for run in runs],
        "notes": notes,
        "overview": _overview(r, runs),
        "sections": sections,
        "samples": samples,
        "hardest": hardest,
        "environments": environments,
        "fates": rollouts.fates_section(r["fates_by_step"], order, fate_notes),
        "rollouts": rollouts.browser_section(r["rollout_browser"], fate_notes),
    }


def _section(key: str, title: str, needs: tuple[str, ...], runs: list[RunInfo],
             build: Callable[[], list[dict]] | None, quiet: set[str] = frozenset()) -> dict[str, Any]:
    """A section of plots (`build`; None: a section of rows, filled by the caller); left out with
    a note when no run has the tables it needs, a note for each run that lacks them (but the
    `quiet` ones: the overview says why once), and a note when there is nothing to draw, never a
    blank section."""
    nowhere = [table for table in needs if not any(table in run.tables for run in runs)]
    if nowhere:
        which = " and ".join(f"'{table}'" for table in nowhere)
        note = (f"Left out: no rows in table {which} in {'this run' if len(runs) == 1 else 'any of these runs'}"
                " (SFT and pretrain runs write none).")
        return {"id": key, "title": title, "notes": [note], "plots": []}
    notes: list[str] = []
    for run in runs:
        absent = " or ".join(f"'{table}'" for table in needs if table not in run.tables)
        note = f"{run.run_id} has no rows in {absent}, so it is absent here."
        if absent and note not in notes and run.run_id not in quiet:
            notes.append(note)
    drawn = [] if build is None else build()
    if build is not None and not drawn and not notes:  # every query behind it came back empty
        notes.append("No rows: the queries behind this section returned nothing for these runs.")
    return {"id": key, "title": title, "notes": notes, "plots": drawn}


def environment_rows(rows: Rows, order: list[str]) -> Rows:
    """One row per (run, environment) of the runs that mixed several (env_by_step rows): steps,
    completions sampled and trained, reward and accuracy at the first and last step, and the
    share of zero-variance groups over the run. Empty when no run is a mixture."""
    out = []
    for run_id, run_rows in by_run(rows, order):
        envs = list(dict.fromkeys(row["env"] for row in run_rows))
        if len(envs) < 2:
            continue
        for env in envs:
            mine = sorted((row for row in run_rows if row["env"] == env), key=lambda row: row["step"])
            groups = sum(row["n_groups"] for row in mine)
            flat = sum(row["n_groups"] * (row["zero_variance_fraction"] or 0) for row in mine)
            out.append({"run_id": run_id, "env": env, "steps": len(mine),
                        "n_samples": sum(row["n_samples"] for row in mine),
                        "n_trained": sum(row["n_trained"] for row in mine),
                        "first_reward": mine[0]["reward_mean"], "last_reward": mine[-1]["reward_mean"],
                        "first_accuracy": mine[0]["accuracy"], "last_accuracy": mine[-1]["accuracy"],
                        "zero_variance_fraction": _clean(flat / groups) if groups else None})
    return out


def _sample_rows(rows: Rows, order: list[str]) -> Rows:
    """samples_by_step rows of at most MAX_SAMPLE_STEPS steps per run (evenly spread, last kept)."""
    kept = []
    for _, run_rows in by_run(rows, order):
        steps = sorted({row["step"] for row in run_rows})
        chosen = set(_spread(steps, MAX_SAMPLE_STEPS))
        kept += [_trim(row) | {"components": _components(row["components"])}
                 for row in run_rows if row["step"] in chosen]
    return kept


def _spread(items: list, n: int) -> list:
    """At most n items, evenly spread, first and last included."""
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _components(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        return {key: _clean(value) for key, value in json.loads(text).items()}
    except (ValueError, AttributeError):
        return {"?": text}


def _trim(row: dict[str, Any]) -> dict[str, Any]:
    """Long texts cut to MAX_TEXT characters."""
    return {key: value[:MAX_TEXT] + f" … [{len(value) - MAX_TEXT} more characters]"
            if isinstance(value, str) and len(value) > MAX_TEXT else value for key, value in row.items()}


def _overview(r: dict[str, Rows], runs: list[RunInfo]) -> list[dict[str, Any]]:
    """One row per run folder: modes, steps, last loss, reward and eval accuracy."""
    out = []
    for run in runs:
        optim = [row for row in r["loss_by_step"] if row["run_id"] == run.run_id]
        reward = [row for row in r["reward_by_step"] if row["run_id"] == run.run_id]
        accuracy = [row for row in pooled(r["eval_by_step"]) if row["run_id"] == run.run_id]
        out.append({
            "run_id": run.run_id,
            "run_dir": run.run_dir,
            "modes": ", ".join(sorted({row["mode"] for row in optim})) or None,
            "steps": len(optim),
            "last_step": max((row["step"] for row in optim), default=None),
            "last_loss": optim[-1]["loss"] if optim else None,
            "last_reward": reward[-1]["reward_mean"] if reward else None,
            "first_accuracy": accuracy[0]["accuracy"] if accuracy else None,
            "last_accuracy": accuracy[-1]["accuracy"] if accuracy else None,
            "tables": ", ".join(run.tables) or "none",
        })
    return out


# ---------------------------------------------------------------- the HTML file


def render_html(data: dict[str, Any]) -> str:
    """report.html with the data (JSON) and report.js inlined: one file that needs no network."""
    template = (HERE / "report.html").read_text()
    script = (HERE / "report_rollouts.js").read_text() + "\n" + (HERE / "report.js").read_text()
    # "<" escaped: no "</script>" or "<!--" inside the data can end its script element early
    payload = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    values = {"TITLE": html.escape(data["title"]), "DATA": payload, "SCRIPT": script}
    return re.sub(r"\{\{(TITLE|DATA|SCRIPT)\}\}", lambda match: values[match.group(1)], template)


if __name__ == "__main__":
    sys.exit(main())
