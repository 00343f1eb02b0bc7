"""Bytes per token at realistic sizes: what a run's rollouts, train_tokens and checkpoints cost on
disk per generated and per trained token, beside the same rollouts as prime-rl-style JSONL.

    python -m benchmarks.bench_bytes [--steps 2] [--prompts 16] [--group 8] [--completion 1000]
        [--out runs/bench/bytes.json]

One RL step here: `--prompts` prompts x `--group` completions of `--completion` tokens (prompts
of `--prompt` tokens), token ids drawn over Qwen3's 151,936-token vocabulary, log-probs as float32
(incompressible noise, as real log-probs mostly are), completion text of ~4 characters a token.
`rollouts` is written as a run writes it (storage/writer.py, zstd Parquet) with every column a
run fills; `train_tokens` as the train stage writes it: the step's sequences packed into
micro-batches of `--token-budget` tokens (ids, positions, labels, weights, the generator's and
the trainer's log-probs, per-token sample and position). JSONL, one object a completion with
prompt and completion text, ids, log-probs, reward and advantage (the shape prime-rl-style
pipelines log), is written raw and gzipped. Checkpoints: a Qwen3-0.6B checkpoint's bytes (the
model built on the meta device, so nothing is allocated: fp32 weights, AdamW's two fp32 moments
in optimizer.pt, the tokenizer files at their usual ~11 MB) divided by the tokens trained between
two checkpoints (`--checkpoint-every` steps), once per checkpoint kept (`checkpoint.keep_last`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from rlpipe.storage.compaction import table_files
from rlpipe.storage.schemas import schema_for
from rlpipe.storage.writer import write_table

from benchmarks.results import write_results
from tests.synthetic_runs import synthetic_step

VOCAB = 151_936
TOKENIZER_BYTES = 11_400_000  # Qwen3's tokenizer.json + tokenizer_config.json + vocab/merges
WORDS = np.array(["the", "answer", "is", "we", "compute", "so", "then", "therefore", "step", "sum",
                  "of", "and", "x", "=", "+", "carry", "digit", "check", "result", "because"])


def _text(rng: np.random.Generator, tokens: int) -> str:
    return " ".join(rng.choice(WORDS, size=max(1, tokens * 4 // 5)))  # ~4 characters a token


def _lists(values: list[np.ndarray], type_: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int32)
    flat = np.concatenate(values) if values else np.array([])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, type_))


def rollouts_step(step: int, prompts: int, group: int, prompt_len: int, completion_len: int,
                  rng: np.random.Generator) -> tuple[pa.Table, list[dict]]:
    """(the step's rollouts table, its JSONL records)."""
    n = prompts * group
    base = synthetic_step(step, run_id="bytes", n_groups=prompts, group_size=group, n_token_rows=0)["rollouts"]
    prompt_ids = [rng.integers(0, VOCAB, prompt_len, dtype=np.int32) for _ in range(prompts)]
    completion_ids = [rng.integers(0, VOCAB, completion_len, dtype=np.int32) for _ in range(n)]
    logprobs = [np.minimum(rng.normal(-0.3, 0.5, completion_len), 0).astype(np.float32) for _ in range(n)]
    prompt_text = [_text(rng, prompt_len) for _ in range(prompts)]
    completion_text = [_text(rng, completion_len) for _ in range(n)]
    columns = {
        "prompt_tokens": _lists([prompt_ids[i // group] for i in range(n)], pa.int32()),
        "completion_tokens": _lists(completion_ids, pa.int32()),
        "completion_logprobs": _lists(logprobs, pa.float32()),
        "prompt_text": pa.array([prompt_text[i // group] for i in range(n)]),
        "completion_text": pa.array(completion_text),
        "answer_text": pa.array([t[-40:] for t in completion_text]),
        "n_prompt_tokens": pa.array([prompt_len] * n, pa.int32()),
        "n_completion_tokens": pa.array([completion_len] * n, pa.int32()),
        "answer_tokens": pa.array([completion_len] * n, pa.int32()),
    }
    table = base
    for name, values in columns.items():
        index = table.schema.get_field_index(name)
        table = table.set_column(index, table.schema.field(index), values.cast(table.schema.field(index).type))
    rewards = rng.integers(0, 2, n).astype(float)
    records = [{"step": step, "example_id": base.column("example_id")[i].as_py(), "prompt": prompt_text[i // group],
                "completion": completion_text[i], "prompt_ids": prompt_ids[i // group].tolist(),
                "completion_ids": completion_ids[i].tolist(), "completion_logprobs": logprobs[i].tolist(),
                "reward": rewards[i], "advantage": float(rewards[i] - rewards[i // group * group:][:group].mean())}
               for i in range(n)]
    return table, records


def train_tokens_step(step: int, prompts: int, group: int, prompt_len: int, completion_len: int, budget: int,
                      rng: np.random.Generator) -> pa.Table:
    """The step's `train_tokens`: its sequences packed into micro-batches of `budget` tokens."""
    length = prompt_len + completion_len
    per_batch = max(1, budget // length)
    n, rows = prompts * group, []
    for batch_id, first in enumerate(range(0, n, per_batch)):
        count = min(per_batch, n - first)
        total = count * length
        labels = rng.integers(0, VOCAB, total, dtype=np.int32)
        labels.reshape(count, length)[:, :prompt_len] = -100
        loss = labels >= 0
        rows.append({
            "run_id": "bytes", "step": step, "batch_id": batch_id,
            "sample_ids": [f"bytes-s{step}-g{(first + k) // group}-{(first + k) % group}" for k in range(count)],
            "tokens": rng.integers(0, VOCAB, total, dtype=np.int32).tolist(),
            "position_ids": np.tile(np.arange(length, dtype=np.int32), count).tolist(),
            "cu_seqlens": (np.arange(count + 1, dtype=np.int32) * length).tolist(),
            "labels": labels.tolist(),
            "token_weights": np.where(loss, rng.normal(0, 1e-3, total), 0).astype(np.float32).tolist(),
            "log_probs": np.where(loss, np.minimum(rng.normal(-0.3, 0.5, total), 0), 0).astype(np.float32).tolist(),
            "trainer_logprobs": np.where(loss, np.minimum(rng.normal(-0.3, 0.5, total), 0), 0).astype(np.float32).tolist(),
            "token_sample": np.where(loss, np.repeat(np.arange(count), length), -1).tolist(),
            "token_position": np.where(loss, np.tile(np.arange(length) - prompt_len, count), -1).tolist(),
        })
    return pa.Table.from_pylist(rows, schema=schema_for("train_tokens"))


def qwen3_checkpoint_bytes() -> dict[str, int]:
    """A Qwen3-0.6B checkpoint's bytes: fp32 weights (tied embeddings stored once), optimizer.pt
    (AdamW: two fp32 moments a parameter), tokenizer files."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    return {"parameters": params, "weights": 4 * params, "optimizer": 8 * params, "tokenizer": TOKENIZER_BYTES,
            "total": 12 * params + TOKENIZER_BYTES}


def bench(steps: int, prompts: int, group: int, prompt_len: int, completion_len: int, budget: int,
          checkpoint_every: int, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    jsonl = folder / "rollouts.jsonl"
    with jsonl.open("w") as out:
        for step in range(1, steps + 1):
            table, records = rollouts_step(step, prompts, group, prompt_len, completion_len, rng)
            write_table(folder, "rollouts", step, table, run_id="bytes", durable=False)
            write_table(folder, "train_tokens", step,
                        train_tokens_step(step, prompts, group, prompt_len, completion_len, budget, rng),
                        run_id="bytes", durable=False)
            for record in records:
                out.write(json.dumps(record) + "\n")
    with jsonl.open("rb") as raw, gzip.open(folder / "rollouts.jsonl.gz", "wb", compresslevel=6) as packed:
        shutil.copyfileobj(raw, packed)
    generated = steps * prompts * group * completion_len
    trained = steps * prompts * group * (prompt_len + completion_len)  # tokens the trainer runs forward
    sizes = {name: sum(f.stat().st_size for f in table_files(folder, name)) for name in ("rollouts", "train_tokens")}
    sizes["jsonl"] = jsonl.stat().st_size
    sizes["jsonl_gzip"] = (folder / "rollouts.jsonl.gz").stat().st_size
    checkpoint = qwen3_checkpoint_bytes()
    per_interval = checkpoint_every * prompts * group  # completions between two checkpoints
    return {
        "settings": {"steps": steps, "prompts": prompts, "group": group, "prompt_tokens": prompt_len,
                     "completion_tokens": completion_len, "vocab": VOCAB, "token_budget": budget,
                     "checkpoint_every": checkpoint_every},
        "generated_tokens": generated, "trained_tokens": trained, "bytes": sizes,
        "bytes_per_generated_token": {name: round(size / generated, 2) for name, size in sizes.items()},
        "bytes_per_trained_token": {"train_tokens": round(sizes["train_tokens"] / trained, 2)},
        "checkpoint_qwen3_0_6b": checkpoint,
        "checkpoint_bytes_per_generated_token": round(checkpoint["total"] / (per_interval * completion_len), 1),
        "checkpoint_bytes_per_trained_token": round(checkpoint["total"] / (per_interval * (prompt_len + completion_len)), 1),
        "checkpoint_weights_only_bytes_per_trained_token": round(
            (checkpoint["weights"] + checkpoint["tokenizer"]) / (per_interval * (prompt_len + completion_len)), 1),
    }


def print_table(results: dict) -> None:
    s = results["settings"]
    print(f"{s['steps']} steps x {s['prompts']} prompts x group {s['group']}, {s['completion_tokens']}-token "
          f"completions, vocab {s['vocab']:,}: {results['generated_tokens']:,} generated, "
          f"{results['trained_tokens']:,} trained tokens")
    for name, per in results["bytes_per_generated_token"].items():
        print(f"  {name:<14} {results['bytes'][name] / 2**20:9.1f} MB   {per:7.2f} bytes / generated token")
    print(f"  train_tokens per trained token: {results['bytes_per_trained_token']['train_tokens']:.2f} bytes")
    c = results["checkpoint_qwen3_0_6b"]
    print(f"  Qwen3-0.6B checkpoint {c['total'] / 2**30:.2f} GiB ({c['weights'] / 2**30:.2f} weights, "
          f"{c['optimizer'] / 2**30:.2f} optimizer): {results['checkpoint_bytes_per_trained_token']:,} bytes / "
          f"trained token every {s['checkpoint_every']} steps "
          f"({results['checkpoint_weights_only_bytes_per_trained_token']:,} without optimizer state)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=1000, help="completion tokens")
    parser.add_argument("--token-budget", type=int, default=16384, help="tokens per packed micro-batch")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--out", default="runs/bench/bytes.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlpipe-bytes-") as folder:
        results = bench(args.steps, args.prompts, args.group, args.prompt, args.completion, args.token_budget,
                        args.checkpoint_every, Path(folder))
    write_results(args.out, results)
    print_table(results)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
