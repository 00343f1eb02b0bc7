"""Stages as plain calls (tracking.prefect_task_runs = false) keep their retries and results."""

from __future__ import annotations

import pytest
from rlpipe.tasks._prefect import call_with_retries, stage, stage_task_runs


def _flaky(failures: int):
    calls = []

    def fn(value, *, retries="a stage argument of that name"):
        calls.append(retries)
        if len(calls) <= failures:
            raise ConnectionError(f"failure {len(calls)}")
        return value * 2

    return fn, calls


def test_plain_call_retries_then_returns():
    fn, calls = _flaky(failures=2)
    flaky = stage("flaky", retries=2, retry_delay_seconds=0.0)(fn)
    with stage_task_runs(False):
        assert flaky(21, retries="passed through") == 42
    assert calls == ["passed through"] * 3


def test_plain_call_raises_after_the_last_retry():
    fn, calls = _flaky(failures=5)
    with pytest.raises(ConnectionError, match="failure 3"):
        call_with_retries(fn, 2, 0.0, 1)
    assert len(calls) == 3


def test_task_runs_are_the_default_and_restored_after_the_block():
    import rlpipe.tasks._prefect as module

    assert module._TASK_RUNS.get() is True
    with stage_task_runs(False):
        assert module._TASK_RUNS.get() is False
    assert module._TASK_RUNS.get() is True
