"""Readers see snapshots while a run writes, rewrites and compacts its tables.

Three reader processes loop over a run's `scores` while this process grows it to 120 steps through
the background writer (a compaction pass every 10 steps, as after each checkpoint), then rewrites
steps 1-60 and merges them again, twice: the plain-DuckDB way (`catalog.duckdb` opened
read-only), `rlpipe sql`'s connection (storage/queries.py `run_sql`) and polars
(storage/catalog.py `lazy_frame`). Every read must succeed and see whole steps, each row once,
and never fewer rows than an earlier read of the same reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlpipe.storage.background_writer import BackgroundWriter
from rlpipe.storage.catalog import ensure_catalog

from tests.synthetic_runs import synthetic_step

ROOT = Path(__file__).resolve().parents[2]
ROWS = 4  # rows of scores per step
WIDTH = 10  # steps per compacted range
STEPS = 120
REWRITTEN = 60  # steps 1-60 are rewritten and merged again, PASSES times
PASSES = 2

CHECK = (f"SELECT count(*), count(DISTINCT sample_id), count(DISTINCT step), "
         f"(SELECT count(*) FROM (SELECT step FROM scores GROUP BY step HAVING count(*) <> {ROWS})) FROM scores")

READER = f"""
import json, sys, time
from pathlib import Path
run, kind, stop, out = sys.argv[1:5]
reads = []
def read():
    if kind == "catalog":
        import duckdb
        con = duckdb.connect(run + "/catalog.duckdb", read_only=True)
        try:
            return list(con.sql({CHECK!r}).fetchall()[0])
        finally:
            con.close()
    if kind == "sql":
        from rlpipe.storage.queries import run_sql
        return list(run_sql([run], {CHECK!r}).to_pylist()[0].values())
    from rlpipe.storage.catalog import lazy_frame
    import polars as pl
    frame = lazy_frame([run], "scores").collect()
    partial = frame.group_by("step").len().filter(pl.col("len") != {ROWS}).height
    return [frame.height, frame["sample_id"].n_unique(), frame["step"].n_unique(), partial]
Path(out + ".ready").write_text("")
while not Path(stop).exists() and len(reads) < 2000:
    try:
        reads.append(read())
    except Exception as error:
        reads.append(type(error).__name__ + ": " + str(error).splitlines()[0])
reads.append(read())  # one more once the writer is done
Path(out).write_text(json.dumps(reads))
"""


def _scores(step: int):
    return synthetic_step(step, run_id="r", n_groups=1, group_size=ROWS, n_token_rows=0)["scores"]


def _grow_and_rewrite(run: Path) -> None:
    """The probe's writes: steps 1..STEPS with a pass every WIDTH steps, then PASSES rewrites of
    steps 1-REWRITTEN (each step's range already merged: fresh wins, the next pass merges it again)."""
    with BackgroundWriter() as writer:
        for step in range(1, STEPS + 1):
            writer.submit(run, "scores", step, _scores(step), run_id="r")
            if step % WIDTH == 0:
                writer.compact(run, step, width=WIDTH)
        for _ in range(PASSES):
            for step in range(1, REWRITTEN + 1):
                writer.submit(run, "scores", step, _scores(step), run_id="r")
                if step % WIDTH == 0:
                    writer.compact(run, STEPS, width=WIDTH)
                    writer.drain()  # the reads interleave with each pass


@pytest.mark.slow
def test_reads_during_writes_rewrites_and_compaction_see_whole_steps_and_never_fewer(tmp_path):
    run = tmp_path / "run"
    with BackgroundWriter() as writer:
        for step in range(1, 6):
            writer.submit(run, "scores", step, _scores(step), run_id="r")
    ensure_catalog(run)
    stop = tmp_path / "stop"
    readers = {}
    for kind in ("catalog", "sql", "polars"):
        out = tmp_path / f"{kind}.json"
        readers[kind] = (out, subprocess.Popen([sys.executable, "-c", READER, str(run), kind, str(stop), str(out)],
                                               cwd=ROOT))
    deadline = time.monotonic() + 60
    while not all(Path(f"{out}.ready").exists() for out, _ in readers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    _grow_and_rewrite(run)
    stop.write_text("")
    problems = []
    for kind, (out, process) in readers.items():
        assert process.wait(timeout=120) == 0, kind
        problems += _problems(kind, json.loads(out.read_text()))
    assert not problems, "\n".join(problems)


def _problems(kind: str, reads: list) -> list[str]:
    """What a reader saw wrong: failed reads, a row twice or a partial step, fewer rows than before."""
    errors = [read for read in reads if isinstance(read, str)]
    seen = [read for read in reads if not isinstance(read, str)]
    problems = [f"{kind}: {len(errors)} of {len(reads)} reads failed, e.g. {errors[0]}"] if errors else []
    if len(reads) < 10:
        problems.append(f"{kind}: only {len(reads)} reads")
    wrong = [read for read in seen if read[1:] != [read[0], read[0] // ROWS, 0] or read[0] % ROWS]
    if wrong:
        problems.append(f"{kind}: {len(wrong)} reads saw a row twice or a partial step, e.g. {wrong[0]}")
    counts = [read[0] for read in seen]
    shorter = [n for i, n in enumerate(counts) if n < max(counts[: i + 1])]
    if shorter:
        problems.append(f"{kind}: {len(shorter)} of {len(reads)} reads saw fewer rows than an earlier one "
                        f"(down to {min(shorter) // ROWS} steps)")
    if not seen or counts[-1] != STEPS * ROWS:
        problems.append(f"{kind}: the last read saw {counts[-1:]} rows, not {STEPS * ROWS}")
    return problems
