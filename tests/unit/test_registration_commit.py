"""A checkpoint's commit completed on resume (tasks/checkpoint.py `complete_registrations`): a
kill after the folder's rename, after the registered version, or a row left with a null version,
each completed once, on a real MLflow store under tmp_path; never a second version."""

from __future__ import annotations

import pytest
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.storage.lineage import checkpoint_origin
from rlpipe.storage.stage_tables import load_rows
from rlpipe.storage.tracking import MlflowTracker, NullTracker
from rlpipe.tasks.checkpoint import RegisterOptions, complete_registrations, register
from rlpipe.training.checkpoint_io import save_checkpoint


@pytest.fixture
def tracker(tmp_path):
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri())
    tracker.start(run_name="demo/sft", experiment="commit")
    yield tracker
    tracker.end()


@pytest.fixture
def run_dir(tmp_path):
    """A run folder with checkpoints at steps 2 and 4 (folders renamed into place, nothing more)."""
    tok = build_tokenizer()
    run = tmp_path / "run"
    for step in (2, 4):
        save_checkpoint(run, step, build_model("tiny-dense", vocab_size=len(tok), seed=step), tok)
    return run


def versions(tracker, name: str) -> list[tuple[str, str]]:
    return sorted((v.tags["step"], str(v.version)) for v in tracker.client.search_model_versions(f"name = '{name}'"))


def test_checkpoints_without_a_version_or_a_row_are_registered_once(run_dir, tracker):
    """Afterwards: each checkpoint has one version and a row naming it; a second call (a second
    resume) changes nothing; the lineage of a run started from one names its version."""
    options = RegisterOptions("demo-sft")
    assert complete_registrations(run_dir=run_dir, run_id="demo/sft", tracker=tracker, options=options) == [2, 4]
    assert versions(tracker, "demo-sft") == [("2", "1"), ("4", "2")]
    assert [load_rows(run_dir, "checkpoints", s)[0]["mlflow_model_version"] for s in (2, 4)] == ["1", "2"]
    assert complete_registrations(run_dir=run_dir, run_id="demo/sft", tracker=tracker, options=options) == []
    assert versions(tracker, "demo-sft") == [("2", "1"), ("4", "2")]
    assert checkpoint_origin(run_dir / "checkpoints" / "step_000004")["parent_model_version"] == "2"


def test_a_kill_after_the_registration_finds_that_version(run_dir, tracker):
    """Afterwards: a checkpoint registered but without its row gets the row naming the version
    already registered, and no new version."""
    path = run_dir / "checkpoints" / "step_000004"
    first = register(tracker, "demo-sft", run_dir=run_dir, run_id="demo/sft", step=4, policy_version=4, path=path)
    complete_registrations(run_dir=run_dir, run_id="demo/sft", tracker=tracker, options=RegisterOptions("demo-sft"))
    assert load_rows(run_dir, "checkpoints", 4)[0]["mlflow_model_version"] == first
    assert [step for step, _ in versions(tracker, "demo-sft")] == ["2", "4"]


def test_a_row_with_a_null_version_is_registered(run_dir, tracker):
    """Afterwards: rows written without a registry (a null version) are registered when the run
    registers; without one (tracking off) they stay as they are and nothing is rewritten."""
    complete_registrations(run_dir=run_dir, run_id="demo/rl", tracker=NullTracker(), options=RegisterOptions("demo"))
    rows = load_rows(run_dir, "checkpoints", 2)
    assert rows[0]["mlflow_model_version"] is None
    assert complete_registrations(run_dir=run_dir, run_id="demo/rl", tracker=NullTracker(),
                                  options=RegisterOptions("demo")) == []
    assert load_rows(run_dir, "checkpoints", 2)[0]["created_at"] == rows[0]["created_at"]
    assert complete_registrations(run_dir=run_dir, run_id="demo/rl", tracker=tracker,
                                  options=RegisterOptions("demo")) == [2, 4]
    assert versions(tracker, "demo") == [("2", "1"), ("4", "2")]


def test_a_damaged_checkpoint_is_named_not_registered(run_dir, tracker):
    weights = run_dir / "checkpoints" / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"'{weights}' is corrupt"):
        complete_registrations(run_dir=run_dir, run_id="demo/sft", tracker=tracker, options=RegisterOptions("demo-sft"))
    assert versions(tracker, "demo-sft") == []


class AliasLog:
    """A tracker that records the aliases it is asked to set."""

    def __init__(self):
        self.aliases = []

    def set_alias(self, name, alias, version):
        self.aliases.append((name, alias, version))


def test_best_moves_only_to_a_version_of_this_runs_model():
    from rlpipe.tasks.checkpoint import promote_best

    tracker = AliasLog()
    own = {"mlflow_model_name": "copy", "mlflow_model_version": "2"}
    assert promote_best(tracker, "copy", own, 0.5, 0.25) == 0.5
    assert tracker.aliases == [("copy", "best", "2")]
    # a copied run resumed under its folder's name: its stored row names the original's version
    original = {"mlflow_model_name": "orig", "mlflow_model_version": "3"}
    assert promote_best(tracker, "copy", original, 0.75, 0.5) == 0.75  # still the best so far
    assert tracker.aliases == [("copy", "best", "2")]
    assert promote_best(tracker, "copy", own, 0.6, 0.75) == 0.75  # not better: nothing moves
    assert tracker.aliases == [("copy", "best", "2")]


def test_a_checkpoint_left_unregistered_stays_unregistered(run_dir, tracker):
    """A checkpoint saved before any step trained (its row names no registered model: rl.py leaves
    untrained weights unregistered) is not registered by a resume; one of a run that trained
    nothing before it (no row yet, options without a model name) gets a row and no version."""
    from rlpipe.storage.stage_tables import persist_now
    from rlpipe.tasks.checkpoint import checkpoint_row

    path = run_dir / "checkpoints" / "step_000002"
    persist_now(run_dir, "checkpoints", 2, [checkpoint_row("demo/rl", 2, 2, path, None, None)], "demo/rl")
    assert complete_registrations(run_dir=run_dir, run_id="demo/rl", tracker=tracker,
                                  options=RegisterOptions("demo-rl")) == [4]
    assert versions(tracker, "demo-rl") == [("4", "1")]
    assert load_rows(run_dir, "checkpoints", 2)[0]["mlflow_model_version"] is None
