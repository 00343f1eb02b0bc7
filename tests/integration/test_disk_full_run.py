"""A full disk at each writer of a run (table partitions, checkpoint weights, optimizer state,
MLflow's store), met by the real CLI in a subprocess (tests/fault_hooks injects it), then
`rlpipe resume` once there is space again.

One run meets them in turn: `rlpipe run` with step 3's partition failing, then a `rlpipe resume`
with each other writer's disk full, each carrying on from what the one before left, and a last
resume with space again. Every process is a CLI start of its own (the cost of these tests), so the
resume after each fault is the next one in the chain: it must get past what the one before failed
on (step 3's partition, then step 4's checkpoint weights, then its optimizer state) before its own
writer fails, and the last one, without a fault, finishes the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_faults import STEP_TIMEOUT_S, mlflow_statuses
from test_resume import ONE_THREAD, cli, env_for

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "fault_hooks"
pytestmark = pytest.mark.slow
STEPS = 8

# writer -> (the files it fails on, the file the error must name, relative to the run folder), in
# the order the chain meets them: each of the first three fails later in the run than the one
# before; MLflow's store fails at the run's next metrics
WRITERS = {
    "parquet": ("*/tables/train_steps/step=3/*", "tables/train_steps/step=3/part-0.parquet"),
    "safetensors": ("*step_000004*/model.safetensors", "checkpoints/step_000004/model.safetensors"),
    "torch": ("*step_000004*/optimizer.pt", "checkpoints/step_000004/optimizer.pt"),
    "mlflow": ("*", None),  # the tracking store: mlflow.db
}


def test_a_full_disk_at_each_writer_ends_the_run_in_one_line_and_resume_completes_it(tmp_path, prefect_api_url):
    """Afterwards, at each writer: the run (or resume) exits 1, its last line names the errno and
    the file it could not write and says that resume continues; run.json and the MLflow run say
    failed. A resume without the fault exits 0 with every step trained, each checkpoint
    registered once, everything finished."""
    runs, env = tmp_path / "runs", env_for(tmp_path, prefect_api_url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), env.get("PYTHONPATH")]))
    run_dir = runs / "full"
    command = cli("run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=full",
                  "--set", "flow=sft", "--set", f"sft.steps={STEPS}", "--set", "sft.checkpoint_every=4", *ONE_THREAD)
    for writer, (pattern, named) in WRITERS.items():
        failed = warm_cli.run(command, env={**env, "RLPIPE_TEST_ENOSPC": f"{writer}:{pattern}"}, cwd=ROOT,
                              capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
        last = failed.stderr.strip().splitlines()[-1] if failed.stderr.strip() else ""
        path = str(run_dir / named) if named else str(tmp_path / "mlflow.db")
        assert failed.returncode == 1, (writer, failed.stderr[-3000:])
        assert f"[Errno 28] No space left on device: '{path}'" in last, (writer, failed.stderr[-3000:])
        assert f"`rlpipe resume {run_dir}` continues" in last, writer
        assert json.loads((run_dir / "run.json").read_text())["status"] == "failed", writer
        assert mlflow_statuses(tmp_path / "mlflow.db", "rlpipe-tiny") == {"full": "FAILED"}, writer
        command = cli("resume", str(run_dir))

    resumed = warm_cli.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    assert mlflow_statuses(tmp_path / "mlflow.db", "rlpipe-tiny") == {"full": "FINISHED"}
    steps = sorted(r["step"] for f in (run_dir / "tables" / "train_steps").glob("step=*/*.parquet")
                   for r in pq.read_table(f).to_pylist())
    assert steps == list(range(1, STEPS + 1))
    rows = [r for f in (run_dir / "tables" / "checkpoints").glob("step=*/*.parquet") for r in pq.read_table(f).to_pylist()]
    assert sorted((r["step"], r["mlflow_model_version"]) for r in rows) == [(4, "1"), (8, "2")]
