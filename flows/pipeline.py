"""Prefect flow `pipeline`: SFT, then RL starting from the SFT run's latest checkpoint.

Each phase has its own run directory (`runs/<name>/sft`, `runs/<name>/rl`), a nested MLflow run
under one parent run, and a Prefect subflow run of its own (`<name>/sft`, `<name>/rl`), so the
Prefect UI shows both phases under the pipeline's flow run, with their stages as task runs when
`tracking.prefect_task_runs` is on.

    rlpipe run configs/demo.toml
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from rlpipe.core import metric_names as m
from rlpipe.flows.common import (
    already_finished,
    make_tracker,
    open_run,
    run_phase,
    write_run_report,
)
from rlpipe.flows.rl import run_rl
from rlpipe.flows.run_folders import flow_run_folder, name_flow_run
from rlpipe.flows.supervised import run_supervised
from rlpipe.tasks.config import RunConfig


def _phase_name() -> str:
    """A phase subflow run's name: `<run folder name>/<phase>`."""
    params = flow_run.parameters
    return f"{params['config'].run_name}/{params['phase']}"


@flow(name="pipeline-phase", flow_run_name=_phase_name, log_prints=True, persist_result=False,
      validate_parameters=False)
def phase_flow(config: RunConfig, phase: str, parent_mlflow_run_id: str | None = None,
               start_checkpoint: str | None = None) -> dict:
    """One phase of the pipeline (sft | rl) as a subflow run of the pipeline's flow run."""
    if phase == "rl":
        return run_rl(config, parent_mlflow_run_id=parent_mlflow_run_id, start_checkpoint=start_checkpoint)
    return run_supervised(config, phase, parent_mlflow_run_id=parent_mlflow_run_id)


@flow(name="pipeline", flow_run_name=name_flow_run, log_prints=True, persist_result=False)
def pipeline_flow(config_path: str | None = None, overrides: list[str] | None = None,
                  config: dict | None = None, resume: bool = False, overwrite: bool = False) -> dict:
    """SFT then RL; returns both phases' final checkpoints and eval metrics. resume / overwrite:
    act on an existing run folder (flows/run_folders.py `run_folder`)."""
    with flow_run_folder(config_path, overrides, config, resume=resume, overwrite=overwrite) as cfg:
        if (done := already_finished(cfg.run_dir)) is not None:
            return done
        state = open_run(cfg, "pipeline")
        tracker = make_tracker(cfg, state)

        def sft_then_rl() -> dict:
            sft = phase_flow(cfg, "sft", parent_mlflow_run_id=state.mlflow_run_id)
            rl = phase_flow(cfg, "rl", parent_mlflow_run_id=state.mlflow_run_id, start_checkpoint=sft["checkpoint"])
            tracker.log_metrics({"pipeline/sft_accuracy": sft["eval"].get(m.EVAL_ACCURACY, 0.0),
                                 "pipeline/rl_accuracy": rl["eval"].get(m.EVAL_ACCURACY, 0.0)}, step=0)
            return {"sft": sft, "rl": rl, "run_dir": str(cfg.run_dir)}

        result = run_phase(state, tracker, sft_then_rl)
    write_run_report(cfg, [cfg.run_dir / "rl", cfg.run_dir / "sft"])
    return result
