"""`rlpipe run` and `rlpipe resume`: validate the config, start the flow it names, summarise.

A run directory that already holds a run is never silently reused: `rlpipe run` refuses it
(resume it, or pass --overwrite to start over). A run directory is locked while a process runs
it (storage.runlock): a second `rlpipe run --overwrite` or `rlpipe resume` gets a clear error,
and --overwrite also refuses a folder holding, or lying inside, a running run. `rlpipe resume`
acts on the folder it is given, wherever it lies now (a moved or copied run resumes as itself),
and leaves a finished run as it is.
SIGTERM and Ctrl-C stop a run alike, in seconds: queued table writes drain, MLflow and run.json say
FAILED, and one line says how it stopped and how to resume (exit 143 or 130).
A run whose RL trained on no sample in any step ends, after its summary, with a verdict line saying
so and exit 1 (none of its RL checkpoints is registered: flows/rl.py).

`--nproc-per-node N` (flows/launch.py) starts N ranks of the same command through torch's
elastic launcher; each rank comes back here with torchrun's environment set: rank 0 runs the
flow (tables, MLflow, engines, checkpoints), the others only train (tasks/ranks.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rlpipe.core import metric_names as m
from rlpipe.core.config import ConfigError, describe_fields
from rlpipe.core.environment import quiet_defaults
from rlpipe.core.files import io_error
from rlpipe.core.termination import Terminated, sigterm_stops_the_run, stop_signal
from rlpipe.flows.common import finished_result, say_code_trusted
from rlpipe.flows.launch import (
    add_launch_arguments,
    check_launch_arguments,
    launch,
    launched_rank,
    lost_peers,
    other_node,
    run_rank,
    strip_launch_flags,
)
from rlpipe.flows.prefect_api import embedded_server_in_own_session
from rlpipe.flows.run_folders import clear_run_dir, refuse_locked_overwrite, resumed_with
from rlpipe.rollouts.batch_makers import BatchMakerError
from rlpipe.storage.layout import size_lines
from rlpipe.storage.runlock import RunLockedError, acquire_run_lock, release_run_lock
from rlpipe.storage.tracking import default_artifact_root
from rlpipe.tasks.config import RunConfig, load_config, read_run_config, validate_config
from rlpipe.tasks.preflight import preflight


def flow_function(name: str):
    if name == "pipeline":
        from rlpipe.flows.pipeline import pipeline_flow as fn
    elif name == "rl":
        from rlpipe.flows.rl import rl_flow as fn
    elif name == "sft":
        from rlpipe.flows.sft import sft_flow as fn
    elif name == "pretrain":
        from rlpipe.flows.pretrain import pretrain_flow as fn
    else:  # validated by the config already
        raise ValueError(f"unknown flow {name!r}")
    return fn


def start(config: RunConfig, resume: bool = False) -> dict:
    """Run the flow the config names (Prefect's embedded API unless PREFECT_API_URL is set);
    resume: continue the run in config.run_dir (a new run's folder holds none)."""
    quiet_defaults()
    embedded_server_in_own_session()  # Ctrl-C stops the run, never its Prefect API under it
    return flow_function(config.flow)(config=config.model_dump(mode="json"), resume=resume)


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
            lines += [f"    {env:<36} {phase['eval'][m.eval_env(env, 'accuracy')]:6.1%}"
                      for env in (entry.name for entry in config.task.envs)
                      if m.eval_env(env, "accuracy") in phase["eval"]]
    if (verdict := rl_lost_accuracy(result)) is not None and config.flow == "pipeline":
        lines.append(verdict)
    teacher_error = config.task.options.get("teacher_carry_error", 0)
    if teacher_error and config.flow == "pipeline":
        lines.append(f"  (SFT imitated a teacher that forgets every carry in {teacher_error:.0%} of its "
                     "demonstrations; RL learned from the exact verifier)")
    if run_dir.is_dir():
        lines += size_lines(run_dir, default_artifact_root(config.runs_root))
    table_dir = run_dir / "rl" if config.flow == "pipeline" else run_dir
    tracking = Path(config.runs_root).resolve() / "mlflow.db"
    lines += [
        "",
        "Where to look:",
        *([f"  rlpipe sql {table_dir} --query loss_by_step", f"  rlpipe sql {table_dir} --query eval_by_step"]
          if config.flow in ("sft", "pretrain") else [  # a supervised run samples nothing: no scores
            f"  rlpipe sql {table_dir} --query reward_by_step",
            f"  rlpipe sql {table_dir} --query zero_variance_by_step",
            *([f"  rlpipe sql {table_dir} --query env_by_step   (per environment of the mixture)"]
              if config.task.envs else []),
            f"  rlpipe sql {table_dir} \"select step, avg(reward) from scores group by step order by step\""]),
        f"  rlpipe report {table_dir}" + (f" {run_dir / 'sft'}" if config.flow == "pipeline" else "")
        + f"   (writes {table_dir / 'report.html'})",
        f"  mlflow ui --backend-store-uri sqlite:///{tracking}   (after pip install -e '.[ui]' in the checkout)",
    ]
    return lines


def rl_lost_accuracy(result: dict) -> str | None:
    """A pipeline's verdict line when RL ended below the held-out accuracy SFT reached, else None."""
    before, after = ((result.get(phase) or {}).get("eval", {}).get(m.EVAL_ACCURACY) for phase in ("sft", "rl"))
    if before is None or after is None or after >= before:
        return None
    return (f"  warning: RL lowered held-out accuracy from {before:.1%} to {after:.1%}; the RL phase made "
            "the model worse (see its reward_by_step and zero_variance_by_step below)")


def untrained_verdict(config: RunConfig, result: dict) -> str | None:
    """The verdict line of a run whose RL phase trained on no sample in any step (its weights are
    those it started from, and none of its checkpoints was registered); None otherwise."""
    rl = result.get("rl") if config.flow == "pipeline" else result if config.flow == "rl" else None
    if not rl or rl.get("trained", True):
        return None
    return (f"rlpipe: RL trained on no sample in its {rl.get('steps')} steps: every completion had a reward equal "
            "to the rest of its group (or was dropped), so no weight changed and no RL checkpoint was registered. "
            "Make rewards differ within a group: a task the model solves sometimes, a less strict reward, "
            "a larger rl.group_size")


def main_run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe run", description="Run the flow a TOML config names.")
    parser.add_argument("config", nargs="?", help="TOML run config (e.g. configs/demo.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set rl.steps=10 (repeatable)")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run directory first")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its doc")
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    if problem := check_launch_arguments(args):
        parser.error(problem)
    if args.help_config:
        print("\n".join(describe_fields(RunConfig)))
        return 0
    if not args.config:
        parser.error("a CONFIG file is required")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"rlpipe run: {error}", file=sys.stderr)
        return 2
    if launched_rank() is not None and launched_rank()[0] > 0:
        return _execute(config)  # a training rank: rank 0 owns the run directory
    if (config.run_dir / "run.json").exists() and not args.overwrite and not other_node(args):
        print(f"rlpipe run: {config.run_dir} already holds a run; `rlpipe resume {config.run_dir}` "
              "continues it, --overwrite starts over", file=sys.stderr)
        return 2
    kind = _parallel_kind(config) if args.nproc_per_node is not None else None
    # the config's own contradictions first, then what only its components can check
    if kind is not None and isinstance(ranks := _with_parallel(config, kind), str):  # before N processes start
        print(f"rlpipe run: {ranks}", file=sys.stderr)
        return 2
    _say(f"{config.flow} run → {config.run_dir}: checking the model, tokenizer, environment and data")
    if problem := _preflight(config):
        print(f"rlpipe run: {problem}", file=sys.stderr)
        return 2
    if kind is not None:
        return launch(args, ["run", *strip_launch_flags(argv), "--set", f"train.parallel={kind}"], config.run_dir)
    return _execute(config, overwrite=args.overwrite)


