"""Checkpoints: Hugging Face folders plus everything needed to resume exactly.

    <run_dir>/checkpoints/step_<NNNNNN>/
        config.json, model.safetensors, generation_config.json   (model.save_pretrained;
                         with LoRA the merged weights, plus adapter/: training/lora.py)
        tokenizer.json, tokenizer_config.json, ...                (tokenizer.save_pretrained)
        optimizer.pt     optimizer + scheduler state dicts
        data_state.json  the caller's data position (epoch, offset, seed, buffers, ...)
        rng_state.pt     python, numpy and torch (CPU, CUDA) RNG states, as tensors and numbers
        metadata.json    step, time, metrics, policy_version, sha256 of every other file
        lm_head.safetensors  only with CheckpointOptions.explicit_lm_head, for a tied model: see below

A tied model's files hold no `lm_head` (Transformers drops the duplicate), and a vLLM server that
reloads such a checkpoint in place keeps its tied lm_head on the old weights (measured on vLLM
0.32: the served model matched neither the old nor the new weights). With `explicit_lm_head` the
embeddings are written once more as `lm_head.weight` in a file of their own (named in the index
when sharded): vLLM then reloads both, and Transformers still loads the folder tied.

The folder loads as is with `transformers.AutoModelForCausalLM.from_pretrained(path)` (and vLLM /
SGLang): config.json never names rlpipe's own attention implementation. `optimizer.pt` and
`rng_state.pt` hold only tensors and plain numbers and are loaded with `weights_only=True`, so
loading a checkpoint runs no code from it. It is written into a
hidden temporary folder beside the final one and renamed into place, so a reader never sees a
half-written checkpoint; training/checkpoint_files.py `latest_checkpoint` ignores hidden
folders and folders without metadata.json (which is written last).

Every file is hashed into metadata.json and checked on load; finding checkpoints, verifying them
and the damaged-checkpoint fallback of a resume are training/checkpoint_files.py.

A write that fails (a full disk, an I/O error) raises OSError naming the file and its errno, also
where torch or safetensors report it in their own words, and leaves no partial folder behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rlpipe.core.files import fsync_path, naming_io_errors
from rlpipe.models.loading import load_model
from rlpipe.models.tokenizer import load_tokenizer
from rlpipe.training.checkpoint_files import (
    METADATA_FILE,
    OPTIMIZER_FILE,
    checkpoint_dir,
    file_hashes,
    verify_checkpoint,
)
from rlpipe.training.checkpoint_retention import optimizer_dropped
from rlpipe.training.lora import ADAPTER_DIR, has_lora, load_adapter, save_model_files
from transformers import PreTrainedModel, PreTrainedTokenizerBase

DATA_STATE_FILE = "data_state.json"
RNG_FILE = "rng_state.pt"
LM_HEAD_FILE = "lm_head.safetensors"  # explicit_lm_head (see the module doc)
# Attention implementations plain transformers resolves by itself; anything else is ours.
_STANDARD_ATTENTION = {None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"}


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (given or loaded), tokenizer, data state and metadata."""

    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    data_state: dict[str, Any]
    metadata: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.metadata["step"])


