"""Stage `pack`: the step's selected rollouts and advantages → PackedBatch micro-batches
and the `batches` table.

RL token weights: the sequence's advantage on completion tokens, 0 on prompt tokens; the
generator's log-probs ride along for ratio-based losses. The prompt is declared a shared prefix,
so a group's completions carry it once per micro-batch (training.batch, "Shared prefixes").
"""

from __future__ import annotations

from pathlib import Path

from rollouts.source import TrainSample
from tasks._prefect import stage
from tasks.record import persist
from training.batch import PackedBatch, Sequence, pack


def rollout_sequence(sample: TrainSample) -> Sequence:
    rollout, advantage = sample.rollout, sample.advantage
    prompt, completion = list(rollout.prompt_tokens), list(rollout.completion_tokens)
    return Sequence(
        tokens=prompt + completion,
        weights=[0.0] * len(prompt) + [float(advantage)] * len(completion),
        logprobs=[0.0] * len(prompt) + [float(x) for x in rollout.completion_logprobs],
        reward=sample.reward,
        sample_id=rollout.sample_id,
        prefix_len=len(prompt),
        # every completion token counts in the normaliser, a zero advantage included
        loss_mask=[False] * len(prompt) + [True] * len(completion),
    )


def batch_rows(batches: list[PackedBatch], run_id: str, step: int) -> list[dict]:
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


def pack_rollouts(samples: list[TrainSample], token_budget: int, run_id: str, step: int
                  ) -> tuple[list[PackedBatch], list[dict]]:
    """Micro-batches of the selected samples, and their `batches` rows."""
    batches = pack([rollout_sequence(s) for s in samples], token_budget) if samples else []
    return batches, batch_rows(batches, run_id, step)


@stage("pack")
def pack_task(samples: list[TrainSample], token_budget: int, *, run_dir: Path, run_id: str, step: int
              ) -> list[PackedBatch]:
    batches, rows = pack_rollouts(samples, token_budget, run_id, step)
    persist(run_dir, "batches", step, rows, run_id)
    return batches
