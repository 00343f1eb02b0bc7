"""Replay one RL optimizer step from the stored tables and the checkpoint before it, and compare
its loss, grad norm, lr and per-token trainer log-probs with what the run logged.

    report = replay_step(run_dir, step)        # StepCheck per replayed step; report.ok

How: the trainer state before step N is the checkpoint `step_<N-1>` (weights, optimizer and
scheduler state). Without one, the nearest earlier checkpoint (or, before any, the run's starting
weights: `--start`, the `origins` table, `model.path`, else the seeded preset) is loaded and the
steps in between are replayed forward with their stored micro-batches, so the optimizer state
evolves exactly as in the run. Each step's micro-batches come back tensor for tensor from
`train_tokens` (tasks/tokens.py) and go through the run's own `train_on_batches` with the trainer,
loss and options its config.json builds (tasks/build.py, in one process). On CPU in fp32 with the run's thread count, every number matches
bit for bit; a GPU run is replayed on its device but is not bit-exact in general.

Supported: async runs (rl.off_policy.max_steps >= 1: the step trains on stored batches, however
old the weights that sampled them), ppo_epochs > 1 (the optimizer state comes with the checkpoint;
the logged figures are the last epoch's), partial batches, a KL penalty (reference = the starting
weights). A step trained over several ranks (train.parallel) is replayed in one process on the
same micro-batches: the ranks summed gradients, losses and norms in another order, so it is
compared within a relative (log-probs: absolute) tolerance of `PARALLEL_TOLERANCE`, not bit for
bit, and the output says so. Refused, naming why: LoRA runs (checkpoints hold merged weights, the
adapters' optimizer state is not a plain model's).
Not a Prefect stage: nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch
from rlpipe.storage.compaction import table_files
from rlpipe.storage.layout import relocated, tables_root
from rlpipe.storage.writer import read_table
from rlpipe.tasks.build import StartPoint, build, rl_plan
from rlpipe.tasks.tokens import packed_batch
from rlpipe.tasks.train import train_on_batches
from rlpipe.training.checkpoint_files import checkpoint_dir, checkpoint_steps

PARALLEL_TOLERANCE = 1e-4
"""How far a data-parallel step's replay may be from the logged figures. Measured on configs/tiny.toml
with 2 gloo ranks (ddp, tests/integration/test_distributed_run.py), steps 3-4 replayed from the step-2
checkpoint: loss within 3e-8 relative, grad norm and lr equal, trainer log-probs equal at step 3 and
within 5e-7 at step 4 (weights one step apart by float order). 2-rank weights stay within 1e-5 of one
process after 3 steps (tests/integration/test_distributed.py): a few steps forward stay well inside."""


class ReplayError(ValueError):
    """The step cannot be replayed from this run folder; the message says why."""


@dataclass
class StepCheck:
    """One replayed step: logged and replayed values side by side, and what differs."""

    step: int
    rows: list[tuple[str, str, str, bool]] = field(default_factory=list)
    """(name, logged, replayed, equal) per compared value."""

    @property
    def mismatches(self) -> list[str]:
        return [name for name, _, _, equal in self.rows if not equal]


@dataclass
class Replay:
    run_dir: Path
    step: int
    start: str
    """Where the trainer state came from (a checkpoint folder or the starting weights)."""
    checks: list[StepCheck]
    tolerance: float = 0.0
    """0: bit for bit; else a train.parallel run's (`PARALLEL_TOLERANCE`)."""
    notes: list[str] = field(default_factory=list)
    """A line per later checkpoint the replay could not start from (removed by retention)."""

    @property
    def ok(self) -> bool:
        return not any(check.mismatches for check in self.checks)


def load_config(run_dir: Path):
    from rlpipe.tasks.config import read_run_config  # the run's own validated config

    path = run_dir / "config.json"
    if not path.is_file():
        raise ReplayError(f"{run_dir} is not a run directory (no config.json)")
    return read_run_config(json.loads(path.read_text()), str(path))


def refuse_unsupported(config) -> None:
    """ReplayError naming the setting that makes a bit-exact replay impossible here."""
    if config.model.lora.rank:
        raise ReplayError("model.lora: checkpoints hold merged weights and the optimizer state covers the "
                          "adapters only, so the trainer state before a step cannot be rebuilt as a plain model")


def tolerance_for(config) -> float:
    """0 (bit for bit) for a single-process run; `PARALLEL_TOLERANCE` for one trained over ranks."""
    parallel = getattr(getattr(config, "train", None), "parallel", "none")
    return 0.0 if parallel in (None, "none") else PARALLEL_TOLERANCE


