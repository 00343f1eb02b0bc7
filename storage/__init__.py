"""rlpipe: storage — the run's tables on disk and experiment tracking.

schemas   Arrow schema of every table (SCHEMAS, SCHEMA_VERSION)
conform   rows / columns / Arrow tables checked and cast to a table's schema before a write
writer    write_table / is_complete / read_table: atomic zstd Parquet, one file per (table, step)
catalog   DuckDB connections and polars LazyFrames over one or several runs; catalog.duckdb
queries   run SQL or the canned dashboards/*.sql over runs
sqlcli    the `rlpipe sql` command
cliargs   argparse exits and refusals as exit statuses, for the commands called in-process
tracking  MLflow runs, metrics, checkpoints as model versions, aliases (NullTracker for tests)
"""
