"""A truncated file in the newest checkpoint of a stopped run (weights, optimizer state), met by
`rlpipe resume` (the real CLI in subprocesses; the run is SIGKILLed by tests/fault_hooks right
after its last checkpoint's row, so it is not finished)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_commit_faults import HOOKS, run_killed_at, table_rows
from test_faults import STEP_TIMEOUT_S
from test_resume import ONE_THREAD, cli, env_for

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# phase -> (the run's overrides, its folder in the run's, its last step, the checkpoint before it);
# RL runs in the pipeline (its SFT cut to 4 steps): RL from the untrained preset samples no reward
# variance to train on
PHASES = {
    "sft": (["--set", "flow=sft", "--set", "sft.steps=8", "--set", "sft.checkpoint_every=4"], ".", 8, 4),
    "rl": (["--set", "sft.steps=4", "--set", "rl.steps=4", "--set", "rl.checkpoint_every=2"], "rl", 4, 2),
}


@pytest.mark.parametrize(("phase", "victim"), [("sft", "model.safetensors"), ("rl", "optimizer.pt")])
def test_a_truncated_newest_checkpoint_is_set_aside_and_its_steps_replayed(phase, victim, tmp_path, prefect_api_url):
    """Afterwards: the resume says in one line which file was damaged and where the folder went,
    replays the steps after the checkpoint before it and finishes (exit 0, no advice to resume
    again); the new newest checkpoint holds the same weights the damaged one was written with,
    and is registered once (the damaged one's version when its weights' sha256 is the same)."""
    runs, env = tmp_path / "runs", env_for(tmp_path, prefect_api_url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), env.get("PYTHONPATH")]))
    overrides, folder, last, before = PHASES[phase]
    run_dir = (runs / "torn" / folder).resolve()
    command = cli("run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=torn",
                  *overrides, *ONE_THREAD)
    point = f"after:{run_dir}/tables/checkpoints/step={last}/part-0.parquet"
    code = run_killed_at(command, env, point, tmp_path / "run.log")
    assert code == -signal.SIGKILL, (tmp_path / "run.log").read_text()[-3000:]
    newest = run_dir / "checkpoints" / f"step_{last:06d}"
    # copies: load_file maps the file, which is truncated below
    original = {name: tensor.clone() for name, tensor in load_file(newest / "model.safetensors").items()}
    kept = tmp_path / "original-row.json"
    kept.write_text(json.dumps(table_rows(run_dir, "checkpoints")[-1], default=str))
    file = newest / victim
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])

    resumed = warm_cli.run(cli("resume", str(runs / "torn")), env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=STEP_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    notes = [line for line in resumed.stderr.splitlines() if f"'{file}' is corrupt" in line]
    assert len(notes) == 1 and "moved it to" in notes[0], resumed.stderr[-3000:]
    aside = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(f".corrupt-step_{last:06d}-")]
    assert len(aside) == 1 and (aside[0] / victim).stat().st_size < (newest / victim).stat().st_size
    replayed = load_file(newest / "model.safetensors")
    assert replayed.keys() == original.keys()
    for name in original:
        torch.testing.assert_close(replayed[name], original[name], rtol=0, atol=1e-6, msg=name)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    steps = sorted(r["step"] for r in table_rows(run_dir, "train_steps"))
    assert steps == list(range(1, last + 1))
    rows = {r["step"]: r for r in table_rows(run_dir, "checkpoints")}
    versions = {step: row["mlflow_model_version"] for step, row in rows.items()}
    damaged = json.loads(kept.read_text())
    # the same weights' hash finds the damaged one's version; other bytes are another version
    same = rows[last]["sha256"] == damaged["sha256"]
    assert (versions[last] == damaged["mlflow_model_version"]) == same, (rows[last], damaged)
    assert len(set(versions.values())) == len(versions) and before in versions
    shutil.rmtree(aside[0])
