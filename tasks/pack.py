"""Stage `pack`: the step's selected rollouts and advantages → PackedBatch micro-batches
and the `batches` table.

RL token weights: the sequence's advantage (on-policy distillation: each token's own) on completion
tokens, 0 on prompt tokens and on the environment's tokens of a multi-turn episode (its `turns` spans, envs/multiturn.py); the
generator's log-probs ride along for ratio-based losses. The prompt is declared a shared prefix,
so a group's completions carry it once per micro-batch (training.batch, "Shared prefixes").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlpipe.envs.multiturn import model_token_mask, segment_bounds
from rlpipe.rollouts.records import TrainSample
from rlpipe.storage.stage_tables import StageTable, stage
from rlpipe.training.batch import PackedBatch, Sequence, pack, shared_prefix_units

Budget = Callable[[list[int], int], int]
"""(packing unit sizes, configured token budget) → the step's micro-batch token budget."""


def rollout_sequences(sample: TrainSample) -> list[Sequence]:
    """The rollout as training sequences: one, or one per segment of a multi-turn episode whose
    context was re-rendered by the chat template (envs/multiturn.py); segments after the first
    carry the sample_id `<sample_id>#<k>`."""
    rollout, advantage = sample.rollout, sample.advantage
    per_token = sample.token_advantages or [float(advantage)] * len(rollout.completion_tokens)
    prompt, completion = list(rollout.prompt_tokens), list(rollout.completion_tokens)
    logprobs = [float(x) for x in rollout.completion_logprobs]
    # multi-turn: only the sampled spans are trained; environment tokens carry weight 0
    sampled = model_token_mask(rollout.turns, len(completion))
    out = []
    for k, (start, end) in enumerate(segment_bounds(rollout.turns, len(completion))):
        head = prompt if k == 0 else []
        mask = sampled[start:end]
        # a later segment starts with its re-rendered context: its prompt, shared like one
        shared = len(head) if k == 0 else next((i for i, m in enumerate(mask) if m), len(mask))
        out.append(Sequence(
            tokens=head + completion[start:end],
            weights=[0.0] * len(head) + [a if m else 0.0 for a, m in zip(per_token[start:end], mask, strict=True)],
            logprobs=[0.0] * len(head) + logprobs[start:end],
            reward=sample.reward,
            sample_id=rollout.sample_id if k == 0 else f"{rollout.sample_id}#{k}",
            prefix_len=shared,
            # every completion token counts in the normaliser, a zero advantage included
            loss_mask=[False] * len(head) + mask,
        ))
    return out


def rollout_sequence(sample: TrainSample) -> Sequence:
    """The single training sequence of a rollout (ValueError for a multi-segment episode)."""
    sequences = rollout_sequences(sample)
    if len(sequences) != 1:
        raise ValueError(f"rollout {sample.sample_id!r} has {len(sequences)} segments")
    return sequences[0]


def batch_rows(batches: list[PackedBatch], run_id: str, step: int) -> list[dict]:
    """The `batches` rows of a step's micro-batches: which rollouts each holds, its tokens and padding."""
    rows = []
    for index, batch in enumerate(batches):
        # whole rollouts (a shared prompt counted in each), not the packed segments
        lengths = [n for n, sid in zip(batch.full_lengths(), batch.sample_ids, strict=True) if sid]
        rows.append(
            {
                "run_id": run_id,
                "step": step,
                "batch_id": index,
                "sample_ids": [sid for sid in batch.sample_ids if sid],
                "n_sequences": len(lengths),
                "n_tokens": batch.n_tokens,
                # what padding these rollouts to their longest would have cost
                "n_pad": max(lengths) * len(lengths) - sum(lengths),
                "cu_seqlens": [int(x) for x in batch.cu_seqlens.tolist()],
            }
        )
    return rows


def whole_budget(sizes: list[int], token_budget: int) -> int:
    """The configured budget whatever the step's sizes (one process: training/trainer.py)."""
    return token_budget


def pack_rollouts(samples: list[TrainSample], token_budget: int, budget: Budget = whole_budget) -> list[PackedBatch]:
    """Micro-batches of the selected samples (a multi-turn episode may give several sequences).
    budget: the trainer's `budget` (data-parallel ranks: small enough that each gets work),
    given the step's packing units' sizes."""
    sequences = [seq for s in samples for seq in rollout_sequences(s)]
    if not sequences:
        return []
    # sized by packing units (a group sharing its prompt, else a sequence), not sequence
    # lengths: counting a shared prompt per sequence packed small steps into one micro-batch
    # (the other ranks idle), and a budget under a group's size would split it, repeating its prompt
    token_budget = budget([unit.size for unit in shared_prefix_units(sequences, token_budget)], token_budget)
    return pack(sequences, token_budget)


BATCHES = StageTable("batches", rows=lambda batches, a: batch_rows(batches, a["run_id"], a["step"]))
"""The step's micro-batches, one row each (`batch_rows`), computed once from the stage's result."""


@stage("pack", tables=(BATCHES,))
def pack_task(samples: list[TrainSample], token_budget: int, *, run_dir: Path, run_id: str, step: int,
              budget: Budget = whole_budget) -> list[PackedBatch]:
    """The step's micro-batches (`pack_rollouts`); the stage writes their `batches` rows."""
    return pack_rollouts(samples, token_budget, budget)