def start_weights(run_dir: Path, config, start: str | None) -> str:
    """The run's starting weights: `start`, the `origins` table (the run's lineage: a folder, or a
    hub model's ORG/NAME@COMMIT, which the builder resolves to that snapshot), model.path, or ''
    for the seeded preset. A pipeline's RL phase without a recorded origin is refused."""
    if start:
        return start
    # read by path: the origins table may be newer than this module's schemas
    for origin in table_files(run_dir, "origins") if (tables_root(run_dir) / "origins").is_dir() else []:
        rows = pq.read_table(origin, columns=["parent_checkpoint"]).column(0).to_pylist()
        if rows and rows[0]:  # the copy's own SFT checkpoint when the run folder was copied or moved
            return relocated(str(rows[0]), run_dir)
    if config.model.path:
        return config.model.path
    if config.flow == "pipeline":
        raise ReplayError("this pipeline RL phase started from the SFT checkpoint, which the run does not record "
                          "(no origins table): pass --start SFT_CHECKPOINT, or replay a step with a checkpoint "
                          "before it")
    return ""


def trainer_state(run_dir: Path, config, from_step: int, start: str | None):
    """(trainer, loss, origin text): the trainer state after step `from_step` (its checkpoint; 0: the
    starting weights and a fresh optimizer), built in this process by the run's own builder
    (tasks/build.py), with the KL reference of the starting weights when the run had one."""
    rl = config.rl
    # the starting weights only when the replay starts there, or the KL penalty's reference needs them
    first = start_weights(run_dir, config, start) if not from_step or rl.loss.kl_coef > 0 else None
    resume = checkpoint_dir(run_dir, from_step) if from_step else None
    weights = first if first is not None else str(resume)
    plan = dataclasses.replace(rl_plan(config), engines="none", single_process=True)
    built = build(config, plan, StartPoint(weights=weights, resume=resume, restore_rng=False))
    origin = str(resume) if resume is not None else first or f"the seeded preset {config.model.preset!r}"
    return built.trainer, built.loss_fn, origin


def stored_step(run_dir: Path, step: int) -> tuple[list[dict], dict]:
    """The step's `train_tokens` rows (by batch_id) and its `train_steps` row."""
    try:
        logged = read_table(run_dir, "train_steps", step).to_pylist()
    except FileNotFoundError:
        raise ReplayError(f"step {step} was not trained in {run_dir} (no train_steps row)") from None
    try:
        rows = read_table(run_dir, "train_tokens", step).to_pylist()
    except FileNotFoundError:
        raise ReplayError(f"step {step} has no train_tokens rows (a run from before `rlpipe replay` existed, "
                          "or one whose tables were removed)") from None
    return sorted(rows, key=lambda r: r["batch_id"]), logged[0]


def _same(a: float | None, b: float | None, tolerance: float = 0.0) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tolerance * max(abs(a), abs(b))


def compare(step: int, logged: dict, metrics: dict, rows: list[dict],
            seen: dict[tuple[str, ...], torch.Tensor], tolerance: float = 0.0) -> StepCheck:
    """Logged against replayed: equal, or within `tolerance` (relative for the figures, absolute
    for the log-probs)."""
    check = StepCheck(step)
    for name in ("loss", "grad_norm", "lr"):
        a, b = logged.get(name), metrics.get(name)
        b = None if b is None else float(b)
        check.rows.append((name, repr(a), repr(b), _same(a, b, tolerance)))
    stored = [r["trainer_logprobs"] for r in rows]
    replayed = [seen.get(tuple(r["sample_ids"])) for r in rows]
    if all(s is None for s in stored) and not seen:  # a step that ran no forward pass
        check.rows.append(("trainer_logprobs", "none (no forward pass)", "none", True))
        return check
    n = sum(len(s or []) for s in stored)
    if any(s is None for s in stored) or any(t is None or t.numel() != len(s) for s, t in zip(stored, replayed,
                                                                                             strict=True)):
        have = sum(t.numel() for t in replayed if t is not None)
        check.rows.append(("trainer_logprobs", f"{n} packed tokens", f"{have} packed tokens", False))
        return check
    diffs = [torch.tensor(s, dtype=torch.float32) - t for s, t in zip(stored, replayed, strict=True)]
    unequal = sum(int((d != 0).sum()) for d in diffs)
    worst = max((float(d.abs().max()) for d in diffs if d.numel()), default=0.0)
    check.rows.append(("trainer_logprobs", f"{n} packed tokens", f"{n - unequal} equal, max |diff| {worst:.3g}",
                       unequal == 0 or worst <= tolerance))
    return check


