"""A tiny RL run with the reservoir batch maker, stopped after its step-2 checkpoint and resumed,
trains the same batches as the run that went straight through: the reservoir's held groups and
its random generator come back from the checkpoint's data_state, and every decision, the
reservoir's evictions included, is a fate. It needs the flow because that
is where the buffer's state travels: checkpoint, resume, the `groups` table the batches are read
from."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_rl_loop_regression import config_dict, sft_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

RL = {"steps": 3, "checkpoint_every": 1, "eval_every": 0,
      "buffer": {"max_staleness": 2, "sampling": "reservoir", "reservoir_size": 5}}


def trained(run_dir) -> list[tuple]:
    from rlpipe.storage.catalog import connect

    return connect(run_dir).sql("select step, group_id, policy_version from groups where status = 'trained' "
                                "order by step, group_id").fetchall()


def test_a_reservoir_run_resumed_after_a_stop_trains_the_batches_of_a_straight_run(sft_checkpoint, tmp_path,  # noqa: F811
                                                                                   monkeypatch):
    import rlpipe.flows.rl
    from rlpipe.storage.catalog import connect
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    straight = validate_config(config_dict(tmp_path / "straight", "res", RL))
    rlpipe.flows.rl.run_rl(straight, start_checkpoint=sft_checkpoint)

    stopped = validate_config(config_dict(tmp_path / "stopped", "res", RL))
    step_batch = rlpipe.flows.rl._step_batch

    def stop_at_step_3(source, step, tracker, buffer):
        if step == 3:
            raise RuntimeError("stopped before step 3")
        return step_batch(source, step, tracker, buffer)

    monkeypatch.setattr(rlpipe.flows.rl, "_step_batch", stop_at_step_3)
    with pytest.raises(RuntimeError, match="stopped before step 3"):
        rlpipe.flows.rl.run_rl(stopped, start_checkpoint=sft_checkpoint)
    monkeypatch.undo()
    assert {row[0] for row in trained(stopped.run_dir / "rl")} == {1, 2}
    rlpipe.flows.rl.run_rl(stopped, start_checkpoint=sft_checkpoint)  # resumes from step 2's checkpoint

    expected = trained(straight.run_dir / "rl")
    assert {row[0] for row in expected} == {1, 2, 3} and len(expected) == 3 * 4
    assert trained(stopped.run_dir / "rl") == expected
    con = connect(stopped.run_dir / "rl")

    def one(sql: str):
        return con.sql(sql).fetchall()[0][0]

    assert one("select count(*) from groups where status = 'carried' and step = 2") > 0, \
        "the check needs groups held in the reservoir across the stop"
    # every decision lands in the tables: one fate per sampled completion, reservoir evictions included
    assert one("select count(*) from rollouts") == one("select count(*) from fates") > 0
    assert one("select count(*) from fates where status = 'stale' and reason like 'evicted at random from the full "
               "reservoir (rl.buffer.reservoir_size=5)%'") > 0
