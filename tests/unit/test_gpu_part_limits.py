"""bench_gpu's per-part time limit (benchmarks/bench_gpu.py `run_limited`): a part that runs past
its limit is killed with its whole process group and recorded as an error, and the report names it.
The parts themselves need CUDA; the limit is plain process handling, checked here with stand-ins."""

from __future__ import annotations

import json
import sys
import time

from benchmarks.bench_gpu import PART_LIMITS_S, main, run_limited
from benchmarks.gpu_report import PARTS


def test_every_part_has_a_stated_limit():
    assert set(PART_LIMITS_S) == set(PARTS) and all(0 < s <= 1800 for s in PART_LIMITS_S.values())


def test_a_part_past_its_limit_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "grandchild-alive"
    # the part starts a child of its own (as rl_vs_trl_vllm starts its sides) and both hang
    grandchild = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).touch()"
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    result = run_limited([sys.executable, "-c", code], 1.5, tmp_path / "out.json")
    assert time.monotonic() - start < 10
    assert result == {"error": "no result within 1.5 s (the part's limit; --part-timeout-s changes it)"}
    time.sleep(3.5)
    assert not marker.exists()  # the part's own child went with it


def test_a_part_that_ends_gives_its_json_and_one_that_fails_its_error(tmp_path):
    out = tmp_path / "out.json"
    code = f"import json, pathlib; pathlib.Path({str(out)!r}).write_text(json.dumps({{'seconds': 1.5}}))"
    assert run_limited([sys.executable, "-c", code], 60, out) == {"seconds": 1.5}
    failed = run_limited([sys.executable, "-c", "raise SystemExit('no CUDA here')"], 60, tmp_path / "none.json")
    assert failed["error"].startswith("exit status 1:") and "no CUDA here" in failed["error"]


def test_the_report_names_a_part_without_a_result(tmp_path):
    report = {"device": "NVIDIA H100", "measured": "one NVIDIA H100", "peak_bf16_tflops": 989.0,
              "train": {"error": "no result within 900 s (the part's limit; --part-timeout-s changes it)"}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(report))
    main(["--render", str(path)])
    text = path.with_suffix(".md").read_text()
    assert "- part `train` gave no result: no result within 900 s" in text
    assert "## Train step" not in text
