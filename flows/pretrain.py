"""Prefect flow `pretrain`: next-token prediction on documents (token weights 1).

    rlpipe run configs/pretrain.toml
"""

from __future__ import annotations

from prefect import flow
from rlpipe.flows.common import already_finished, phase_run_dir, write_run_report
from rlpipe.flows.run_folders import flow_run_folder, name_flow_run
from rlpipe.flows.supervised import run_supervised


@flow(name="pretrain", flow_run_name=name_flow_run, log_prints=True, persist_result=False)
def pretrain_flow(config_path: str | None = None, overrides: list[str] | None = None,
                  config: dict | None = None, resume: bool = False, overwrite: bool = False) -> dict:
    """Pretrain a model from a preset on a text corpus (or the task's texts); returns the last checkpoint."""
    with flow_run_folder(config_path, overrides, config, resume=resume, overwrite=overwrite) as cfg:
        if (done := already_finished(phase_run_dir(cfg, "pretrain"))) is not None:
            return done
        result = run_supervised(cfg, "pretrain")
    write_run_report(cfg, [phase_run_dir(cfg, "pretrain")])
    return result
