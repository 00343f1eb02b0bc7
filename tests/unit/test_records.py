"""The typed rows between stages mirror their tables' Arrow schemas."""

from __future__ import annotations

import pytest
from rlpipe.rollouts.records import Rollout, Score
from rlpipe.storage.schemas import schema_for


@pytest.mark.parametrize(("record", "table"), [(Rollout, "rollouts"), (Score, "scores")])
def test_record_fields_are_the_table_columns(record, table):
    assert record.columns() == tuple(schema_for(table).names)


def test_row_round_trip():
    score = Score(run_id="r", step=1, sample_id="s", group_id="g", reward=1.0, components={"correct": 1.0},
                  error=None)
    assert Score.from_row({**score.row(), "extra": 1}) == score