def main_resume(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe resume", description="Continue a stopped run.")
    parser.add_argument("run_dir", help="a run directory (holds config.json)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change a setting that is safe to change mid-run, e.g. --set rl.buffer.max_attempts=8 "
                             "(retries, sampling rounds, partial batches, filters, step counts; repeatable)")
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    if problem := check_launch_arguments(args):
        parser.error(problem)
    path = Path(args.run_dir) / "config.json"
    if not path.is_file():
        print(f"rlpipe resume: {args.run_dir} is not a run directory (no config.json)", file=sys.stderr)
        return 2
    try:
        config = read_run_config(json.loads(path.read_text()), str(path))
        config = config_at(config, run_folder_root(Path(args.run_dir), config))
        config = resumed_with(config, args.overrides) if args.overrides else config
    except (ConfigError, ValueError, json.JSONDecodeError) as error:
        print(f"rlpipe resume: {error}", file=sys.stderr)
        return 2
    if finished_result(config.run_dir) is not None:  # nothing to do, and nothing is written
        print(f"rlpipe resume: {config.run_dir} already finished; left as it is")
        return 0
    say_code_trusted("rlpipe resume", config, config.run_dir)
    launching = args.nproc_per_node is not None  # the ranks see train.parallel 'none' as ddp (_execute)
    if launching and isinstance(ranks := _with_parallel(config, _parallel_kind(config)), str):
        print(f"rlpipe resume: {ranks}", file=sys.stderr)
        return 2
    _say(f"resuming {config.flow} run {config.run_dir}: checking the model, tokenizer, environment and data")
    if problem := _preflight(config):
        print(f"rlpipe resume: {problem}", file=sys.stderr)
        return 2
    if launching:
        return launch(args, ["resume", *strip_launch_flags(argv)], config.run_dir)
    return _execute(config, resume=True)


def run_folder_root(folder: Path, config: RunConfig) -> Path:
    """The folder a resume acts on, wherever it lies now: `folder` itself, or for a pipeline
    phase's folder (its run.json's phase is not 'pipeline') the pipeline's folder above it."""
    folder = folder.resolve()
    state = folder / "run.json"
    phase = json.loads(state.read_text()).get("phase") if state.is_file() else None
    nested = config.flow == "pipeline" and phase not in (None, "pipeline")
    return folder.parent if nested else folder


def config_at(config: RunConfig, root: Path) -> RunConfig:
    """`config` for the run folder `root` (runs_root and run_name from where it lies now), so a
    moved or copied run resumes as itself and never writes to the folder it was copied from."""
    if config.run_dir.resolve() == root:
        return config
    return validate_config({**config.model_dump(mode="json"), "runs_root": str(root.parent),
                            "run_name": root.name})


def _say(text: str) -> None:
    """One progress line on stdout, at once (the steps before a run's first output take seconds
    to minutes: imports, pre-flight, the Prefect API, the model); said by the launching process
    only, not by every rank."""
    if launched_rank() is None or launched_rank()[0] == 0:
        print(f"rlpipe: {text}", flush=True)


def _preflight(config: RunConfig) -> str | None:
    """Why the run cannot start (tasks/preflight.py: the model, environment, data files, user
    code), checked before anything is written; None when it can. Ranks other than 0 leave it to
    rank 0."""
    if launched_rank() is not None and launched_rank()[0] > 0:
        return None
    try:
        preflight(config)
    except ConfigError as error:
        return str(error)
    return None


def _parallel_kind(config: RunConfig) -> str:
    """train.parallel of a launched run: 'none' means ddp (said once, so nobody is surprised)."""
    if config.train.parallel == "none":
        print("rlpipe: --nproc-per-node with train.parallel = 'none': training with ddp", file=sys.stderr)
        return "ddp"
    return config.train.parallel


def _rank_config(config: RunConfig) -> RunConfig | str:
    """The config a process runs with, or why it cannot: a launched rank gets a parallel kind
    (torchrun may start `rlpipe run` with 'none'); a single process may not ask for one."""
    if launched_rank() is None:
        if config.train.parallel != "none":
            return (f"train.parallel = {config.train.parallel!r} needs a distributed launch: add "
                    "--nproc-per-node N (1 is fine), or set train.parallel = 'none'")
        return config
    if config.device.startswith("cuda:") and launched_rank()[1] > 1:
        return (f"device = {config.device!r} would put every rank on one GPU; use 'cuda' or 'auto' "
                "(each rank takes the GPU of its LOCAL_RANK)")
    if config.train.parallel == "none":
        return _with_parallel(config, "ddp")
    return config


def _with_parallel(config: RunConfig, kind: str) -> RunConfig | str:
    """`config` as launched ranks run it (train.parallel = kind), validated again: some settings
    hold for one process only; or why it cannot run that way."""
    data = config.model_dump()
    data["train"]["parallel"] = kind
    try:
        return validate_config(data)
    except ConfigError as error:
        return str(error)


def _execute(config: RunConfig, overwrite: bool = False, resume: bool = False) -> int:
    from rlpipe.models.device import resolve_device

    try:  # before any run directory or tracking run exists
        resolve_device(config.device)
    except ValueError as error:
        print(f"rlpipe: {error}", file=sys.stderr)
        return 2
    config = _rank_config(config)
    if isinstance(config, str):
        print(f"rlpipe: {config}", file=sys.stderr)
        return 2
    if launched_rank() is not None:
        return run_rank(config, lambda: _execute_flow(config, overwrite, resume))
    return _execute_flow(config, overwrite, resume)


def _resume_hint(config: RunConfig) -> str:
    """"; `rlpipe resume RUN_DIR` continues" where the run folder holds a run, else nothing:
    a run stopped before its run.json was written has nothing to resume."""
    if (config.run_dir / "run.json").exists():
        return f"; `rlpipe resume {config.run_dir}` continues"
    return ""


def resume_advice(run_dir: Path, settings: list[str]) -> str:
    """The line after a failed run's error: the `rlpipe resume` command that continues it, with
    the `--set KEY=VALUE` settings the error names as its way out (flows/run_folders.py
    RESUME_SETTABLE), if any."""
    command = " ".join(["rlpipe resume", str(run_dir), *(f"--set {s}" for s in settings)])
    return (f"  nothing persisted was lost; `{command}` continues from the last complete stage"
            + (" with those settings" if settings else ""))


_STOP_EXIT = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal's number, as a shell reports it


def _stopped(name: str) -> str:
    return "interrupted (Ctrl-C)" if name == "SIGINT" else f"stopped by signal {name}"


def _execute_flow(config: RunConfig, overwrite: bool, resume: bool = False) -> int:
    began = time.perf_counter()
    try:
        acquire_run_lock(config.run_dir)
    except RunLockedError as error:
        print(f"rlpipe: {error}", file=sys.stderr)
        return 2
    try:
        if overwrite:  # never a folder that another process runs, holds or lies inside of
            refuse_locked_overwrite(config.run_dir)
            if (config.run_dir / "run.json").exists():
                clear_run_dir(config.run_dir)
        with sigterm_stops_the_run():
            _say("starting the Prefect API and building the model, optimizer and engines")
            result = start(config, resume=resume)
    except RunLockedError as error:
        print(f"rlpipe: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else (stop_signal() or "SIGTERM")
        print(f"rlpipe: {_stopped(name)}{_resume_hint(config)}", file=sys.stderr)
        return _STOP_EXIT[name]
    except Exception as error:  # noqa: BLE001 - one clear line; Prefect logged the traceback
        if (name := stop_signal()) is not None:  # the signal surfaced as another library's error
            print(f"rlpipe: {_stopped(name)} (surfacing as {type(error).__name__}: {error})"
                  f"{_resume_hint(config)}", file=sys.stderr)
            return _STOP_EXIT[name]
        if (disk := io_error(error)) is not None:  # a full disk, an I/O error: the path and errno
            print(f"rlpipe: run failed: storage error: {disk}; once that is fixed (space freed), "
                  f"`rlpipe resume {config.run_dir}` continues from the last complete stage", file=sys.stderr)
            return 1
        if isinstance(error, BatchMakerError):  # the user's maker: resuming as it is repeats the error
            print(f"rlpipe: run failed: {error}", file=sys.stderr)
            if (config.run_dir / "run.json").exists():
                print(f"  fix the batch maker (rl.buffer.batch_maker); then `rlpipe resume {config.run_dir}` "
                      "continues from the last complete stage", file=sys.stderr)
            return 1
        if (lost := lost_peers(error)) is not None:  # a rank of a data-parallel run died: its launcher advises
            print(f"rlpipe: run failed: {lost}", file=sys.stderr)
            return 1
        print(f"rlpipe: run failed: {type(error).__name__}: {error}", file=sys.stderr)
        if (config.run_dir / "run.json").exists():  # resume advice only where a run was persisted
            print(resume_advice(config.run_dir, getattr(error, "resume_settings", [])), file=sys.stderr)
        return 1
    finally:
        release_run_lock(config.run_dir)
    print("\n".join(summary_lines(config, result or {}, time.perf_counter() - began)))
    if (verdict := untrained_verdict(config, result or {})) is not None:
        print(verdict, file=sys.stderr)
        return 1
    return 0
