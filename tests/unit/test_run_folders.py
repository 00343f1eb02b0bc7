"""Run folders: which folder a flow run may act on (new, resume with the same config, overwrite
unless another process runs it or a run inside or around it), a moved or copied folder's catalog
and recorded paths, and the code a run folder names."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from rlpipe.flows.common import RunState, code_named_by, finished_result
from rlpipe.flows.run_folders import (
    config_differences,
    deployment_run_name,
    refuse_locked_overwrite,
    run_folder,
)
from rlpipe.storage.catalog import catalog_is_current, connect, ensure_catalog, rescore_source
from rlpipe.storage.layout import relocated
from rlpipe.storage.runlock import (
    RunLockedError,
    acquire_run_lock,
    locked_runs_around,
    release_run_lock,
)
from rlpipe.storage.writer import write_table
from rlpipe.tasks.config import validate_config

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)  # as storage/runlock.py does: a longer pid written before leaves no tail
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def hold_lock():
    """Lock a run folder from another process (as a running run does) until the test ends."""
    held = []

    def hold(run_dir: Path) -> int:
        run_dir.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir / ".lock")], stdout=subprocess.PIPE,
                                   text=True)
        held.append(process)
        assert process.stdout.readline().strip() == "held"
        return process.pid

    yield hold
    for process in held:
        process.kill()
        process.wait(timeout=30)


def config_for(runs_root: Path, name: str = "r", **changes) -> object:
    data = {"flow": "rl", "run_name": name, "runs_root": str(runs_root), "rl": {"steps": 3}, **changes}
    return validate_config(data)


def make_run(config) -> None:
    config.run_dir.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    RunState(config.run_dir, config.run_name, "rl", status="failed").save()


def test_a_new_flow_run_refuses_a_folder_that_holds_a_run(tmp_path):
    config = config_for(tmp_path)
    make_run(config)
    with pytest.raises(ValueError, match="already holds a run: resume it"):
        with run_folder(config):
            pass


def test_resume_needs_the_same_config_wherever_the_folder_lies(tmp_path):
    config = config_for(tmp_path)
    make_run(config)
    elsewhere = config.model_copy(update={"runs_root": "/somewhere/else"})
    with run_folder(config_for(tmp_path), resume=True) as settled:
        assert settled.run_dir == config.run_dir
    assert config_differences(config.model_dump(mode="json"), elsewhere.model_dump(mode="json")) == []
    ddp = config_for(tmp_path, train={"parallel": "ddp"})  # resumed over ranks: --nproc-per-node
    assert config_differences(config.model_dump(mode="json"), ddp.model_dump(mode="json")) == []
    other = config_for(tmp_path, rl={"steps": 3, "group_size": 4})
    with pytest.raises(ValueError, match=r"another config \(rl.group_size differ"):
        with run_folder(other, resume=True):
            pass
    with pytest.raises(ValueError, match="nothing to resume"):
        with run_folder(config_for(tmp_path, "absent"), resume=True):
            pass
    with pytest.raises(ValueError, match="exclude each other"):
        with run_folder(config, resume=True, overwrite=True):
            pass


def test_an_unset_compile_in_config_json_resumes_as_what_auto_resolves_to(tmp_path):
    """A config.json written before `train.compile` was resolved (unset: auto) resumes under a
    config resolved for this device; a value set otherwise is still a difference."""
    from rlpipe.tasks.setup import with_resolved_compile

    config = config_for(tmp_path)
    assert config.train.compile is None
    make_run(config)  # its config.json holds "compile": null
    resolved = with_resolved_compile(config)
    assert resolved.train.compile is False  # auto on a CPU
    with run_folder(resolved, resume=True) as settled:
        assert settled.run_dir == config.run_dir
    with pytest.raises(ValueError, match=r"another config \(train.compile differ"):
        with run_folder(config_for(tmp_path, train={"compile": True}), resume=True):
            pass


def test_a_deployment_run_gets_a_folder_of_its_own_unless_it_resumes_or_overwrites(tmp_path):
    config = config_for(tmp_path, "demo")
    make_run(config)
    flow_run_id = "0123abcd-1111-2222-3333-444455556666"
    assert deployment_run_name("demo", None, False, False) == "demo"
    assert deployment_run_name("demo", flow_run_id, True, False) == "demo"
    with run_folder(config, flow_run_id=flow_run_id) as settled:
        assert settled.run_dir == tmp_path / "demo-0123abcd"
    assert json.loads((config.run_dir / "run.json").read_text())["status"] == "failed"  # untouched


def test_a_deployments_runs_register_under_one_name_per_phase(tmp_path):
    """Every flow run of a deployment registers its checkpoints as versions of the deployment's
    models (`demo`, `demo-sft`), not of new models named after its own folder; resuming its folder
    keeps that name."""
    from rlpipe.flows.common import registered_model_name

    config = config_for(tmp_path, "demo")
    names = set()
    for flow_run_id in ("0123abcd-1111", "89abcdef-2222"):
        with run_folder(config, flow_run_id=flow_run_id) as settled:
            assert settled.run_dir.name == f"demo-{flow_run_id[:8]}"
            names.add(registered_model_name(settled))
            make_run(settled)
    assert names == {"demo"}
    named = config_for(tmp_path, "named", tracking={"registered_model": "rlpipe-demo"})
    with run_folder(named, flow_run_id="0123abcd-1111") as settled:
        assert registered_model_name(settled) == "rlpipe-demo"
    with run_folder(config_for(tmp_path, "demo-0123abcd"), resume=True) as resumed:
        assert registered_model_name(resumed) == "demo"


def test_overwrite_clears_the_folder_but_refuses_a_running_run(tmp_path, hold_lock):
    config = config_for(tmp_path)
    make_run(config)
    (config.run_dir / "tables").mkdir()
    with run_folder(config, overwrite=True) as settled:
        assert sorted(p.name for p in settled.run_dir.iterdir()) == [".lock"]
    make_run(config)
    pid = hold_lock(config.run_dir)
    with pytest.raises(RunLockedError, match=f"it is running in another process \\(pid {pid}\\)"):
        with run_folder(config, overwrite=True):
            pass
    assert (config.run_dir / "run.json").is_file()


def test_overwrite_refuses_a_folder_inside_or_around_a_running_run(tmp_path, hold_lock):
    running = tmp_path / "runs" / "a"  # a pipeline running in runs/a
    pid = hold_lock(running)
    (running / "sft").mkdir()
    (running / "sft" / "run.json").write_text("{}")
    # a run whose runs_root is the running run's folder: its phase folder lies inside that run
    with pytest.raises(RunLockedError, match=f"lies inside the run {running}, which is running .*pid {pid}"):
        refuse_locked_overwrite(running / "sft")
    # the runs root that holds it
    with pytest.raises(RunLockedError, match=f"the run {running} inside it is running"):
        refuse_locked_overwrite(tmp_path / "runs")
    assert (running / "sft" / "run.json").is_file()
    refuse_locked_overwrite(tmp_path / "elsewhere")  # nothing running there: no error


def test_a_lock_held_by_this_process_is_not_another_run(tmp_path):
    acquire_run_lock(tmp_path / "mine")
    try:
        assert locked_runs_around(tmp_path / "mine") == []
    finally:
        release_run_lock(tmp_path / "mine")


def score_rows(rewards: list[float]) -> dict:
    return {"sample_id": [f"s{i}" for i in range(len(rewards))], "group_id": ["g"] * len(rewards),
            "reward": rewards}


def scores_run(run_dir: Path, rewards: list[float]) -> None:
    write_table(run_dir, "scores", 1, score_rows(rewards), run_id="r", durable=False)
    ensure_catalog(run_dir)


def catalog_sum(run_dir: Path) -> float:
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        return con.execute("select sum(reward) from scores").fetchone()[0]
    finally:
        con.close()


def test_a_copied_run_folders_catalog_is_rebuilt_to_read_the_copy(tmp_path):
    original, copy = tmp_path / "a" / "run", tmp_path / "b" / "run"
    scores_run(original, [1.0, 2.0])
    shutil.copytree(original, copy)
    write_table(original, "scores", 1, score_rows([100.0]), run_id="r", durable=False)  # in place
    assert catalog_sum(copy) == 100.0  # the copied catalog still reads the original's files
    assert not catalog_is_current(copy) and catalog_is_current(original)
    # any reader re-points it: rlpipe sql, report, ... go through connect()
    assert connect([copy]).execute("select sum(reward) from scores").fetchone()[0] == 3.0
    assert catalog_is_current(copy)
    shutil.rmtree(original)
    assert catalog_sum(copy) == 3.0


def test_a_rescore_folder_inside_its_run_names_it_relatively(tmp_path):
    from rlpipe.tasks.rescoring import prepare_out

    run = tmp_path / "a" / "run"
    scores_run(run, [1.0])
    prepare_out(run, run / "rescore" / "strict", "mod:fn")
    assert json.loads((run / "rescore" / "strict" / "rescore.json").read_text())["source_run_dir"] == "../.."
    shutil.copytree(run, tmp_path / "b")
    assert rescore_source(tmp_path / "b" / "rescore" / "strict")[0] == (tmp_path / "b").resolve()
    prepare_out(run, tmp_path / "out", "mod:fn")  # outside the run: its absolute path
    assert rescore_source(tmp_path / "out")[0] == run.resolve()


def test_paths_a_moved_run_recorded_map_to_the_new_place(tmp_path):
    old = tmp_path / "old" / "demo"
    recorded = str(old / "sft" / "checkpoints" / "step_000004")
    for phase in ("sft", "rl"):
        (old / phase).mkdir(parents=True)
        RunState(old / phase, f"demo/{phase}", phase, status="finished", extra={"checkpoint": recorded}).save()
    (old / "sft" / "checkpoints" / "step_000004").mkdir(parents=True)
    shutil.copytree(old, tmp_path / "new")
    # a finished phase's saved result, read from the copy, names the copy's checkpoint
    assert finished_result(tmp_path / "new" / "sft")["checkpoint"] == str(tmp_path / "new" / "sft" / "checkpoints"
                                                                          / "step_000004")
    assert relocated(recorded, tmp_path / "new" / "rl") == str(tmp_path / "new" / "sft" / "checkpoints" / "step_000004")
    assert relocated(recorded, old / "rl") == recorded  # not moved: as recorded
    assert relocated("/models/base", tmp_path / "new" / "rl") == "/models/base"  # outside the run: as recorded


def test_code_a_run_config_names():
    config = validate_config({"flow": "rl", "task": {"env": "dataset", "options": {"path": "x.jsonl",
                              "reward_module": "myrewards"}}, "rl": {"filter": {"sample_filter": "myfilters:keep"}}})
    assert code_named_by(config) == ["myrewards", "myfilters:keep"]
    assert code_named_by(validate_config({"flow": "rl"})) == []
    assert code_named_by(validate_config({"flow": "rl", "rl": {"buffer": {"batch_maker": "my_makers:NewestFirst"}}})) == [
        "my_makers:NewestFirst"]



ROOT = Path(__file__).resolve().parents[2]


def test_rlpipe_run_overwrite_refuses_a_phase_folder_of_a_running_pipeline(tmp_path, hold_lock, capsys):
    from rlpipe.flows.runner import main_run

    running = tmp_path / "runs" / "a"
    pid = hold_lock(running)
    sft = running / "sft"
    sft.mkdir()
    (sft / "run.json").write_text("{}")
    code = main_run([str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={running}", "--set", "run_name=sft",
                     "--overwrite"])
    assert code == 2
    assert f"lies inside the run {running}, which is running in another process (pid {pid})" in capsys.readouterr().err
    assert (sft / "run.json").read_text() == "{}"


def test_rlpipe_resume_leaves_a_finished_run_as_it_is(tmp_path, capsys):
    from rlpipe.flows.runner import main_resume

    config = config_for(tmp_path / "old")  # written elsewhere, then moved here
    make_run(config)
    RunState(config.run_dir, "r", "rl", status="finished", extra={"eval": {"eval/accuracy": 0.5}}).save()
    moved = tmp_path / "new" / "r"
    shutil.copytree(config.run_dir, moved)
    shutil.rmtree(config.run_dir)
    before = {p.name: p.read_bytes() for p in moved.iterdir()}
    assert main_resume([str(moved)]) == 0
    assert capsys.readouterr().out.strip() == f"rlpipe resume: {moved.resolve()} already finished; left as it is"
    assert {p.name: p.read_bytes() for p in moved.iterdir()} == before
    assert not config.run_dir.exists()


def test_a_resume_may_change_only_the_settings_that_are_safe_mid_run(tmp_path):
    """`rlpipe resume --set`: a fill, filter, retry or step-count setting is applied and is no
    difference from the saved config; any other key is refused in one line naming it."""
    from rlpipe.core.config import ConfigError
    from rlpipe.flows.run_folders import config_differences, resumed_with
    from rlpipe.tasks.config import validate_config

    config = validate_config({"runs_root": str(tmp_path), "run_name": "r", "flow": "rl"})
    changed = resumed_with(config, ["rl.buffer.max_attempts=9", "rl.buffer.partial_batches=true", "rl.steps=80"])
    assert (changed.rl.buffer.max_attempts, changed.rl.buffer.partial_batches, changed.rl.steps) == (9, True, 80)
    assert config_differences(config.model_dump(mode="json"), changed.model_dump(mode="json")) == []
    with pytest.raises(ConfigError) as refused:
        resumed_with(config, ["rl.steps=80", "rl.optim.lr=1e-5"])
    assert str(refused.value).startswith("--set rl.optim.lr: a resume keeps the run's settings, except ")
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"rl\.buffer\.max_attempts"):
        resumed_with(config, ["rl.buffer.max_attempts=0"])


def test_rlpipe_resume_refuses_another_setting_before_anything_runs(tmp_path, capsys):
    import json

    from rlpipe.flows.runner import main_resume
    from rlpipe.tasks.config import validate_config

    config = validate_config({"runs_root": str(tmp_path), "run_name": "r", "flow": "rl"})
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    assert main_resume([str(config.run_dir), "--set", "model.preset=tiny-moe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlpipe resume: --set model.preset: a resume keeps the run's settings") and err.count("\n") == 1
