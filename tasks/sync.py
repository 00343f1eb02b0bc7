"""Stage `sync`: hand the newest weights to every inference engine → the `syncs` table.

In-process engines share the trainer's tensors (a sync is free and needs no checkpoint);
servers get the checkpoint path. Engines sync in parallel; a failed sync is retried with
backoff, and a step whose sync failed on any engine fails loudly after its rows are written.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlpipe.engines.base import Engine
from rlpipe.storage.stage_tables import StageTable, stage


class SyncError(RuntimeError):
    """An engine did not take the new weights."""


def engine_name(engine: Engine, index: int) -> str:
    return getattr(engine, "name", None) or f"{type(engine).__name__}[{index}]"


def sync_one(engine: Engine, path: str | None, version: int, retries: int, backoff_s: float) -> tuple[float, str | None]:
    start, error = time.perf_counter(), None
    for attempt in range(retries + 1):
        try:
            engine.sync(path, version)
            return time.perf_counter() - start, None
        except Exception as exc:  # noqa: BLE001 - recorded, then raised for the step
            error = f"{type(exc).__name__}: {exc}"
            if attempt < retries:
                time.sleep(backoff_s * 2**attempt)
    return time.perf_counter() - start, error


def sync_engines(
    engines: list[Engine], checkpoint_path: str | None, policy_version: int, *, run_id: str,
    step: int, retries: int = 2, backoff_s: float = 0.5,
) -> list[dict]:
    """Sync every engine in parallel; one `syncs` row each (never raises: see `raise_failed`)."""
    with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
        results = list(pool.map(lambda e: sync_one(e, checkpoint_path, policy_version, retries, backoff_s), engines))
    return [
        {"run_id": run_id, "step": step, "engine": engine_name(engine, i),
         "checkpoint_path": checkpoint_path or "", "policy_version": policy_version,
         "seconds": seconds, "ok": error is None, "error": error}
        for i, (engine, (seconds, error)) in enumerate(zip(engines, results, strict=True))
    ]


def raise_failed(rows: list[dict] | None) -> None:
    """SyncError naming every engine of `rows` that did not take the weights (none: no rows)."""
    failed = [r for r in rows or () if not r["ok"]]
    if failed:
        details = "; ".join(f"{r['engine']}: {r['error']}" for r in failed)
        raise SyncError(f"step {rows[0]['step']}, stage sync: {len(failed)} engine(s) did not take "
                        f"{rows[0]['checkpoint_path'] or 'the new weights'}: {details}")


SYNCS = StageTable("syncs", rows=lambda rows, a: rows, durable=True, keep_stored=lambda a: a["only_missing"])
"""Written at once (a sync may follow the step's checkpoint); a resume's re-sync keeps stored rows."""


@stage("sync", retries=1, tables=(SYNCS,), check=raise_failed)
def sync_task(engines, checkpoint_path, policy_version, *, run_dir: Path, run_id: str, step: int,
              retries: int, only_missing: bool = False) -> list[dict] | None:
    """Sync the engines that hold their own weights copy and write their `syncs` rows at once
    (a sync may follow the step's checkpoint); raises SyncError after the rows are written.
    `only_missing`: a resume's re-sync, whose rows repair a step killed before writing them."""
    engines = [e for e in engines if not e.shares_weights]
    if not engines:
        return None
    return sync_engines(engines, checkpoint_path, policy_version, run_id=run_id, step=step, retries=retries)