def rng_state() -> dict[str, Any]:
    """Every RNG state a training loop may draw from, as tensors, lists and numbers only (so that
    `torch.load(weights_only=True)` reads it back: no pickled numpy objects)."""
    version, internal, gauss = random.getstate()
    key_kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "format": 2,
        "python": [version, list(internal), gauss],
        "numpy": {"kind": str(key_kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states saved by `rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _load_safely(file: Path) -> Any:
    """`torch.load(weights_only=True)`; a file that needs arbitrary unpickling (a checkpoint from
    before rlpipe stored RNG states as tensors) is refused with what to do instead."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{str(file)!r} holds objects other than tensors and numbers, and loading them could run "
            "code from the file (older rlpipe checkpoints pickled numpy RNG states). Load the weights "
            f"alone (restore_rng=False, no optimizer), or re-save it from a trusted copy: {err}"
        ) from None


def _portable_config(folder: Path) -> None:
    """Drop a non-standard attention implementation from config.json (only rlpipe's models
    package registers it; plain transformers falls back to its default)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    changed = False
    for key in ("attn_implementation", "_attn_implementation"):
        if key in config and config[key] not in _STANDARD_ATTENTION:
            del config[key]
            changed = True
    if changed:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@dataclass(frozen=True)
class CheckpointOptions:
    """How a run's checkpoints are written (the same for every checkpoint of the run)."""

    explicit_lm_head: bool = False
    """For a tied model, also write lm_head.safetensors (reloaded in place by vLLM servers)."""


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint records of its step besides the weights and optimizer state."""

    data_state: dict[str, Any] = field(default_factory=dict)
    """The caller's data position (data_state.json)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The step's metrics (metadata.json)."""
    policy_version: int | None = None
    """The policy version the weights are (metadata.json); None: the step."""


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    record: CheckpointRecord = CheckpointRecord(),
    options: CheckpointOptions = CheckpointOptions(),
) -> Path:
    """Write `<run_dir>/checkpoints/step_<NNNNNN>/` atomically and return its path.

    Rewriting an existing step replaces it. metadata.json holds step, time (UTC ISO),
    the record's metrics and policy_version (default: step) and the sha256 of each weight file;
    data_state.json the record's data_state.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0; got {step}")
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        # merged weights + a PEFT adapter/ folder for a LoRA model
        _writing(final / "model.safetensors", lambda: save_model_files(model, tmp))
        if options.explicit_lm_head:
            _writing(final / LM_HEAD_FILE, lambda: write_explicit_lm_head(model, tmp))
        _writing(final / "config.json", lambda: _portable_config(tmp))
        _writing(final / "tokenizer.json", lambda: tokenizer.save_pretrained(tmp))
        if optimizer is not None or scheduler is not None:
            _torch_save(
                {
                    "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                },
                tmp / OPTIMIZER_FILE, final / OPTIMIZER_FILE,
            )
        _writing(final / DATA_STATE_FILE, lambda: _write_json(tmp / DATA_STATE_FILE, record.data_state or {}))
        _torch_save(rng_state(), tmp / RNG_FILE, final / RNG_FILE)
        weights = sorted(tmp.glob("*.safetensors"))
        if not weights:
            raise ValueError(f"save_pretrained wrote no *.safetensors into {str(tmp)!r}")
        for file in tmp.rglob("*.safetensors"):
            # a write error that safetensors did not report leaves the file short
            _check_safetensors(file, final / file.relative_to(tmp))
        every = file_hashes(tmp)  # each file hashed once: what `verify_checkpoint` checks
        files = {p.name: every[p.name] for p in weights}
        metadata = {
            "step": step,
            "policy_version": step if record.policy_version is None else record.policy_version,
            "time": datetime.now(UTC).isoformat(),
            "metrics": record.metrics or {},
            # one hash for the checkpoints table: the single file's, or else (shards, an explicit
            # lm_head beside the weights) the hash of every weight file's name and hash
            "sha256": next(iter(files.values())) if len(files) == 1
            else hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
            "weight_files": files,
            "files": every,
        }
        # last: its presence marks a whole checkpoint
        _writing(final / METADATA_FILE, lambda: _write_json(tmp / METADATA_FILE, metadata))
        _writing(final, lambda: [fsync_path(file) for file in (*tmp.rglob("*"), tmp)])
        if final.exists():
            # A directory cannot be renamed over a non-empty one: move the old aside first.
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _writing(shown: Path, write: Callable[[], Any]) -> None:
    """Run `write`; an I/O failure it raises in any form becomes OSError(errno, strerror, shown)."""
    with naming_io_errors(shown):
        write()


def _torch_save(obj: Any, file: Path, shown: Path) -> None:
    """`torch.save` through a Python file, so a failed write surfaces as OSError with its errno
    (given a path, torch reports a full disk as "enforce fail at inline_container.cc")."""

    def write() -> None:
        with file.open("wb") as f:
            torch.save(obj, f)

    _writing(shown, write)


def _check_safetensors(file: Path, shown: Path) -> None:
    """A safetensors file as long as its header says (the library can lose a write error on a
    full disk and leave it short); OSError ENOSPC (little space left) or EIO naming `shown`."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length)) if 0 < length <= size else None
        ends = [v["data_offsets"][1] for k, v in (header or {}).items() if k != "__metadata__"]
        expected = 8 + length + max(ends, default=0) if header is not None else None
    except (ValueError, KeyError, TypeError, IndexError):
        expected = None
    if expected is not None and size >= expected:
        return
    code = errno.ENOSPC if shutil.disk_usage(file.parent).free < (1 << 20) else errno.EIO
    raise OSError(code, f"{os.strerror(code)} (the file was left {size} bytes long"
                  + (f" of {expected})" if expected else ", its header unreadable)"), str(shown))


def write_explicit_lm_head(model: PreTrainedModel, folder: Path) -> None:
    """A tied model's lm_head (its embeddings' values) as LM_HEAD_FILE in a saved model folder,
    named in the shard index if there is one; nothing for an untied model."""
    from safetensors.torch import save_file

    if not getattr(model.config, "tie_word_embeddings", False):
        return
    weight = model.get_input_embeddings().weight.detach().to("cpu").contiguous()
    save_file({"lm_head.weight": weight}, str(folder / LM_HEAD_FILE), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # vLLM reads only the files a sharded checkpoint's index names
        content = json.loads(index.read_text())
        content["weight_map"]["lm_head.weight"] = LM_HEAD_FILE
        _write_json(index, content)


def load_checkpoint(
    path: str | Path,
    model: PreTrainedModel | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
    dtype: torch.dtype | None = None,
) -> Checkpoint:
    """Load a checkpoint written by `save_checkpoint`, verifying the weights' sha256.

    model given: its weights are overwritten in place (same architecture); else a model is
    loaded with varlen attention in `dtype` (default float32). optimizer / scheduler given:
    their states are restored (ValueError if the checkpoint has none). restore_rng: python,
    numpy and torch RNGs are set to their saved states.
    Raises ValueError naming the path or file for a missing folder, missing config / weights /
    metadata, a corrupt safetensors file or a sha256 mismatch.
    """
    path = Path(path)
    metadata = verify_checkpoint(path)
    if model is None:
        model = load_model(path, dtype=dtype or torch.float32)
    elif has_lora(model):  # the frozen base is the run's start: only the adapters change
        load_adapter(model, path / ADAPTER_DIR)
    else:
        # Load through transformers (it maps on-disk names, e.g. per-expert MoE weights, back to
        # the in-memory layout), then copy into the caller's model, keeping its dtype/device.
        param = next(model.parameters())
        loaded = load_model(path, dtype=dtype or param.dtype)
        model.load_state_dict(loaded.state_dict())
        del loaded
    tokenizer = load_tokenizer(path)
    data_state = json.loads((path / DATA_STATE_FILE).read_text()) if (path / DATA_STATE_FILE).is_file() else {}
    if optimizer is not None or scheduler is not None:
        opt_file = path / OPTIMIZER_FILE
        if not opt_file.is_file():
            raise ValueError(_no_optimizer(path))
        states = _load_safely(opt_file)
        for obj, key in ((optimizer, "optimizer"), (scheduler, "scheduler")):
            if obj is not None:
                if states.get(key) is None:
                    raise ValueError(f"{str(opt_file)!r} holds no {key} state")
                obj.load_state_dict(states[key])
    if restore_rng:
        rng_file = path / RNG_FILE
        if not rng_file.is_file():
            raise ValueError(f"checkpoint {str(path)!r} has no {RNG_FILE} (pass restore_rng=False)")
        set_rng_state(_load_safely(rng_file))
    return Checkpoint(path=path, model=model, tokenizer=tokenizer, data_state=data_state, metadata=metadata)


def read_optimizer_state(path: str | Path) -> dict[str, Any]:
    """The optimizer and scheduler states a checkpoint saved (`{"optimizer", "scheduler"}`), for
    a trainer built after the weights were loaded (data parallelism builds it after wrapping)."""
    opt_file = Path(path) / OPTIMIZER_FILE
    if not opt_file.is_file():
        raise ValueError(_no_optimizer(path))
    states = _load_safely(opt_file)
    for key in ("optimizer", "scheduler"):
        if states.get(key) is None:
            raise ValueError(f"{str(opt_file)!r} holds no {key} state")
    return states



def _no_optimizer(path: str | Path) -> str:
    """Why a checkpoint has no optimizer state to restore, in one line."""
    if optimizer_dropped(path):
        return (f"checkpoint {str(path)!r} has no {OPTIMIZER_FILE} to restore from: checkpoint retention "
                "(checkpoint.keep_last) keeps the optimizer state of a run's newest checkpoint only")
    return f"checkpoint {str(path)!r} has no {OPTIMIZER_FILE} to restore from"
