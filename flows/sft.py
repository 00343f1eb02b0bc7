"""Prefect flow `sft`: supervised fine-tuning with assistant-only loss weights.

    rlpipe run configs/sft.toml            # or: python -m rlpipe.flows.cli run configs/sft.toml
"""

from __future__ import annotations

from prefect import flow
from rlpipe.flows.common import already_finished, phase_run_dir, write_run_report
from rlpipe.flows.run_folders import flow_run_folder, name_flow_run
from rlpipe.flows.supervised import run_supervised


@flow(name="sft", flow_run_name=name_flow_run, log_prints=True, persist_result=False)
def sft_flow(config_path: str | None = None, overrides: list[str] | None = None,
             config: dict | None = None, resume: bool = False, overwrite: bool = False) -> dict:
    """SFT a model on a task's demonstrations or a JSONL of chats; returns the last checkpoint."""
    with flow_run_folder(config_path, overrides, config, resume=resume, overwrite=overwrite) as cfg:
        if (done := already_finished(phase_run_dir(cfg, "sft"))) is not None:
            return done
        result = run_supervised(cfg, "sft")
    write_run_report(cfg, [phase_run_dir(cfg, "sft")])
    return result
