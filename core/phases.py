"""The phases of one RL step, in order, named once: the `seconds_<phase>` columns of the
train_steps table (storage/schemas.py), the `perf/seconds_<phase>` metrics (core/metric_names.py)
and the report's timing plots all read this tuple."""

PHASES: tuple[str, ...] = ("generate", "score", "filter", "pack", "train", "checkpoint", "sync", "eval")
