"""A SIGTERM whose exception Python swallowed (raised inside a GC callback) still stops the run at
the next stage: the fault test saw a run finish with exit 0 after SIGTERM."""

import signal
import weakref

import pytest

from flows.termination import (
    Terminated,
    raise_if_terminated,
    sigterm_is_sticky,
    sigterm_stops_the_run,
)
from tasks._prefect import stage, stage_task_runs


class Prefects(BaseException):
    """Stands for prefect's TerminationSignal, raised by the handler a flow installs."""


def sigterm_inside_a_gc_callback() -> None:
    class Resource:
        pass

    resource = Resource()
    # the handler's exception is raised inside the callback: "Exception ignored in ..."
    keep = weakref.ref(resource, lambda _ref: signal.raise_signal(signal.SIGTERM))
    del resource
    assert keep() is None


@stage("noop")
def noop_stage() -> int:
    return 1


def test_a_swallowed_sigterm_stops_the_next_stage():
    def prefect_handler(signum, frame):
        raise Prefects()

    with sigterm_stops_the_run():
        raise_if_terminated()  # nothing yet
        previous = signal.signal(signal.SIGTERM, prefect_handler)  # what a Prefect flow does
        try:
            with sigterm_is_sticky(), stage_task_runs(False):
                assert noop_stage() == 1
                sigterm_inside_a_gc_callback()  # the exception is lost here...
                with pytest.raises(Terminated, match="SIGTERM"):
                    noop_stage()  # ...and the next stage stops the run
        finally:
            signal.signal(signal.SIGTERM, previous)


def test_sticky_handler_still_runs_the_flows_own_handler():
    def prefect_handler(signum, frame):
        raise Prefects()

    with sigterm_stops_the_run():
        previous = signal.signal(signal.SIGTERM, prefect_handler)
        try:
            with sigterm_is_sticky(), pytest.raises(Prefects):
                signal.raise_signal(signal.SIGTERM)
        finally:
            signal.signal(signal.SIGTERM, previous)
    with sigterm_stops_the_run():  # a new run starts with the flag cleared
        raise_if_terminated()
