"""The recovery advice a failed run prints is a command that works: a step that cannot fill its
batch ends the run with `rlpipe resume RUN --set ...`, and that command, run as printed, goes on
past the step (the real CLI in subprocesses; the settings a resume may change are
flows/run_folders.py RESUME_SETTABLE)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests import warm_cli
from tests.integration.test_resume import ROOT, cli, env_for

pytestmark = pytest.mark.slow


def test_the_advice_after_a_batch_fill_error_resumes_the_run(tmp_path, prefect_api_url):
    """A fresh preset never answers right (no reward for the format): every group of step 1 has zero
    variance, and one sampling round without partial batches fails the step. The advice's command
    (twice the rounds, partial batches) resumes the run, which then goes through both steps; as
    they train on no sample, it ends with the verdict saying so (exit 1), not with the error."""
    runs, env = tmp_path / "runs", env_for(tmp_path, prefect_api_url)
    failed = warm_cli.run(
        cli("run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=unfilled",
            "--set", 'flow="rl"', "--set", "rl.steps=2", "--set", "rl.eval_every=0", "--set", "threads=1",
            "--set", "rl.buffer.max_attempts=1", "--set", "rl.buffer.oversample_factor=1.0"),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 1, failed.stderr[-3000:]
    advice = failed.stderr.strip().splitlines()[-1]
    run_dir = runs / "unfilled"
    assert advice == (f"  nothing persisted was lost; `rlpipe resume {run_dir} --set rl.buffer.max_attempts=2 "
                      "--set rl.buffer.partial_batches=true` continues from the last complete stage with those "
                      "settings"), failed.stderr[-3000:]
    command = shlex.split(re.search(r"`rlpipe (.+?)`", advice).group(1))
    resumed = warm_cli.run(cli(*command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    assert resumed.stderr.strip().splitlines()[-1].startswith("rlpipe: RL trained on no sample in its 2 steps")
    assert "rlpipe: rl run finished" in resumed.stdout
    saved = (Path(run_dir) / "config.json").read_text()
    assert '"partial_batches": true' in saved and '"max_attempts": 2' in saved  # the next resume's config
