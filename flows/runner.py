"""`rlpipe run` and `rlpipe resume`: validate the config, start the flow it names, summarise.

A run directory that already holds a run is never silently reused: `rlpipe run` refuses it
(resume it, or pass --overwrite to start over).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from flows.common import quiet_defaults
from flows.config import ConfigError, RunConfig, describe_fields, load_config, validate_config
from training import metric_names as m


def flow_function(name: str):
    if name == "pipeline":
        from flows.pipeline import pipeline_flow as fn
    elif name == "rl":
        from flows.rl import rl_flow as fn
    elif name == "sft":
        from flows.sft import sft_flow as fn
    elif name == "pretrain":
        from flows.pretrain import pretrain_flow as fn
    else:  # validated by the config already
        raise ValueError(f"unknown flow {name!r}")
    return fn


def start(config: RunConfig) -> dict:
    """Run the flow the config names (Prefect's embedded API unless PREFECT_API_URL is set)."""
    quiet_defaults()
    return flow_function(config.flow)(config=config.model_dump(mode="json"))


def summary_lines(config: RunConfig, result: dict, seconds: float) -> list[str]:
    run_dir = config.run_dir
    lines = ["", f"rlpipe: {config.flow} run finished in {seconds:.0f} s → {run_dir}"]
    phases = [("sft", result.get("sft")), ("rl", result.get("rl"))] if config.flow == "pipeline" \
        else [(config.flow, result)]
    for name, phase in phases:
        if phase and phase.get("eval"):
            accuracy = phase["eval"].get(m.EVAL_ACCURACY)
            if accuracy is not None:
                lines.append(f"  held-out greedy accuracy after {name.upper():<8} {accuracy:6.1%}")
    teacher_error = config.task.options.get("teacher_carry_error", 0)
    if teacher_error and config.flow == "pipeline":
        lines.append(f"  (SFT imitated a teacher that forgets every carry in {teacher_error:.0%} of its "
                     "demonstrations; RL learned from the exact verifier)")
    table_dir = run_dir / "rl" if config.flow == "pipeline" else run_dir
    tracking = Path(config.runs_root).resolve() / "mlflow.db"
    lines += [
        "",
        "Where to look:",
        f"  rlpipe sql {table_dir} --query reward_by_step",
        f"  rlpipe sql {table_dir} --query zero_variance_by_step",
        f"  rlpipe sql {table_dir} \"select step, avg(reward) from scores group by step order by step\"",
        f"  rlpipe report {table_dir}" + (f" {run_dir / 'sft'}" if config.flow == "pipeline" else "")
        + f"   (writes {table_dir / 'report.html'})",
        f"  mlflow ui --backend-store-uri sqlite:///{tracking}   (pip install 'rlpipe[ui]')",
    ]
    return lines


def main_run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe run", description="Run the flow a TOML config names.")
    parser.add_argument("config", nargs="?", help="TOML run config (e.g. configs/demo.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set rl.steps=10 (repeatable)")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run directory first")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its doc")
    args = parser.parse_args(argv)
    if args.help_config:
        print("\n".join(describe_fields()))
        return 0
    if not args.config:
        parser.error("a CONFIG file is required")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"rlpipe run: {error}", file=sys.stderr)
        return 2
    if (config.run_dir / "run.json").exists():
        if not args.overwrite:
            print(f"rlpipe run: {config.run_dir} already holds a run; `rlpipe resume {config.run_dir}` "
                  "continues it, --overwrite starts over", file=sys.stderr)
            return 2
        shutil.rmtree(config.run_dir)
    return _execute(config)


def main_resume(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe resume", description="Continue a stopped run.")
    parser.add_argument("run_dir", help="a run directory (holds config.json)")
    args = parser.parse_args(argv)
    path = Path(args.run_dir) / "config.json"
    if not path.is_file():
        print(f"rlpipe resume: {args.run_dir} is not a run directory (no config.json)", file=sys.stderr)
        return 2
    try:
        config = validate_config(json.loads(path.read_text()), str(path))
    except (ConfigError, json.JSONDecodeError) as error:
        print(f"rlpipe resume: {error}", file=sys.stderr)
        return 2
    if config.run_dir.resolve() != Path(args.run_dir).resolve():
        # a pipeline phase directory: resume the whole pipeline it belongs to
        if config.flow != "pipeline":
            config = config.model_copy(update={"runs_root": str(Path(args.run_dir).resolve().parent),
                                               "run_name": Path(args.run_dir).resolve().name})
    return _execute(config)


def _execute(config: RunConfig) -> int:
    from models.device import resolve_device

    try:  # before any run directory or tracking run exists
        resolve_device(config.device)
    except ValueError as error:
        print(f"rlpipe: {error}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    try:
        result = start(config)
    except KeyboardInterrupt:
        print(f"rlpipe: interrupted; `rlpipe resume {config.run_dir}` continues", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one clear line; Prefect logged the traceback
        print(f"rlpipe: run failed: {type(error).__name__}: {error}\n"
              f"  nothing persisted was lost; `rlpipe resume {config.run_dir}` continues from the "
              "last complete stage", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(config, result or {}, time.perf_counter() - began)))
    return 0
