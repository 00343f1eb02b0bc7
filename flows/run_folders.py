"""Which run folder a flow run writes, settled before anything is written.

`run_folder`: a new run's folder must hold no run; `resume` continues the run there with the
same config (a finished run is returned as it is); `overwrite` clears it first, unless another
process runs it or a run inside it or around it. A flow run of a Prefect deployment gets a folder
of its own, `<run_name>-<first 8 characters of the flow run id>`, unless its parameters say
`resume` or `overwrite` (which act on `<runs_root>/<run_name>`); its checkpoints are registered
under `tracking.registered_model`, else the deployment's `run_name` (never the folder's name), so a
deployment's runs are versions of one registered model per phase, told apart by their `run_dir` tag.

The run directory itself (run.json, tracking, the phase's lifecycle) is flows/common.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlpipe.flows.common import read_json, resolve_config
from rlpipe.tasks.config import RunConfig, stored_config_data


def clear_run_dir(run_dir: Path) -> None:
    """Delete what a run directory holds, but not its lock file (held by this process)."""
    from rlpipe.storage.runlock import LOCK_NAME

    for child in run_dir.iterdir():
        if child.name == LOCK_NAME:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def refuse_locked_overwrite(run_dir: Path) -> None:
    """RunLockedError naming the run and pid when another process runs `run_dir`, a run inside it,
    or a run it lies inside (a runs_root inside another run's folder): --overwrite would delete
    files that run is writing."""
    from rlpipe.storage.runlock import RunLockedError, locked_runs_around

    busy = locked_runs_around(run_dir)
    if not busy:
        return
    path, pid = busy[0]
    here = Path(run_dir).resolve()
    if path == here:
        why = "it is"
    elif path.is_relative_to(here):
        why = f"the run {path} inside it is"
    else:
        why = f"it lies inside the run {path}, which is"
    raise RunLockedError(f"refusing to overwrite {run_dir}: {why} running in another process (pid {pid})")


RESUME_MAY_CHANGE = frozenset({"runs_root", "run_name", "train.parallel"})
"""Config keys a resume may change: where the folder lies now, and how many processes train it
(`rlpipe resume --nproc-per-node N` trains a single-process run with ddp)."""


RESUME_SETTABLE = frozenset({
    *(f"{phase}.{key}" for phase in ("rl", "sft", "pretrain") for key in ("steps", "eval_every", "checkpoint_every")),
    "rl.buffer.max_attempts", "rl.buffer.oversample_factor", "rl.buffer.partial_batches",
    "rl.filter.drop_zero_variance", "rl.filter.drop_truncated", "rl.filter.sample_filter",
    "rl.scoring.max_reward_error_fraction", "engine.retries", "tracking.prefect_task_runs",
})
"""Config keys `rlpipe resume RUN --set KEY=VALUE` may change: how a step's batch is filled and
filtered (sampling rounds, partial batches, filters), retries, a phase's step counts (the
learning rate's cosine decay then stretches to the new count from the resumed step on), and
whether stages show as Prefect task runs (a deployment's resume given overrides of its own loses
the deployment's). None of them changes what a checkpoint holds or how a stored table reads;
every other key is refused."""


def resumed_with(config: RunConfig, overrides: list[str]) -> RunConfig:
    """`config` with `rlpipe resume`'s `--set KEY=VALUE` overrides applied; ConfigError naming the
    first key a resume may not change (RESUME_SETTABLE), or the override's problem."""
    from rlpipe.core.config import ConfigError, apply_overrides, parse_override
    from rlpipe.tasks.config import validate_config

    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key not in RESUME_SETTABLE:
            raise ConfigError(f"--set {key}: a resume keeps the run's settings, except {', '.join(sorted(RESUME_SETTABLE))}"
                              "; to change another, start a new run")
    return validate_config(apply_overrides(config.model_dump(mode="json"), overrides), "(--set)")


def config_differences(saved: dict, given: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (RESUME_MAY_CHANGE and
    RESUME_SETTABLE left out)."""
    keys = sorted(set(saved) | set(given))
    found = []
    for key in keys:
        if f"{prefix}{key}" in RESUME_MAY_CHANGE | RESUME_SETTABLE:
            continue
        a, b = saved.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}")
    return found


def compile_resolved(data: dict, config: RunConfig) -> dict:
    """A config dict whose `train.compile` is unset (auto: a config.json written before it was
    resolved, or a config not resolved yet) read as holding what auto resolves to for `config`'s
    device (flows/common.py resolve_config writes the resolved value): unset is no difference
    from what auto gives."""
    from rlpipe.tasks.setup import train_compile

    train = data.get("train")
    if isinstance(train, dict) and train.get("compile") is None:
        auto = config.model_copy(update={"train": config.train.model_copy(update={"compile": None})})
        return {**data, "train": {**train, "compile": train_compile(auto)}}
    return data


def deployment_run_name(run_name: str, flow_run_id: str | None, resume: bool, overwrite: bool) -> str:
    """The run folder name of a flow run: a deployment's own (`<run_name>-<flow run id[:8]>`)
    unless it resumes or overwrites; `run_name` itself outside a deployment (flow_run_id None)."""
    if flow_run_id is None or resume or overwrite:
        return run_name
    return f"{run_name}-{flow_run_id[:8]}"


@contextmanager
def run_folder(config: RunConfig, *, resume: bool = False, overwrite: bool = False,
               flow_run_id: str | None = None) -> Iterator[RunConfig]:
    """The config of the folder this flow run acts on (see the module docstring); ValueError with
    one line (RunLockedError for a running run) before anything is written when it may not."""
    from rlpipe.storage.runlock import acquire_run_lock, release_run_lock

    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other")
    name = deployment_run_name(config.run_name, flow_run_id, resume, overwrite)
    if name != config.run_name:  # the deployment's runs: versions of one registered model per phase
        tracking = config.tracking.model_copy(
            update={"registered_model": config.tracking.registered_model or config.run_name})
        config = config.model_copy(update={"run_name": name, "tracking": tracking})
    run_dir = config.run_dir
    exists = (run_dir / "run.json").is_file()
    if exists and not (resume or overwrite):
        raise ValueError(f"{run_dir} already holds a run: resume it (resume=true, same config) or start over "
                         "(overwrite=true)")
    if resume:
        if not (run_dir / "config.json").is_file():
            raise ValueError(f"nothing to resume: {run_dir} holds no run (no config.json)")
        saved = compile_resolved(stored_config_data(read_json(run_dir / "config.json")), config)
        if registered := (saved.get("tracking") or {}).get("registered_model"):
            if not config.tracking.registered_model:  # a deployment's run: the name it registers under
                config = config.model_copy(update={
                    "tracking": config.tracking.model_copy(update={"registered_model": registered})})
        if differ := config_differences(saved, compile_resolved(config.model_dump(mode="json"), config)):
            raise ValueError(f"refusing to resume {run_dir} with another config ({', '.join(differ[:5])} "
                             "differ from its config.json); overwrite=true starts over")
    if not overwrite:
        yield config
        return
    refuse_locked_overwrite(run_dir)
    acquire_run_lock(run_dir)
    try:
        if exists:
            clear_run_dir(run_dir)
        yield config
    finally:
        release_run_lock(run_dir)


def flow_run_identity() -> tuple[str | None, str | None]:
    """(flow run id, deployment id) of the Prefect flow run this code runs in (None outside one)."""
    from prefect.runtime import deployment, flow_run

    return flow_run.id, deployment.id


def name_flow_run() -> str:
    """A flow run's name: its run folder's name (a deployment's own folder, see `run_folder`)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    try:
        config = resolve_config(params.get("config_path"), params.get("overrides"), params.get("config"),
                                apply_threads=False)
    except Exception:  # noqa: BLE001 - the flow itself reports a bad config; a name must not fail
        return "invalid-config"
    flow_run_id, deployment_id = flow_run_identity()
    return deployment_run_name(config.run_name, flow_run_id if deployment_id else None,
                               bool(params.get("resume")), bool(params.get("overwrite")))


@contextmanager
def flow_run_folder(config_path: str | None, overrides: list[str] | None, config: dict | None, *,
                    resume: bool, overwrite: bool) -> Iterator[RunConfig]:
    """A flow's parameters → the validated config of the run folder it acts on (`run_folder`,
    with the Prefect flow run's identity: a deployment's run gets a folder of its own)."""
    resolved = resolve_config(config_path, overrides, config)
    flow_run_id, deployment_id = flow_run_identity()
    with run_folder(resolved, resume=resume, overwrite=overwrite,
                    flow_run_id=flow_run_id if deployment_id else None) as settled:
        yield settled
