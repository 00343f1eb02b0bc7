"""Faults for the fault tests' subprocesses. A test puts this folder on PYTHONPATH (Python then
imports this module at start-up, in every process: data-parallel ranks too) and sets

- RLPIPE_TEST_KILL = `after:<glob>` or `before:<glob>`: the process SIGKILLs itself right after
  (or right before) an `os.replace` whose destination path matches the glob (fnmatch): a
  checkpoint folder's rename, a table partition's rename (core/files.py); `during:<glob>`: in the
  middle of a `shutil.rmtree` of a folder matching the glob (one file deleted, the rest left), as
  a kill while a checkpoint is being removed (training/checkpoint_retention.py);
- RLPIPE_TEST_ENOSPC = `<writer>:<glob>`: that writer fails as on a full disk for every file
  matching the glob: `parquet` (pyarrow.parquet.write_table) and `torch` (torch.save) really write
  into /dev/full, a device that is always full; `safetensors` (safetensors.torch.save_file) raises
  the error safetensors raises there; `mlflow` makes the SQLite store's metric writes fail as
  SQLite does ("database or disk is full"; the glob is not used; params and tags still work).

Without the variables nothing is changed.
"""

import fnmatch
import os
import signal

_SPEC = os.environ.get("RLPIPE_TEST_KILL", "")
if _SPEC:
    _WHEN, _, _PATTERN = _SPEC.partition(":")
    if _WHEN not in ("after", "before", "during") or not _PATTERN:
        raise SystemExit(f"RLPIPE_TEST_KILL={_SPEC!r}: expected after:<glob>, before:<glob> or during:<glob>")
    _replace = os.replace

    def _replace_then_maybe_die(src, dst, *args, **kwargs):
        hit = fnmatch.fnmatch(os.fspath(dst), _PATTERN)
        if hit and _WHEN == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = _replace(src, dst, *args, **kwargs)
        if hit and _WHEN == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    if _WHEN == "during":
        import shutil as _shutil
        from pathlib import Path as _Path

        _rmtree = _shutil.rmtree

        def _rmtree_halfway(path, *args, **kwargs):
            if fnmatch.fnmatch(os.fspath(path), _PATTERN):
                files = sorted(p for p in _Path(path).rglob("*") if p.is_file())
                if files:
                    files[0].unlink()
                os.kill(os.getpid(), signal.SIGKILL)
            return _rmtree(path, *args, **kwargs)

        _shutil.rmtree = _rmtree_halfway
    else:
        os.replace = _replace_then_maybe_die


_FULL = os.environ.get("RLPIPE_TEST_ENOSPC", "")


def _rebind(original, replacement, owner) -> None:
    """Put `replacement` for `original` in its module `owner` and wherever a module outside the
    library holds it by a name of its own (transformers binds safetensors' save_file at import): a
    process forked from a warm interpreter (tests/warm_cli.py) then writes through the hook as a
    fresh one, which imports them after it."""
    import sys

    library = owner.__name__.split(".")[0]
    for module_name, module in list(sys.modules.items()):
        if getattr(module, "__dict__", None) is globals():
            continue  # this hook itself, which keeps the original to call
        if module is owner or module_name.split(".")[0] != library:
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is original:
                    setattr(module, name, replacement)


if _FULL:
    _WRITER, _, _FILES = _FULL.partition(":")

    def _matches(target) -> bool:  # a path, or a file object opened on one
        path = target if isinstance(target, (str, os.PathLike)) else getattr(target, "name", "")
        return isinstance(path, (str, os.PathLike)) and fnmatch.fnmatch(os.fspath(path), _FILES)

    if _WRITER == "parquet":
        import pyarrow.parquet as _pq

        _write_table = _pq.write_table

        def _write_table_full(table, where, *args, **kwargs):
            if _matches(where):
                with open("/dev/full", "wb") as full:
                    return _write_table(table, full, *args, **kwargs)
            return _write_table(table, where, *args, **kwargs)

        _rebind(_write_table, _write_table_full, _pq)
    elif _WRITER == "torch":
        import torch as _torch

        _save = _torch.save

        def _save_full(obj, where, *args, **kwargs):
            if _matches(where):
                with open("/dev/full", "wb") as full:
                    return _save(obj, full, *args, **kwargs)
            return _save(obj, where, *args, **kwargs)

        _rebind(_save, _save_full, _torch)
    elif _WRITER == "safetensors":
        import safetensors.torch as _st
        from safetensors import SafetensorError as _SafetensorError

        _save_file = _st.save_file

        def _save_file_full(tensors, filename, *args, **kwargs):
            if _matches(filename):
                raise _SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')
            return _save_file(tensors, filename, *args, **kwargs)

        _rebind(_save_file, _save_file_full, _st)
    elif _WRITER == "mlflow":
        import sqlite3

        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as _Store

        _log_batch = _Store.log_batch

        def _log_batch_full(self, run_id, metrics=(), params=(), tags=()):
            if metrics:  # a run's params and tags still go in: metrics fail mid-run
                raise sqlite3.OperationalError("database or disk is full")
            return _log_batch(self, run_id, metrics=metrics, params=params, tags=tags)

        _Store.log_batch = _log_batch_full
    else:
        raise SystemExit(f"RLPIPE_TEST_ENOSPC={_FULL!r}: expected parquet|torch|safetensors|mlflow:<glob>")
