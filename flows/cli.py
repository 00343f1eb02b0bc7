"""The `rlpipe` command line: one entry point, each subcommand implemented where it belongs.

    rlpipe run CONFIG.toml [--set key=value ...]   run the flow the config names
    rlpipe resume RUN_DIR                          continue a stopped run where it stopped
    rlpipe sql RUN_DIR... "SELECT ..." | --query NAME | --list
    rlpipe report RUN_DIR... [--out FILE]          self-contained HTML report
    rlpipe serve MODEL [--port N]                  torch engine behind an OpenAI-style HTTP API

Subcommands are imported lazily so that `rlpipe sql` does not pay for torch or Prefect.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "run": ("rlpipe.flows.runner", "main_run", "run the flow a TOML config names"),
    "resume": ("rlpipe.flows.runner", "main_resume", "continue a stopped run where it stopped"),
    "sql": ("rlpipe.storage.sqlcli", "main", "query a run's tables with DuckDB"),
    "rescore": ("rlpipe.flows.rescore", "main", "re-score stored rollouts with another reward function"),
    "lineage": ("rlpipe.storage.lineage", "main", "the run, steps and rollouts behind a registered model version"),
    "report": ("rlpipe.dashboards.report", "main", "write the HTML run report"),
    "serve": ("rlpipe.engines.serve_cli", "main", "serve a checkpoint, run folder or model over HTTP (torch engine)"),
    "replay": ("rlpipe.flows.replay", "main", "recompute an RL step from the tables and compare"),
}


def usage() -> str:
    lines = ["usage: rlpipe COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "`rlpipe COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"rlpipe: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = SUBCOMMANDS[name]
    from rlpipe.core.environment import exit_without_final_collections

    exit_without_final_collections()  # the last exit handler: later ones (Prefect's, MLflow's) run first
    function = getattr(importlib.import_module(module_name), function_name)
    return int(function(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
