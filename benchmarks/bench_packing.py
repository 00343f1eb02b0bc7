"""Packed (varlen attention) vs padded training throughput, real tokens per second.

The same 16 sequences (lengths uniform in [32, 256], seeded) are trained one optimizer step at a
time (forward + backward + AdamW), either

- packed: `training.batch.pack` into micro-batches of at most `--budget` tokens, run through
  `models.attention.model_hidden_states` (projections/MLPs on real tokens only, attention padded
  per length bucket), or
- padded: the conventional [16, max_len] batch with an attention mask through transformers' sdpa,

for dense and MoE presets, in fp32 and under bf16 autocast. Timings alternate packed/padded per
repeat so both see the same machine load; the median over repeats is reported. The loss is a
weighted NLL written inline (float logits), identical for both paths.

    python -m benchmarks.bench_packing [--presets small-dense small-moe] [--repeats 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rlpipe.models.attention import model_hidden_states
from rlpipe.models.loading import autocast_context
from rlpipe.models.presets import build_model
from rlpipe.training.batch import PackedBatch, Sequence, pack
from rlpipe.training.padding import pack_stats, pad_batch

from benchmarks.results import write_results

VOCAB = 100


def make_sequences(n: int = 16, lo: int = 32, hi: int = 256, seed: int = 0) -> list[Sequence]:
    """`n` random-token sequences with lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [
        Sequence(tokens=torch.randint(4, VOCAB, (k,), generator=g).tolist(), weights=[1.0] * k)
        for k in lengths
    ]


def _weighted_nll(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_t w_t * -log p(labels_t): logits [N, V], labels/weights [N]."""
    nll = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
    return (nll * weights).sum()


def packed_step(model, batches: list[PackedBatch], optimizer, autocast: bool) -> None:
    total_w = sum(float(b.token_weights.sum()) for b in batches)
    for b in batches:
        with autocast_context("cpu", autocast):
            hidden, aux = model_hidden_states(model, b)
            logits = model.lm_head(hidden)
            loss = _weighted_nll(logits, b.labels, b.token_weights) / total_w
            if aux is not None:
                loss = loss + model.config.router_aux_loss_coef * aux / len(batches)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def padded_step(model, padded, optimizer, autocast: bool) -> None:
    moe = getattr(model.config, "output_router_logits", False)
    with autocast_context("cpu", autocast):
        out = model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            use_cache=False,
            **({"output_router_logits": True} if moe else {}),
        )
        v = out.logits.shape[-1]
        loss = _weighted_nll(out.logits.reshape(-1, v), padded.labels.reshape(-1), padded.weights.reshape(-1))
        loss = loss / padded.weights.sum()
        if moe:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _fresh(preset: str, attn: str | None):
    model = build_model(preset, VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
    if attn is not None:
        model.set_attn_implementation(attn)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_case(preset: str, autocast: bool, seqs, budget: int, repeats: int, warmup: int) -> dict:
    batches = pack(seqs, budget)
    padded = pad_batch(seqs, pad_id=0)
    real = sum(len(s.tokens) for s in seqs)
    packed_model, packed_opt = _fresh(preset, None)
    padded_model, padded_opt = _fresh(preset, "sdpa")  # transformers' own path, the baseline
    for _ in range(warmup):
        packed_step(packed_model, batches, packed_opt, autocast)
        padded_step(padded_model, padded, padded_opt, autocast)
    t_packed, t_padded, c_packed, c_padded = [], [], [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        packed_step(packed_model, batches, packed_opt, autocast)
        t1, c1 = time.perf_counter(), time.process_time()
        padded_step(padded_model, padded, padded_opt, autocast)
        t2, c2 = time.perf_counter(), time.process_time()
        t_packed.append(t1 - t0)
        t_padded.append(t2 - t1)
        c_packed.append(c1 - c0)
        c_padded.append(c2 - c1)
    packed_s, padded_s = statistics.median(t_packed), statistics.median(t_padded)
    packed_cpu, padded_cpu = statistics.median(c_packed), statistics.median(c_padded)
    return {
        "preset": preset,
        "precision": "bf16-autocast" if autocast else "fp32",
        "params": sum(p.numel() for p in packed_model.parameters()),
        "real_tokens": real,
        "micro_batches": len(batches),
        "packed_s": packed_s,
        "padded_s": padded_s,
        "packed_tok_s": real / packed_s,
        "padded_tok_s": real / padded_s,
        "speedup": padded_s / packed_s,
        # CPU seconds of the process: with --threads 1 this ignores time spent descheduled on a
        # shared machine, so the ratio is steadier than the wall-clock one.
        "packed_cpu_s": packed_cpu,
        "padded_cpu_s": padded_cpu,
        "cpu_speedup": padded_cpu / packed_cpu,
        "packed_s_all": t_packed,
        "padded_s_all": t_padded,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["small-dense", "small-moe"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: leave torch's setting alone); 1 gives steadier CPU-time ratios",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench/bench_packing.json"))
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    seqs = make_sequences(seed=args.seed)
    stats = pack_stats(seqs, args.budget)
    print(
        f"16 sequences, {stats.n_tokens} real tokens; padded batch wastes "
        f"{stats.padding_fraction:.0%} (limit speedup {1 / (1 - stats.padding_fraction):.2f}x); "
        f"{stats.n_micro_batches} packed micro-batch(es) of <= {args.budget} tokens"
    )
    results = []
    header = (
        f"{'preset':<12} {'precision':<14} {'packed tok/s':>12} {'padded tok/s':>12} "
        f"{'speedup':>8} {'cpu-time speedup':>17}"
    )
    print(header)
    for preset in args.presets:
        for precision in args.precisions:
            r = run_case(preset, precision == "bf16", seqs, args.budget, args.repeats, args.warmup)
            results.append(r)
            print(
                f"{r['preset']:<12} {r['precision']:<14} {r['packed_tok_s']:>12.0f} "
                f"{r['padded_tok_s']:>12.0f} {r['speedup']:>7.2f}x {r['cpu_speedup']:>16.2f}x"
            )
    report = {
        "benchmark": "bench_packing",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "budget": args.budget,
        "padding_fraction": stats.padding_fraction,
        "results": results,
    }
    write_results(args.out, report)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
