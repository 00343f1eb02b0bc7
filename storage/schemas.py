"""Arrow schemas of the run tables (docs/DESIGN.md, "Stages and their tables").

One schema per table; every table starts with `run_id` (string) and `step` (int64). `step` is
stored inside every Parquet file *and* names the partition folder (`step=<k>`), so a single file
is self-describing; readers take it from the file (DuckDB with `hive_partitioning=false`).

Conventions:
- ids (`sample_id`, `group_id`, `example_id`) are strings; `batch_id` is the int32 index of the
  micro-batch inside its step; token ids are list<int32>, log-probs list<float32>.
- `scores.components` is map<string, float32> (reward component name -> value). DuckDB reads it
  as MAP(VARCHAR, FLOAT): `components['correct']` gives the value, `to_json(components)` a JSON
  object; polars reads it as list<struct<key, value>>.
- Non-nullable fields must be given; nullable ones may be left out and become null.

SCHEMA_VERSION goes into each file's Parquet metadata (`rlpipe.schema_version`) together with the
table name (`rlpipe.table`). Bump it when a column changes type or meaning; readers union files
by column name, so adding a nullable column needs no bump.
"""

from __future__ import annotations

import pyarrow as pa
from rlpipe.core.phases import PHASES

SCHEMA_VERSION = 1
META_TABLE = b"rlpipe.table"
META_VERSION = b"rlpipe.schema_version"

_TOKENS = pa.list_(pa.int32())
_LOGPROBS = pa.list_(pa.float32())


