"""Prefect flow `pretrain`: next-token prediction on documents (token weights 1).

    rlpipe run configs/pretrain.toml
"""

from __future__ import annotations

from prefect import flow
from rlpipe.flows.common import phase_run_dir, resolve_config, write_run_report
from rlpipe.flows.supervised import run_supervised


@flow(name="pretrain", log_prints=True, persist_result=False)
def pretrain_flow(config_path: str | None = None, overrides: list[str] | None = None,
                  config: dict | None = None) -> dict:
    """Pretrain a model from a preset on a text corpus (or the task's texts); returns the last checkpoint."""
    cfg = resolve_config(config_path, overrides, config)
    result = run_supervised(cfg, "pretrain")
    write_run_report(cfg, [phase_run_dir(cfg, "pretrain")])
    return result
