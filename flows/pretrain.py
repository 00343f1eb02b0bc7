"""Prefect flow `pretrain`: next-token prediction on documents (token weights 1).

    rlpipe run configs/pretrain.toml
"""

from __future__ import annotations

from prefect import flow

from flows.common import resolve_config
from flows.supervised import run_supervised


@flow(name="pretrain", log_prints=True, persist_result=False)
def pretrain_flow(config_path: str | None = None, overrides: list[str] | None = None,
                  config: dict | None = None) -> dict:
    """Pretrain a model from a preset on a text corpus (or the task's texts); returns the last checkpoint."""
    return run_supervised(resolve_config(config_path, overrides, config), "pretrain")
