"""Load a local Hugging Face checkpoint (ours or a user's Qwen3/Llama-like) for rlpipe training.

    model = load_model("runs/demo/checkpoints/step_000010")
    with autocast_context(torch.device("cpu"), enabled=True):
        ...

The model comes back with the packed attention of `models.attention` and `use_cache=False` in its
config (packing is silently wrong with the cache on; generation passes use_cache=True itself).
Bad inputs fail early with a ValueError naming the path or file: a missing directory, a missing
config.json, a truncated or corrupt safetensors file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from pathlib import Path

import torch
from rlpipe.models.attention import VARLEN_ATTENTION
from transformers import AutoModelForCausalLM, PreTrainedModel


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
    """A causal LM from a local checkpoint directory, in train mode, with varlen attention."""
    path = Path(path)
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
