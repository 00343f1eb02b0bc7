"""docs/BENCHMARKS.md is generated: it is exactly what benchmarks/run_all.py renders from
docs/BENCHMARKS.json, so an edit by hand (or a headline changed without a re-render) shows here."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.run_all import render

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_benchmarks_page_is_the_render_of_its_json():
    report = json.loads((DOCS / "BENCHMARKS.json").read_text())
    assert render(report) == (DOCS / "BENCHMARKS.md").read_text(), \
        ("docs/BENCHMARKS.md differs from its JSON: edit the benchmarks, not the page; re-render with "
         "`cp docs/BENCHMARKS.json runs/bench/all.json && python -m benchmarks.run_all --render`")
    assert "cluster_scoring" in report["benchmarks"]
