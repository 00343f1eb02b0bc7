"""Fault injection, in process: a full disk (OSError ENOSPC) during a table write and during a
checkpoint, and a corrupt partition file. Each test states what must hold afterwards."""

from __future__ import annotations

import errno
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import rlpipe.storage.layout as layout
import rlpipe.training.checkpoint_io as checkpoint
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.storage.background_writer import BackgroundWriter, TableWriteError
from rlpipe.storage.stage_tables import load_rows
from rlpipe.storage.writer import read_table, write_table
from rlpipe.training.checkpoint_files import checkpoint_dir, latest_checkpoint
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint


def disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def row(step: int, loss: float) -> dict:
    return {"run_id": "r", "step": step, "mode": "rl", "loss": loss, "tokens": 1}


def hidden_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.is_file() and p.name != ".lock"]


def test_disk_full_during_a_table_write(tmp_path, monkeypatch):
    """Afterwards: the error names the table and step; the partition holds its previous whole
    content; no temporary file is left; the queued writer refuses later writes (a prefix on disk)."""
    write_table(tmp_path, "train_steps", 1, [row(1, 0.5)], run_id="r")
    monkeypatch.setattr(layout.pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_table(tmp_path, "train_steps", 1, [row(1, 9.0)], run_id="r")
    writer = BackgroundWriter()
    writer.submit(tmp_path, "train_steps", 2, [row(2, 0.1)], run_id="r")
    with pytest.raises(TableWriteError, match=r"table 'train_steps' step 2: .*No space left"):
        writer.drain(durable=True)
    with pytest.raises(TableWriteError):
        writer.submit(tmp_path, "train_steps", 3, [row(3, 0.1)], run_id="r")
    writer.close(raise_errors=False)
    monkeypatch.undo()
    assert read_table(tmp_path, "train_steps").to_pylist()[0]["loss"] == 0.5
    assert read_table(tmp_path, "train_steps").num_rows == 1
    assert hidden_files(tmp_path / "tables") == []


def safetensors_disk_full(*_args, **_kwargs):
    """What safetensors raises when its write fails on a full disk (its own error type)."""
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


@pytest.mark.parametrize("fail_at", ["optimizer", "rng", "weights", "weights_short"])
def test_disk_full_during_a_checkpoint(tmp_path, monkeypatch, fail_at):
    """Afterwards: the error is an OSError with errno ENOSPC naming the file in the step's
    folder (also where torch and safetensors report it their own way, or a short weights file
    is all that shows it); the step's folder does not exist (or, when a checkpoint of that step
    existed, is the old one, whole); no temporary folder is left; the latest checkpoint is the
    previous one and loads with its sha256 verified."""
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0)
    from rlpipe.training.step import build_optimizer

    optimizer = build_optimizer(model, lr=1e-3)
    save_checkpoint(tmp_path, 1, model, tok, optimizer=optimizer)
    real_save, real_pretrained = checkpoint.torch.save, type(model).save_pretrained
    failing = {"optimizer": "optimizer.pt", "rng": "rng_state.pt"}.get(fail_at)

    def save(obj, file, *args, **kwargs):
        if Path(getattr(file, "name", file)).name == failing:
            with open("/dev/full", "wb") as full:  # a device that is always full: a real ENOSPC
                return real_save(obj, full, *args, **kwargs)
        return real_save(obj, file, *args, **kwargs)

    def short_weights(self, folder, *args, **kwargs):  # a write error the library did not report
        real_pretrained(self, folder, *args, **kwargs)
        weights = Path(folder) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])

    monkeypatch.setattr(checkpoint.torch, "save", save)
    if fail_at == "weights":
        monkeypatch.setattr(type(model), "save_pretrained", safetensors_disk_full)
    if fail_at == "weights_short":
        monkeypatch.setattr(type(model), "save_pretrained", short_weights)
    shown = failing or "model.safetensors"
    for step in (2, 1):  # a new step, and a rewrite of an existing one
        with pytest.raises(OSError) as raised:
            save_checkpoint(tmp_path, step, model, tok, optimizer=optimizer)
        folder = checkpoint_dir(tmp_path, step)
        assert raised.value.filename == str(folder / shown), raised.value
        if fail_at != "weights_short":  # a short file's cause is ENOSPC only on a disk that is full
            assert raised.value.errno == errno.ENOSPC and "No space left" in str(raised.value)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    assert load_checkpoint(root / "step_000001", model=model, optimizer=optimizer).step == 1


def test_a_corrupt_partition_is_named_with_how_to_recover(tmp_path):
    """Afterwards: reading it (a resumed stage, or every step at once) raises a ValueError that
    names the file and says to delete it; once deleted, the stage's rows are simply absent."""
    write_table(tmp_path, "scores", 3, [{"run_id": "r", "step": 3, "sample_id": "s", "group_id": "g",
                                         "reward": 1.0}], run_id="r")
    path = tmp_path / "tables" / "scores" / "step=3" / "part-0.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # torn by a faulty disk or a bad copy
    for read in (lambda: load_rows(tmp_path, "scores", 3), lambda: read_table(tmp_path, "scores")):
        with pytest.raises(ValueError, match=rf"partition file '{path}' is corrupt .*Delete it"):
            read()
    path.unlink()
    assert load_rows(tmp_path, "scores", 3) is None
    assert pq.read_schema(tmp_path / "tables" / "scores" / "_schema.parquet")  # the view still has its schema


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.pt", "rng_state.pt", "tokenizer.json"])
def test_a_truncated_file_of_the_newest_checkpoint_falls_back_to_the_one_before(tmp_path, victim):
    """Afterwards: loading the damaged checkpoint names the file; `resume_checkpoint` returns the
    previous checkpoint with one line naming the damaged folder and where it was moved, the
    damaged folder is no longer a checkpoint (hidden, kept), and asking again finds the same
    good checkpoint with nothing more to say (no loop)."""
    from rlpipe.training.checkpoint_files import resume_checkpoint
    from rlpipe.training.step import build_optimizer

    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0)
    optimizer = build_optimizer(model, lr=1e-3)
    good = save_checkpoint(tmp_path, 1, model, tok, optimizer=optimizer)
    newest = save_checkpoint(tmp_path, 2, model, tok, optimizer=optimizer)
    file = newest / victim
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # torn by a full disk or a bad copy
    with pytest.raises(ValueError, match=rf"'{file}' is corrupt"):
        load_checkpoint(newest, model=model, optimizer=optimizer)
    found, notes = resume_checkpoint(tmp_path)
    assert found == good and len(notes) == 1
    assert f"'{file}' is corrupt" in notes[0] and "moved it to" in notes[0]
    aside = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".corrupt-step_000002-")]
    assert len(aside) == 1 and (aside[0] / victim).is_file() and not newest.exists()
    assert latest_checkpoint(tmp_path) == good
    assert resume_checkpoint(tmp_path) == (good, [])
    assert load_checkpoint(good, model=model, optimizer=optimizer).step == 1


def test_only_damaged_checkpoints_resume_from_the_start(tmp_path):
    """Afterwards: with its one checkpoint damaged, a run resumes from its start (None)."""
    from rlpipe.training.checkpoint_files import resume_checkpoint

    tok = build_tokenizer()
    only = save_checkpoint(tmp_path, 3, build_model("tiny-dense", vocab_size=len(tok), seed=0), tok)
    (only / "metadata.json").write_text("{")
    found, notes = resume_checkpoint(tmp_path)
    assert found is None and "metadata" in notes[0] and "is corrupt" in notes[0]
