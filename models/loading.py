"""Load a Hugging Face checkpoint (ours or a user's Qwen3/Llama-like) for rlpipe training, from a
local folder or a hub id.

    model = load_model("runs/demo/checkpoints/step_000010")
    model = load_model("Qwen/Qwen3-0.6B@main")        # a hub id, optionally @revision
    with autocast_context(torch.device("cpu"), enabled=True):
        ...

The model comes back with the packed attention of `models.attention` and `use_cache=False` in its
config (packing is silently wrong with the cache on; generation passes use_cache=True itself).
Bad inputs fail early with a ValueError naming the path or file: a missing directory, a missing
config.json, a truncated or corrupt safetensors file.

`resolve_model_path` is the one place a `model.path` becomes a folder: an existing local folder as
is, else a hub id `ORG/NAME[@REVISION]` fetched by huggingface_hub's `snapshot_download` into the
normal Hugging Face cache (HF_HOME / HF_HUB_CACHE, HF_TOKEN or the saved login, HF_HUB_OFFLINE=1
reads the cache only). Everything that reads a model folder (the builder, tokenizer loading,
replay, validation) goes through it, so a hub id resolves the same way everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import warnings
from pathlib import Path

import torch
from rlpipe.models.attention import VARLEN_ATTENTION
from transformers import AutoModelForCausalLM, PreTrainedModel

# ORG/NAME with an optional @REVISION (a branch, tag or commit): the hub's repository id rules
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
# what a causal LM needs from its hub repository: config, weights, tokenizer, chat template
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` is not an existing local path and reads as a hub id
    `ORG/NAME[@REVISION]`; None otherwise (a local path, existing or not)."""
    spec = str(spec)
    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return None
    found = _HUB_ID.fullmatch(spec)
    if found is None or ".." in found["repo"] or found["repo"].count("/") != 1:
        return None
    return found["repo"], found["revision"]


def resolve_model_path(spec: str | Path) -> Path:
    """The local folder `spec` names: a folder as is, or a hub id's snapshot in the Hugging Face
    cache (downloaded when missing, unless HF_HUB_OFFLINE=1). ValueError with one line naming
    `spec` when neither works (a missing folder, an unknown or gated repo, offline without a
    cached copy)."""
    spec = str(spec)
    found = hub_id(spec)
    if found is None:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ValueError(f"model folder {spec!r} does not exist (give a local folder or a hub id ORG/NAME[@REVISION])")
        return path
    repo, revision = found
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES)))
    except GatedRepoError:
        raise ValueError(f"hub model {spec!r} is gated: accept its terms on the hub and log in "
                         "(hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"hub model {spec!r}: revision {revision!r} not found") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {spec!r}: no such local folder, and no such hub repository (or it is "
                         "private: log in with hf auth login, or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"model {spec!r}: no such local folder, and as a hub id it is not in the Hugging "
                         "Face cache while the hub cannot be reached (HF_HUB_OFFLINE=1, or no network): "
                         "download it once online, or give a local folder") from None
    except OSError as error:
        raise ValueError(f"hub model {spec!r} could not be fetched: {error}".splitlines()[0]) from None


def model_source(spec: str | Path) -> str:
    """Where a model folder came from, for the record: `ORG/NAME@COMMIT` for a hub id (the commit
    its snapshot holds, so a later run or replay loads the same files), else the resolved
    local folder."""
    found = hub_id(str(spec))
    if found is None:
        return str(Path(spec).expanduser().resolve())
    return f"{found[0]}@{resolve_model_path(spec).name}"


def _check_checkpoint(path: Path) -> None:
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"checkpoint {str(path)!r} has no config.json")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint config {str(config)!r} is not valid JSON: {err}") from err
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not any(path.glob("*.bin")):
        raise ValueError(f"checkpoint {str(path)!r} has no weights (*.safetensors)")
    for file in weights:
        _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    """Validate a safetensors file's header and length without reading its tensors.

    Layout: 8-byte little-endian header size, a JSON header with each tensor's data_offsets,
    then the data; a file shorter than the largest end offset is truncated.
    """
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"header of {n} bytes does not fit in {size} bytes")
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        need = 8 + n + max(ends, default=0)
        if size < need:
            raise ValueError(f"truncated: {size} bytes, tensors need {need}")
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as err:
        raise ValueError(f"corrupt or truncated weights file {str(file)!r}: {err}") from err


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM from a checkpoint folder or hub id (`resolve_model_path`), in train mode, with
    varlen attention."""
    path = resolve_model_path(path)
    _check_checkpoint(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=VARLEN_ATTENTION, local_files_only=True
    )
    model.config.use_cache = False
    if model.generation_config is not None:
        model.generation_config.use_cache = True  # decoding still wants its KV cache
    model.train()
    return model


def bf16_autocast_supported(device: torch.device) -> bool:
    """Whether bf16 autocast is worth it on `device` (CUDA with bf16, or a CPU with AMX/AVX512-BF16)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


@functools.cache
def _warn_no_bf16(device: str) -> None:
    # once per process: Prefect and MLflow reset the warnings registry (catch_warnings), so the
    # default once-per-location filter repeated this on every step
    warnings.warn(f"bf16 autocast not supported on {device}; running in fp32", stacklevel=3)


def autocast_context(
    device: torch.device | str, enabled: bool
) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on `device` when enabled and supported, else a no-op context (fp32 mode).

    Where bf16 is asked for but the device cannot run it fast, warn and run fp32: configs default
    to bf16 and must still run on such machines.
    """
    device = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    if not bf16_autocast_supported(device):
        _warn_no_bf16(str(device))
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def check_model(path: str | Path) -> None:
    """ValueError naming the problem when `path` is not a checkpoint folder `load_model` can load
    (a missing folder or config.json, no weights, a truncated weights file); reads no tensors."""
    _check_checkpoint(Path(path))
