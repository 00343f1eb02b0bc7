"""The `train_tokens` record of a step (tasks/tokens.py): the packed micro-batches come back
tensor for tensor, and each trained completion token maps to its sample and position."""

from __future__ import annotations

import torch
from rlpipe.rollouts.records import Rollout, TrainSample
from rlpipe.tasks.pack import pack_rollouts
from rlpipe.tasks.tokens import packed_batch, train_token_rows
from rlpipe.training.batch import PackedBatch
from rlpipe.training.dist_trainer import ParallelTrainer
from rlpipe.training.distributed import DataParallel
from rlpipe.training.loss_inputs import capture_logprobs
from rlpipe.training.trainer import TrainOptions


def sample(group: int, index: int, prompt: list[int], completion: list[int], advantage: float,
           turns: list[dict] | None = None) -> TrainSample:
    sid = f"g{group}:{index}"
    rollout = Rollout(run_id="r", step=1, policy_version=0, env="e", example_id=str(group), group_id=f"g{group}",
                      sample_id=sid, attempt=1, prompt_tokens=prompt, completion_tokens=completion,
                      completion_logprobs=[-0.125 * (k + 1) for k in range(len(completion))], finish_reason="stop",
                      prompt_text="", completion_text="", n_prompt_tokens=len(prompt),
                      n_completion_tokens=len(completion), turns=turns)
    return TrainSample(rollout, 1.0, advantage)


def same(a: PackedBatch, b: PackedBatch) -> bool:
    fields = ("tokens", "position_ids", "cu_seqlens", "labels", "token_weights", "log_probs", "rewards",
              "prefix_index", "loss_mask")
    return a.sample_ids == b.sample_ids and all(
        (getattr(a, f) is None and getattr(b, f) is None)
        or (getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f)))
        for f in fields)


def test_rows_rebuild_the_batches_and_map_every_completion_token():
    samples = [sample(0, j, [5, 6, 7], [10 + j, 20 + j, 30], 0.5 - j) for j in range(3)]
    samples += [sample(1, 0, [8, 9], [40, 41, 42, 43], 0.25)]
    # a multi-turn episode: model 2 tokens, env 2 tokens, a re-rendered context of 2, model 2
    turns = [{"turn": 0, "producer": "model", "start": 0, "length": 2, "reward": None},
             {"turn": 0, "producer": "env", "start": 2, "length": 2, "reward": None},
             {"turn": 1, "producer": "context", "start": 4, "length": 2, "reward": None},
             {"turn": 1, "producer": "model", "start": 6, "length": 2, "reward": None}]
    samples += [sample(2, 0, [3, 4], [50, 51, 52, 53, 54, 55, 56, 57], -1.0, turns)]
    batches = pack_rollouts(samples, token_budget=14)
    assert len(batches) > 1 and any(b.prefix_index is not None for b in batches)
    seen: dict = {}
    loss = capture_logprobs(lambda logprobs, batch: (logprobs * 2, {}), seen)
    for b in batches:
        lp = -torch.arange(b.n_tokens, dtype=torch.float32) / 7
        assert torch.equal(loss(lp, b)[0], lp * 2)  # a pass-through
    rows = train_token_rows(samples, batches, seen)
    assert train_token_rows(samples, batches, {k: v for k, v in list(seen.items())[1:]})[0]["trainer_logprobs"] is None
    assert all(same(packed_batch(row), b) for row, b in zip(rows, batches, strict=True))
    found = {}
    for row in rows:
        for t, (seg, pos) in enumerate(zip(row["token_sample"], row["token_position"], strict=True)):
            if seg >= 0:
                sid = row["sample_ids"][seg].split("#")[0]
                assert row["labels"][t] == next(s for s in samples if s.sample_id == sid).rollout.completion_tokens[pos]
                assert row["log_probs"][t] == -0.125 * (pos + 1)
                assert row["trainer_logprobs"][t] == float(torch.tensor(-t, dtype=torch.float32) / 7)
                found.setdefault(sid, []).append(pos)
    assert sorted(found["g0:1"]) == [0, 1, 2] and sorted(found["g1:0"]) == [0, 1, 2, 3]
    assert sorted(found["g2:0"]) == [0, 1, 6, 7]  # the model's tokens only


def test_a_skipped_step_keeps_the_batches_without_trainer_logprobs():
    samples = [sample(0, j, [5, 6], [10, 11], 0.0) for j in range(2)]
    batches = pack_rollouts(samples, token_budget=64)
    rows = train_token_rows(samples, batches, {})
    assert [r["trainer_logprobs"] for r in rows] == [None] and same(packed_batch(rows[0]), batches[0])


def test_a_small_step_with_shared_prompts_gives_every_rank_a_micro_batch():
    # 4 groups of 8 sharing a 15-token prompt: 608 tokens as sequences, 216 packed. Sizing the
    # ranks' budget by the former (304) packed the whole step into one micro-batch: rank 1 idled.
    samples = [sample(g, j, list(range(20 * g + 1, 20 * g + 16)), [90 + j, 91, 92, 93], 1.0 - j / 4)
               for g in range(4) for j in range(8)]
    two_ranks = ParallelTrainer(DataParallel(module=None, kind="ddp", rank=0, world_size=2), None, None,
                                TrainOptions()).budget
    batches = pack_rollouts(samples, token_budget=2048, budget=two_ranks)
    assert [b.n_tokens for b in batches] == [108, 108]
    # one group: its prompt is shared, not split into per-sequence micro-batches (rank 1 idles)
    batches = pack_rollouts(samples[:8], token_budget=2048, budget=two_ranks)
    assert [b.n_tokens for b in batches] == [54]


def test_the_pack_and_train_stages_write_batches_and_train_tokens_once_each(tmp_path):
    from rlpipe.storage.writer import read_table
    from rlpipe.tasks._prefect import stage_task_runs
    from rlpipe.tasks.pack import batch_rows, pack_task
    from rlpipe.tasks.train import train_task

    samples = [sample(0, j, [5, 6], [10, 11], 0.0) for j in range(2)]  # no signal: the step is skipped
    with stage_task_runs(False):
        batches = pack_task(samples, 64, run_dir=tmp_path, run_id="r", step=1)
        metrics = train_task(None, batches, None, samples=samples, trainer_logprobs={}, step=1,
                             run_dir=tmp_path, run_id="r")
    assert metrics["skipped"] == 1.0
    assert read_table(tmp_path, "batches", 1).to_pylist() == batch_rows(batches, "r", 1)
    (row,) = read_table(tmp_path, "train_tokens", 1).to_pylist()
    assert row["trainer_logprobs"] is None and same(packed_batch(row), batches[0])
