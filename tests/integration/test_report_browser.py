"""The report of a tiny synthetic run renders in headless Chromium: no JavaScript error, every plot drawn.

The page's script sets `<html data-rlpipe-report="ok:<plots>:<points>">` when it finished, or
`error:<message>` (window.onerror); `--dump-dom` gives the DOM after the page's scripts ran.
A screenshot is left in the test's tmp folder (report.png) for a human to look at.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess

import pytest

from dashboards import report
from storage.synthetic import synthetic_step
from storage.writer import write_table

STEPS = (0, 1, 2, 3, 4)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def _chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)
    if found is None:
        pytest.skip("chromium not installed: apt-get install -y chromium (.ci/run does)")
    return found


def _run(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def _write_run(run_dir, run_id: str, rl: bool) -> None:
    for step in STEPS:
        if rl:
            tables = synthetic_step(step, run_id=run_id, n_groups=6, group_size=4, n_token_rows=2, n_examples=8)
            for name, table in tables.items():
                write_table(run_dir, name, step, table, run_id=run_id, durable=False)
        write_table(run_dir, "train_steps", step, [dict(
            mode="rl" if rl else "sft", loss=2.0 / (step + 1) + (0 if rl else 0.3), grad_norm=1.0 + step % 2 + rl,
            lr=1e-4 * (1 + step if rl else 2), tokens=500, tokens_per_second=900.0 + (1 + rl) * step, seconds_generate=0.8 if rl else None, seconds_train=1.1,
            seconds_total=2.0)], run_id=run_id, durable=False)
        write_table(run_dir, "evals", step, [dict(env="arithmetic", example_id=str(i), reward=float(i % 2),
                                                   correct=(i + step) % 3 == 0) for i in range(6)],
                    run_id=run_id, durable=False)


@pytest.mark.browser
def test_report_renders_in_headless_chromium(tmp_path):
    chromium = _chromium()
    _write_run(tmp_path / "rl", "tiny/rl", rl=True)
    _write_run(tmp_path / "sft", "tiny/sft", rl=False)
    out = report.write_report([tmp_path / "rl", tmp_path / "sft"], tmp_path / "report.html")
    expected = [item["id"] for section in report.report_data([tmp_path / "rl", tmp_path / "sft"])["sections"]
                for item in section["plots"] if "series" in item]
    assert {"reward", "zero_variance", "attempts", "completion_length", "loss", "grad_norm", "lr",
            "train_tps", "seconds_total", "eval_arithmetic"} <= set(expected)

    done = _run(chromium, tmp_path, "--dump-dom", out.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    status = re.search(r'<html[^>]*\bdata-rlpipe-report="([^"]*)"', done.stdout)
    assert status, "the page's script never finished: " + done.stdout[:500]
    state = html.unescape(status.group(1))
    assert state.startswith("ok:"), state
    _, n_plots, n_points = state.split(":")
    drawn = {match.group(1): int(match.group(2)) for match in
             re.finditer(r'<svg class="plot"[^>]*data-plot-id="([^"]+)"[^>]*data-points="(\d+)"', done.stdout)}
    assert sorted(drawn) == sorted(expected) and int(n_plots) == len(expected)
    assert all(points > 0 for points in drawn.values()), drawn
    assert int(n_points) == sum(drawn.values())
    assert drawn["loss"] == 2 * len(STEPS)  # two runs overlaid
    assert drawn["reward"] == len(STEPS)  # the SFT run has no scores
    assert done.stdout.count('class="kind-best"') == len(STEPS)  # one best sample per step
    assert "has no rows in 'scores'" in done.stdout  # the visible note

    shot = tmp_path / "report.png"
    done = _run(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", out.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