def _f(name: str, type_: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


def _opt(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=True)


# one span of a multi-turn completion: turn index, "model" (sampled, trained) or "env" (weight 0),
# offset and length in completion_tokens, and the per-turn reward an env span carries
_TURN = pa.struct([_f("turn", pa.int32()), _f("producer", pa.string()), _f("start", pa.int32()),
                   _f("length", pa.int32()), pa.field("reward", pa.float32(), nullable=True)])


_KEY = [_f("run_id", pa.string()), _f("step", pa.int64())]
# the phases of an RL step, in order (core/phases.py): the seconds_* columns of train_steps
_SECONDS = [_opt(f"seconds_{phase}", pa.float64()) for phase in (*PHASES, "total")]

_FIELDS: dict[str, list[pa.Field]] = {
    # one row per completion (generate)
    "rollouts": _KEY
    + [
        _f("policy_version", pa.int32()),
        _f("env", pa.string()),
        _f("example_id", pa.string()),
        _f("group_id", pa.string()),
        _f("sample_id", pa.string()),
        _f("attempt", pa.int32()),
        _opt("prompt_tokens", _TOKENS),
        _opt("completion_tokens", _TOKENS),
        _opt("completion_logprobs", _LOGPROBS),
        _opt("finish_reason", pa.string()),  # "stop" | "length" | engine-specific
        _opt("prompt_text", pa.string()),
        _opt("completion_text", pa.string()),
        _f("n_prompt_tokens", pa.int32()),
        _f("n_completion_tokens", pa.int32()),
        # multi-turn episodes (envs/multiturn.py); null for single-turn rollouts
        _opt("n_turns", pa.int32()),
        _opt("turns", pa.list_(_TURN)),  # spans of completion_tokens: who produced which
        _opt("messages", pa.string()),  # the transcript as JSON chat messages
        # reasoning vs answer (models/chat.py split_thinking_tokens); null for episodes
        _opt("thinking_tokens", pa.int32()),  # inside <think> ... </think>, tags included
        _opt("answer_tokens", pa.int32()),
        _opt("answer_text", pa.string()),  # the text the reward saw
        # versions of the weights that sampled the first and the last token (they differ only
        # with rl.off_policy.partial_rollouts); policy_version <= first_policy_version <= last_policy_version
        _opt("first_policy_version", pa.int32()),
        _opt("last_policy_version", pa.int32()),
        # on-policy distillation (rl.teacher): the teacher's log-prob of each completion token
        _opt("teacher_logprobs", _LOGPROBS),
        # ... and the teacher that gave them: name, checkpoint, server URL (null in process)
        _opt("teacher", pa.string()),
        _opt("teacher_checkpoint", pa.string()),
        _opt("teacher_url", pa.string()),
    ],
    # one row per completion (score)
    "scores": _KEY
    + [
        _f("sample_id", pa.string()),
        _f("group_id", pa.string()),
        _f("reward", pa.float32()),
        _opt("components", pa.map_(pa.string(), pa.float32())),
        _opt("error", pa.string()),  # null, or why the reward function failed
    ],
    # one row per group of completions of one prompt (filter/advantages)
    "groups": _KEY
    + [
        _f("group_id", pa.string()),
        _f("env", pa.string()),
        _f("example_id", pa.string()),
        _f("policy_version", pa.int32()),
        _f("n", pa.int32()),
        _f("reward_mean", pa.float32()),
        _f("reward_std", pa.float32()),
        _f("zero_variance", pa.bool_()),
        _f("kept", pa.bool_()),
        _f("attempts", pa.int32()),
        # the group's fate at this step: trained | carried | zero_variance | stale | over_cap
        _opt("status", pa.string()),
    ],
    # one row per kept completion (filter/advantages)
    "advantages": _KEY
    + [
        _f("sample_id", pa.string()),
        _f("group_id", pa.string()),
        _f("advantage", pa.float32()),
    ],
    # one row per packed micro-batch (pack)
    "batches": _KEY
    + [
        _f("batch_id", pa.int32()),
        _f("sample_ids", pa.list_(pa.string())),
        _f("n_sequences", pa.int32()),
        _f("n_tokens", pa.int32()),
        _f("n_pad", pa.int32()),
        _f("cu_seqlens", pa.list_(pa.int32())),
    ],
    # one row per optimizer step (train)
    "train_steps": _KEY
    + [
        _f("mode", pa.string()),  # pretrain | sft | rl
        _opt("loss", pa.float64()),
        _opt("grad_norm", pa.float64()),
        _opt("lr", pa.float64()),
        _opt("tokens", pa.int64()),
        _opt("tokens_per_second", pa.float64()),
        *_SECONDS,
        _opt("clip_fraction", pa.float64()),
        _opt("ratio_mean", pa.float64()),
        _opt("logprob_gap", pa.float64()),
        _opt("entropy", pa.float64()),  # mean policy entropy over loss tokens (nats)
        _opt("kl", pa.float64()),  # mean KL estimate to the reference policy (rl.loss.kl_coef > 0)
    ],
    # one row per saved checkpoint (checkpoint)
    "checkpoints": _KEY
    + [
        _f("policy_version", pa.int32()),
        _f("path", pa.string()),
        _opt("sha256", pa.string()),
        _opt("mlflow_model_name", pa.string()),
        _opt("mlflow_model_version", pa.string()),
        _opt("created_at", pa.timestamp("us", tz="UTC")),
    ],
    # one row per engine and weight sync (sync)
    "syncs": _KEY
    + [
        _f("engine", pa.string()),
        _f("checkpoint_path", pa.string()),
        _f("policy_version", pa.int32()),
        _opt("seconds", pa.float64()),
        _f("ok", pa.bool_()),
        _opt("error", pa.string()),
    ],
    # one row per eval sample (eval)
    "evals": _KEY
    + [
        _f("env", pa.string()),
        _f("example_id", pa.string()),
        _f("reward", pa.float32()),
        _opt("correct", pa.bool_()),
        _opt("prompt_text", pa.string()),
        _opt("completion_text", pa.string()),
        # null: the greedy completion (every row of runs before sampled evals); 0..k-1: the
        # prompt's sampled completions of eval.samples = k (pass@k, maj@k)
        _opt("sample", pa.int32()),
        _opt("answer", pa.string()),  # the comparable answer maj@k votes on; null where the env has none
    ],
    # one row per completion and step that decided its fate (rollouts/fates.py); a carried
    # completion gets a later row, so its newest row is its fate (the `fates` view)
    "decisions": _KEY
    + [
        _f("sample_id", pa.string()),
        _f("group_id", pa.string()),
        # trained | zero_variance | stale | carried | over_cap | reward_error | truncated |
        # cut_in_thinking | filtered
        _f("status", pa.string()),
        _f("reason", pa.string()),
    ],
    # one row per resting prompt the pass-rate curriculum met at a sampling round
    # (rollouts/curriculum.py): skipped, or sampled anyway as a re-test, and why
    "curriculum": _KEY
    + [
        _f("attempt", pa.int32()),
        _f("env", pa.string()),
        _f("example_id", pa.string()),
        _f("status", pa.string()),  # skipped | retested
        _f("state", pa.string()),  # solved | hopeless
        _f("passed", pa.int32()),  # completions of its window that passed
        _f("counted", pa.int32()),  # completions in its window (rl.curriculum.window)
        _f("reason", pa.string()),
    ],
    # one row per packed micro-batch an RL step trained on, exactly (tasks/tokens.py): the
    # PackedBatch tensors (token lists, int64 ones stored as int32), the trainer's per-token
    # log-probs of the step's last epoch, and per token the trained completion token it predicts
    # (token_sample: index into sample_ids, -1 elsewhere; token_position: in the completion)
    "train_tokens": _KEY
    + [
        _f("batch_id", pa.int32()),
        _f("sample_ids", pa.list_(pa.string())),  # per segment; "" on shared-prefix segments
        _f("tokens", _TOKENS),
        _f("position_ids", _TOKENS),
        _f("cu_seqlens", _TOKENS),
        _f("labels", _TOKENS),
        _f("token_weights", _LOGPROBS),
        _opt("log_probs", _LOGPROBS),  # the generator's
        _opt("rewards", _LOGPROBS),
        _opt("prefix_index", _TOKENS),
        _opt("loss_mask", pa.list_(pa.bool_())),
        _opt("trainer_logprobs", _LOGPROBS),  # null when the step did not run the model (skipped)
        _f("token_sample", _TOKENS),
        _f("token_position", _TOKENS),
    ],
}


def _with_meta(table: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields, metadata={META_TABLE: table.encode(), META_VERSION: str(SCHEMA_VERSION).encode()}
    )


SCHEMAS: dict[str, pa.Schema] = {name: _with_meta(name, fields) for name, fields in _FIELDS.items()}
TABLES: tuple[str, ...] = tuple(SCHEMAS)


def schema_for(table: str) -> pa.Schema:
    """The schema of `table`; ValueError naming the known tables otherwise."""
    if table not in SCHEMAS:
        raise ValueError(f"unknown table {table!r}; known tables: {', '.join(TABLES)}")
    return SCHEMAS[table]


# one row per run that started from a checkpoint (step 0): where its weights came from, so
# `rlpipe lineage` and SQL follow an RL version back to the SFT checkpoint and version it started from
_FIELDS["origins"] = _KEY + [
    _f("parent_checkpoint", pa.string()),  # absolute path of the starting checkpoint folder, or ORG/NAME@COMMIT (a hub model)
    _opt("parent_run_dir", pa.string()),  # the run folder that wrote it, when it is an rlpipe run
    _opt("parent_run_id", pa.string()),
    _opt("parent_step", pa.int64()),
    _opt("parent_model_name", pa.string()),  # its registered model version, if it was registered
    _opt("parent_model_version", pa.string()),
]
SCHEMAS["origins"] = _with_meta("origins", _FIELDS["origins"])
TABLES = tuple(SCHEMAS)
