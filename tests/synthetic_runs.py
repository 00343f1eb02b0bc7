"""Synthetic run tables (rollouts, scores, groups) for tests and the storage benchmarks, which
import it as `tests.synthetic_runs` (benchmarks/bench_storage.py, benchmarks/bench_bytes.py).

    tables = synthetic_step(step=3, run_id="r", n_groups=250, group_size=8, n_token_rows=200, seed=0)
    tables["rollouts"], tables["scores"], tables["groups"]   # pa.Tables in the run schemas

Deterministic for a (seed, step). A share of groups (`zero_variance_share`) get one reward for
all their completions, so zero-variance statistics have something to count; `groups` is derived
from `scores` exactly as a filter stage would (population std, zero variance when std <= 1e-6).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from rlpipe.storage.schemas import schema_for

ENVS = ("arithmetic", "countdown")


def synthetic_step(
    step: int,
    *,
    run_id: str,
    n_groups: int,
    group_size: int,
    n_token_rows: int,
    seed: int = 0,
    n_examples: int = 500,
    zero_variance_share: float = 0.3,
) -> dict[str, pa.Table]:
    """rollouts, scores and groups of one step; the first `n_token_rows` rollouts carry token lists."""
    rng = np.random.default_rng([seed, step])
    n = n_groups * group_size
    group_index = np.repeat(np.arange(n_groups), group_size)
    group_ids = [f"{run_id}-s{step}-g{g}" for g in range(n_groups)]
    row_group_ids = [group_ids[g] for g in group_index]
    sample_ids = [f"{group_ids[g]}-{i % group_size}" for i, g in enumerate(group_index)]
    examples = rng.integers(0, n_examples, n_groups)
    envs = [ENVS[e % len(ENVS)] for e in examples]
    example_ids = [str(e) for e in examples]
    attempts = rng.integers(1, 4, n_groups).astype(np.int32)

    n_prompt = rng.integers(8, 40, n).astype(np.int32)
    n_completion = rng.integers(1, 200, n).astype(np.int32)
    n_tok = min(n_token_rows, n)
    prompt_tokens = _token_lists(rng, n_prompt, n_tok, pa.int32())
    completion_tokens = _token_lists(rng, n_completion, n_tok, pa.int32())
    completion_logprobs = _token_lists(rng, n_completion, n_tok, pa.float32())
    policy_version = np.full(n, max(step - 1, 0), dtype=np.int32)
    rollouts = pa.Table.from_pydict(
        {
            "run_id": [run_id] * n,
            "step": np.full(n, step, dtype=np.int64),
            "policy_version": policy_version,
            "env": [envs[g] for g in group_index],
            "example_id": [example_ids[g] for g in group_index],
            "group_id": row_group_ids,
            "sample_id": sample_ids,
            "attempt": attempts[group_index],
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "completion_logprobs": completion_logprobs,
            "finish_reason": np.where(n_completion >= 190, "length", "stop").tolist(),
            "prompt_text": [f"problem {e}" for e in (example_ids[g] for g in group_index)],
            "completion_text": [f"answer {k}" for k in n_completion],
            "n_prompt_tokens": n_prompt,
            "n_completion_tokens": n_completion,
            # single-turn rollouts: no episode columns
            "n_turns": [None] * n,
            "turns": [None] * n,
            "messages": [None] * n,
            # no reasoning blocks: every completion token is answer
            "thinking_tokens": [0] * n,
            "answer_tokens": n_completion,
            "answer_text": [f"answer {k}" for k in n_completion],
            # one policy version sampled each completion
            "first_policy_version": policy_version,
            "last_policy_version": policy_version,
            # no teacher (on-policy distillation)
            "teacher_logprobs": [None] * n,
            "teacher": [None] * n,
            "teacher_checkpoint": [None] * n,
            "teacher_url": [None] * n,
        },
        schema=schema_for("rollouts"),
    )

    rewards = rng.integers(0, 2, n).astype(np.float32) * rng.choice([0.5, 1.0], n).astype(
        np.float32
    )
    constant = rng.random(n_groups) < zero_variance_share
    constant_value = rng.integers(0, 2, n_groups).astype(np.float32)
    rewards = np.where(constant[group_index], constant_value[group_index], rewards).astype(
        np.float32
    )
    errors = np.where(rng.random(n) < 0.01, "reward function raised", None).tolist()
    components = pa.MapArray.from_arrays(
        np.arange(0, 2 * n + 1, 2, dtype=np.int32),
        pa.array(["correct", "format"] * n),
        pa.array(np.stack([rewards, np.ones(n, np.float32)], axis=1).reshape(-1)),
    )
    scores = pa.Table.from_pydict(
        {
            "run_id": [run_id] * n,
            "step": np.full(n, step, dtype=np.int64),
            "sample_id": sample_ids,
            "group_id": row_group_ids,
            "reward": rewards,
            "components": components,
            "error": errors,
        },
        schema=schema_for("scores"),
    )

    per_group = rewards.reshape(n_groups, group_size)
    std = per_group.std(axis=1)
    zero_variance = std <= 1e-6
    groups = pa.Table.from_pydict(
        {
            "run_id": [run_id] * n_groups,
            "step": np.full(n_groups, step, dtype=np.int64),
            "group_id": group_ids,
            "env": envs,
            "example_id": example_ids,
            "policy_version": np.full(n_groups, max(step - 1, 0), dtype=np.int32),
            "n": np.full(n_groups, group_size, dtype=np.int32),
            "reward_mean": per_group.mean(axis=1).astype(np.float32),
            "reward_std": std.astype(np.float32),
            "zero_variance": zero_variance,
            "kept": ~zero_variance,
            "attempts": attempts,
            "status": np.where(zero_variance, "zero_variance", "trained").tolist(),
        },
        schema=schema_for("groups"),
    )
    return {"rollouts": rollouts, "scores": scores, "groups": groups}


def _token_lists(
    rng: np.random.Generator, lengths: np.ndarray, n_filled: int, type_: pa.DataType
) -> pa.Array:
    """A list array: random values of `lengths[i]` for the first n_filled rows, null after."""
    n = len(lengths)
    filled = np.where(np.arange(n) < n_filled, lengths, 0)
    offsets = np.concatenate([[0], np.cumsum(filled)]).astype(np.int32)
    total = int(offsets[-1])
    if pa.types.is_floating(type_):
        values = pa.array(-rng.exponential(1.0, total).astype(np.float32))
    else:
        values = pa.array(rng.integers(0, 32_000, total).astype(np.int32))
    mask = pa.array(np.arange(n) >= n_filled)
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)
