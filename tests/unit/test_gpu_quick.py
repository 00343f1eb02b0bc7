"""`bench_gpu --quick` (benchmarks/gpu_quick.py): its parts' limits, the fit rule of the memory
part and the one table it prints and renders. The parts measure on CUDA; what they report is
checked here from a report of the shape they write."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_gpu import main
from benchmarks.gpu_quick import QUICK_LIMITS_S, QUICK_PARTS, fits, quick_part, render_quick


def _report() -> dict:
    memory = [{"preset": "qwen3-4b", "train_peak_gib": 30.2, "held_between_steps_gib": 22.7, "vllm_weights_gib": 7.5},
              {"preset": "qwen3-8b", "train_peak_gib": 81.0, "held_between_steps_gib": 45.8, "vllm_weights_gib": 15.3}]
    for row in memory:
        row["fits_80gib"] = fits(row)
    return {"measured": "one test GPU", "notes": ["a note"],
            "head": [{"precision": "pure bf16", "head": "fused", "tokens": 32768, "vocab": 151936,
                      "fwd_bwd_seconds": 0.178, "peak_extra_gib": 0.35}],
            "train": [{"weights": "float32", "head": "chunked", "seconds": 0.367, "mfu": 0.341, "peak_memory_gib": 31.5}],
            "memory": memory, "rl_vllm": {"skipped": "vllm and trl not installed"},
            "tests": {"summary": "21 passed, 2 skipped in 160s"}}


def test_every_quick_part_has_a_limit_and_they_run_in_order():
    assert QUICK_PARTS == ("head", "train", "memory", "rl_vllm", "tests")
    assert all(0 < QUICK_LIMITS_S[name] <= 600 for name in QUICK_PARTS)


@pytest.mark.parametrize("peak, held, weights, want", [(61.1, 45.8, 15.3, True), (81.0, 20.0, 5.0, False),
                                                        (70.0, 62.0, 15.3, False)])
def test_a_shape_fits_where_the_train_peak_and_generation_both_stay_under_80_gib(peak, held, weights, want):
    row = {"train_peak_gib": peak, "held_between_steps_gib": held, "vllm_weights_gib": weights}
    assert fits(row) is want
    assert fits({"preset": "qwen3-8b", "error": "out of GPU memory"}) is False


def test_the_table_has_a_row_per_figure_and_names_the_largest_fitting_shape():
    text = "\n".join(render_quick(_report()))
    assert "| head alone, 32,768 x 151,936 | fused, pure bf16 | fwd+bwd 0.1780 s, peak extra 0.35 GiB |" in text
    assert "| chunked head, float32 weights | 0.367 s/step, MFU 34.1%, peak 31.5 GiB |" in text
    assert "| qwen3-8b | train peak 81.0 GiB" in text and "fits 80 GiB: no |" in text
    assert "| largest shape that fits 80 GiB | lean options | qwen3-4b |" in text
    assert "skipped: vllm and trl not installed" in text and "| tests/gpu | 21 passed, 2 skipped in 160s |" in text
    assert "- a note" in text


def test_render_writes_a_quick_json_as_its_own_document(tmp_path):
    path = tmp_path / "gpu-quick.json"
    path.write_text(json.dumps(_report()))
    main(["--render", str(path)])
    text = path.with_suffix(".md").read_text()
    assert text.startswith("# GPU benchmarks, `--quick`") and "| `pytest -m gpu` | tests/gpu | 21 passed" in text


def test_the_vllm_part_says_what_is_missing_instead_of_failing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert quick_part("rl_vllm", None) == {"skipped": "vllm and trl not installed"}
