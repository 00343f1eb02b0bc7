"""Storage benchmark: write 1,000,000 rollout rows over 500 steps, then time the canned queries.

    python -m benchmarks.bench_storage [--rows 1000000] [--steps 500] [--out runs/bench/storage.json]
        [--compact-every 10] [--long-rows 200000 --long-steps 10000]

Compaction (storage/compaction.py) runs as in a run that checkpoints every `--compact-every`
steps: a pass over the closed steps after each checkpoint (0 = off, today's one file per
partition); its time is reported apart. A second, long run (`--long-steps`, 10,000 by default,
without fsync; 0 = skip) shows query time at the step counts of real runs: its target is each
canned query under 0.5 s.

Rollouts carry token ids and log-probs on 10% of rows (100,000 of 1M); scores (one per rollout)
and groups (group size 8) are written too, since reward_by_step and zero_variance_by_step read
them. Writes are durable (fsync; --no-fsync to compare) and atomic, one partition per (table, step), as in a real run.
Queries run through `storage.queries.run_canned` (a fresh in-memory DuckDB with the run's views,
as `rlpipe sql` does) and through `<run>/catalog.duckdb`; target: each under 1 s on 2 cores.
Data generation is not timed. Timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import duckdb
from rlpipe.storage.catalog import ensure_catalog
from rlpipe.storage.queries import canned_sql, run_canned
from rlpipe.storage.writer import compact_run, write_table

from benchmarks.results import write_results
from tests.synthetic_runs import synthetic_step

GROUP_SIZE = 8
QUERIES = ("reward_by_step", "zero_variance_by_step")


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def bench(
    rows: int, steps: int, token_share: float, run_dir: Path, durable: bool = True, repeats: int = 3,
    compact_every: int = 10,
) -> dict:
    """Write the synthetic run, time queries; returns the figures as a dict."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    n_groups = max(1, rows // steps // GROUP_SIZE)
    rows_per_step = n_groups * GROUP_SIZE
    token_rows = round(rows_per_step * token_share)
    write_seconds = {"rollouts": 0.0, "scores": 0.0, "groups": 0.0}
    write_cpu_seconds = 0.0
    generate_seconds = 0.0
    compact_seconds = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        tables = synthetic_step(
            step,
            run_id=run_dir.name,
            n_groups=n_groups,
            group_size=GROUP_SIZE,
            n_token_rows=token_rows,
        )
        generate_seconds += time.perf_counter() - start
        for name, table in tables.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            write_table(run_dir, name, step, table, durable=durable)
            write_seconds[name] += time.perf_counter() - start
            write_cpu_seconds += time.process_time() - cpu_start
        if compact_every and step % compact_every == 0:  # the pass a run's writer queues after a checkpoint
            start = time.perf_counter()
            compact_run(run_dir, closed=step)
            compact_seconds += time.perf_counter() - start

    results = {
        "rows": rows_per_step * steps,
        "steps": steps,
        "token_rows": token_rows * steps,
        "groups": n_groups * steps,
        "generate_seconds_untimed": round(generate_seconds, 3),
        "write_seconds": {name: round(value, 3) for name, value in write_seconds.items()},
        "write_seconds_total": round(sum(write_seconds.values()), 3),
        "write_cpu_seconds_total": round(write_cpu_seconds, 3),
        "durable": durable,
        "compact_every": compact_every,
        "compact_seconds": round(compact_seconds, 3),
        "files": {name: sum(1 for _ in (run_dir / "tables" / name).rglob("*.parquet")) for name in write_seconds},
        "disk_bytes": {name: folder_bytes(run_dir / "tables" / name) for name in write_seconds},
        "queries": {},
    }
    results["disk_mb_total"] = round(sum(results["disk_bytes"].values()) / 2**20, 1)
    ensure_catalog(run_dir)
    for name in QUERIES:
        timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            table = run_canned([run_dir], name)
            timings.append(time.perf_counter() - start)
        assert table.num_rows == steps, (name, table.num_rows)
        con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
        catalog_timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            con.sql(canned_sql(name)).to_arrow_table()
            catalog_timings.append(time.perf_counter() - start)
        con.close()
        results["queries"][name] = {
            "seconds_first": round(timings[0], 3),
            "seconds_best": round(min(timings), 3),
            "catalog_seconds_first": round(catalog_timings[0], 3),
            "catalog_seconds_best": round(min(catalog_timings), 3),
        }
    return results


def print_table(results: dict) -> None:
    print(
        f"rows {results['rows']:,} over {results['steps']} steps, tokens on {results['token_rows']:,} rows"
    )
    for name, seconds in results["write_seconds"].items():
        print(
            f"  write {name:<10} {seconds:8.2f} s   {results['disk_bytes'][name] / 2**20:8.1f} MB"
        )
    print(
        f"  write total      {results['write_seconds_total']:8.2f} s   {results['disk_mb_total']:8.1f} MB"
        f"   (cpu {results['write_cpu_seconds_total']:.2f} s, fsync {'on' if results['durable'] else 'off'})"
    )
    print(f"  files            {sum(results['files'].values()):8,}      compaction every "
          f"{results['compact_every'] or '-'} steps: {results['compact_seconds']:.2f} s")
    for name, timing in results["queries"].items():
        print(
            f"  {name:<24} first {timing['seconds_first']:.3f} s  best {timing['seconds_best']:.3f} s"
            f"  (catalog.duckdb: {timing['catalog_seconds_first']:.3f} / {timing['catalog_seconds_best']:.3f} s)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rollout rows in all")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--token-share", type=float, default=0.1, help="share of rows carrying token lists"
    )
    parser.add_argument(
        "--run-dir", default="runs/bench/storage_run", help="where the synthetic run is written"
    )
    parser.add_argument("--no-fsync", action="store_true", help="write with durable=False")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic run afterwards")
    parser.add_argument("--out", default="runs/bench/storage.json")
    parser.add_argument("--compact-every", type=int, default=10,
                        help="a compaction pass every N steps, as after each checkpoint (0 = off)")
    parser.add_argument("--long-rows", type=int, default=200_000, help="rollout rows of the long run")
    parser.add_argument("--long-steps", type=int, default=10_000, help="steps of the long run (0 = skip it)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    results = bench(args.rows, args.steps, args.token_share, run_dir, durable=not args.no_fsync,
                    compact_every=args.compact_every)
    if not args.keep:
        shutil.rmtree(run_dir)
    if args.long_steps:
        long_dir = run_dir.with_name(run_dir.name + "_long")
        results["long_run"] = bench(args.long_rows, args.long_steps, args.token_share, long_dir, durable=False,
                                    compact_every=args.compact_every)
        if not args.keep:
            shutil.rmtree(long_dir)
    write_results(args.out, results)
    print_table(results)
    if "long_run" in results:
        print_table(results["long_run"])
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
