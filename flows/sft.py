"""Prefect flow `sft`: supervised fine-tuning with assistant-only loss weights.

    rlpipe run configs/sft.toml            # or: python -m rlpipe.flows.cli run configs/sft.toml
"""

from __future__ import annotations

from prefect import flow
from rlpipe.flows.common import phase_run_dir, resolve_config, write_run_report
from rlpipe.flows.supervised import run_supervised


@flow(name="sft", log_prints=True, persist_result=False)
def sft_flow(config_path: str | None = None, overrides: list[str] | None = None,
             config: dict | None = None) -> dict:
    """SFT a model on a task's demonstrations or a JSONL of chats; returns the last checkpoint."""
    cfg = resolve_config(config_path, overrides, config)
    result = run_supervised(cfg, "sft")
    write_run_report(cfg, [phase_run_dir(cfg, "sft")])
    return result