def replay_step(run_dir: str | Path, step: int, start: str | None = None) -> Replay:
    """Replay `step` (and, from an earlier checkpoint, the steps before it); see the module docstring."""
    run_dir = Path(run_dir).resolve()
    config = load_config(run_dir)
    refuse_unsupported(config)
    if not 1 <= step <= config.rl.steps:
        raise ReplayError(f"--step {step} is outside the run's steps 1..{config.rl.steps}")
    from_step, notes = replay_start(run_dir, step)
    for s in range(from_step + 1, step + 1):  # fail before loading a model when a step is missing
        stored_step(run_dir, s)
    if config.threads:
        torch.set_num_threads(config.threads)
    trainer, loss_fn, origin = trainer_state(run_dir, config, from_step, start)
    checks = []
    for s in range(from_step + 1, step + 1):
        rows, logged = stored_step(run_dir, s)
        batches = [packed_batch(row) for row in rows]
        seen: dict[tuple[str, ...], torch.Tensor] = {}
        metrics = train_on_batches(trainer, batches, loss_fn, step=s, trainer_logprobs=seen)
        checks.append(compare(s, logged, metrics, rows, seen, tolerance_for(config)))
    return Replay(run_dir, step, origin, checks, tolerance_for(config), notes)


def replay_start(run_dir: Path, step: int) -> tuple[int, list[str]]:
    """(the newest checkpoint before `step` holding the trainer state, 0 for none: the starting
    weights), and a line for each checkpoint after it that the run wrote but checkpoint retention
    (`checkpoint.keep_last`) removed, or whose optimizer state it removed."""
    from rlpipe.training.checkpoint_retention import optimizer_dropped

    usable = [s for s in checkpoint_steps(run_dir) if s < step and not optimizer_dropped(checkpoint_dir(run_dir, s))]
    from_step = max(usable, default=0)
    notes = []
    for row in _checkpoint_rows(run_dir, step):
        if from_step < row["step"] < step:
            folder = checkpoint_dir(run_dir, row["step"])
            why = "was removed" if not folder.is_dir() else "holds no optimizer state"
            notes.append(f"the checkpoint of step {row['step']} {why} (checkpoint retention, "
                         "checkpoint.keep_last): not a start")
    return from_step, notes


def _checkpoint_rows(run_dir: Path, step: int) -> list[dict]:
    """The run's `checkpoints` rows through `step` (the tables as of the replayed step), one per
    step (none without the table)."""
    try:
        rows = read_table(run_dir, "checkpoints", as_of_step=step).to_pylist()
    except (FileNotFoundError, ValueError):
        return []
    return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])


def format_replay(replay: Replay) -> str:
    """The replay's figures beside the logged ones, and a verdict line naming what differs."""
    first = replay.checks[0].step if replay.checks else replay.step
    lines = [f"replay of {replay.run_dir} step {replay.step}, trainer state from {replay.start}"]
    lines += replay.notes
    if replay.tolerance:
        lines.append(f"a train.parallel run replayed in one process: the ranks summed in another order, so "
                     f"values are compared within {replay.tolerance:g} (relative; log-probs absolute), not bit for bit")
    if first == 1 and replay.step > 1:
        lines.append(f"no checkpoint before step {replay.step}: replaying steps 1..{replay.step} forward from the "
                     "starting weights (fresh optimizer and scheduler, as the run began)")
    elif first < replay.step:
        lines.append(f"no checkpoint after step {first - 1}: replaying steps {first}..{replay.step} forward "
                     "(optimizer and scheduler state included)")
    lines.append(f"{'step':>5}  {'value':<17} {'logged':<28} {'replayed':<28} match")
    for check in replay.checks:
        for name, logged, replayed, equal in check.rows:
            lines.append(f"{check.step:>5}  {name:<17} {logged:<28} {replayed:<28} {'yes' if equal else 'NO'}")
    bad = [f"step {c.step}: {', '.join(c.mismatches)}" for c in replay.checks if c.mismatches]
    exact = f"within {replay.tolerance:g}" if replay.tolerance else "bit for bit"
    lines.append("MISMATCH: " + "; ".join(bad) if bad else f"OK: step {replay.step} matches {exact}")
    return "\n".join(lines)
