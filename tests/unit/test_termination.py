"""A SIGTERM whose exception Python swallowed (raised inside a GC callback) still stops the run at
the next stage: the fault test saw a run finish with exit 0 after SIGTERM."""

import signal
import weakref

import pytest
from rlpipe.core.termination import (
    Terminated,
    raise_if_terminated,
    sigterm_is_sticky,
    sigterm_stops_the_run,
)
from rlpipe.storage.stage_tables import stage
from rlpipe.tasks._prefect import stage_task_runs


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


def test_a_sigterm_that_surfaces_as_another_error_still_exits_143(tmp_path, monkeypatch, capsys):
    # SIGTERM landing while Prefect starts a task run came out as Prefect's "Task run is not set"
    # (exit 1, "run failed"); the CLI calls it what it was
    from rlpipe.flows import runner
    from rlpipe.tasks.config import RunConfig

    def start(config, resume=False):
        try:
            signal.raise_signal(signal.SIGTERM)
        except Terminated:
            raise ValueError("Task run is not set") from None

    monkeypatch.setattr(runner, "start", start)
    config = RunConfig.model_validate({"runs_root": str(tmp_path), "run_name": "r"})
    assert runner._execute_flow(config, overwrite=False) == 143
    err = capsys.readouterr().err
    assert "stopped by signal SIGTERM (surfacing as ValueError: Task run is not set)" in err
    assert "run failed" not in err

    monkeypatch.setattr(runner, "start", lambda config, resume=False: (_ for _ in ()).throw(ValueError("bad")))
    assert runner._execute_flow(config, overwrite=False) == 1  # a new run starts with the flag cleared
    assert "run failed: ValueError: bad" in capsys.readouterr().err


def test_a_swallowed_ctrl_c_stops_the_next_stage_and_a_second_is_ignored():
    before = signal.getsignal(signal.SIGINT)  # whatever the test process had (xdist's workers differ)
    with sigterm_stops_the_run():
        with sigterm_is_sticky(), stage_task_runs(False):
            class Resource:
                pass

            resource = Resource()
            keep = weakref.ref(resource, lambda _ref: signal.raise_signal(signal.SIGINT))
            del resource  # KeyboardInterrupt raised inside the callback is lost...
            assert keep() is None
            with pytest.raises(KeyboardInterrupt):
                noop_stage()  # ...and the next stage stops the run
            signal.raise_signal(signal.SIGINT)  # a second Ctrl-C while it cleans up: ignored
    assert signal.getsignal(signal.SIGINT) is before  # the handler in place before is back


def test_ctrl_c_ends_the_run_with_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    from rlpipe.flows import runner
    from rlpipe.tasks.config import RunConfig

    def start(config, resume=False):
        (config.run_dir / "run.json").write_text("{}")
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise ValueError("Task run is not set") from None  # surfacing as another error

    monkeypatch.setattr(runner, "start", start)
    config = RunConfig.model_validate({"runs_root": str(tmp_path), "run_name": "r"})
    config.run_dir.mkdir(parents=True)
    assert runner._execute_flow(config, overwrite=False) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlpipe: interrupted (Ctrl-C) (surfacing as ValueError: Task run is not set); "
                   f"`rlpipe resume {config.run_dir}` continues"]
