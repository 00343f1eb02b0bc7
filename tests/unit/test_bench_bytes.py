"""The bytes-per-token benchmark measures what it says: the tables as a run writes them, the same
rollouts as JSONL, and a Qwen3-0.6B checkpoint's size from its parameter count."""

from __future__ import annotations

from benchmarks.bench_bytes import bench, qwen3_checkpoint_bytes


def test_qwen3_0_6b_checkpoint_is_about_seven_gigabytes():
    checkpoint = qwen3_checkpoint_bytes()
    assert 590e6 < checkpoint["parameters"] < 610e6  # Qwen3-0.6B, tied embeddings counted once
    assert checkpoint["optimizer"] == 2 * checkpoint["weights"]
    assert 6.5 * 2**30 < checkpoint["total"] < 7.5 * 2**30


def test_small_run_bytes(tmp_path):
    results = bench(steps=1, prompts=2, group=2, prompt_len=20, completion_len=100, budget=256,
                    checkpoint_every=10, folder=tmp_path)
    assert results["generated_tokens"] == 400 and results["trained_tokens"] == 480
    sizes = results["bytes"]
    assert sizes["jsonl_gzip"] < sizes["jsonl"] and min(sizes.values()) > 0
    assert results["bytes_per_generated_token"]["rollouts"] == round(sizes["rollouts"] / 400, 2)
    # 2 sequences of 120 tokens per 256-token micro-batch: two train_tokens rows
    from rlpipe.storage.writer import read_table

    assert read_table(tmp_path, "train_tokens", 1).num_rows == 2
    assert len((tmp_path / "rollouts.jsonl").read_text().splitlines()) == 4
