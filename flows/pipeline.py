"""Prefect flow `pipeline`: SFT, then RL starting from the SFT run's latest checkpoint.

Each phase has its own run directory (`runs/<name>/sft`, `runs/<name>/rl`) and a nested MLflow
run under one parent run.

    rlpipe run configs/demo.toml
"""

from __future__ import annotations

from prefect import flow
from rlpipe.flows.common import make_tracker, open_run, resolve_config, run_phase, write_run_report
from rlpipe.flows.rl import run_rl
from rlpipe.flows.supervised import run_supervised
from rlpipe.training import metric_names as m


@flow(name="pipeline", log_prints=True, persist_result=False)
def pipeline_flow(config_path: str | None = None, overrides: list[str] | None = None,
                  config: dict | None = None) -> dict:
    """SFT then RL; returns both phases' final checkpoints and eval metrics."""
    cfg = resolve_config(config_path, overrides, config)
    state = open_run(cfg, "pipeline")
    tracker = make_tracker(cfg, state)

    def sft_then_rl() -> dict:
        sft = run_supervised(cfg, "sft", parent_mlflow_run_id=state.mlflow_run_id)
        rl = run_rl(cfg, parent_mlflow_run_id=state.mlflow_run_id, start_checkpoint=sft["checkpoint"])
        tracker.log_metrics({"pipeline/sft_accuracy": sft["eval"].get(m.EVAL_ACCURACY, 0.0),
                             "pipeline/rl_accuracy": rl["eval"].get(m.EVAL_ACCURACY, 0.0)}, step=0)
        return {"sft": sft, "rl": rl, "run_dir": str(cfg.run_dir)}

    result = run_phase(state, tracker, sft_then_rl)
    write_run_report(cfg, [cfg.run_dir / "rl", cfg.run_dir / "sft"])
    return result
