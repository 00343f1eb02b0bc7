"""Where tensors live: the `device` setting resolved once, and the precision that goes with it.

    device = resolve_device("auto")      # cuda when torch sees a GPU, else cpu
    resolve_device("cuda")               # ValueError naming the setting on a machine without CUDA

Asking for CUDA where there is none is an error, never a silent fall-back to the CPU: a run that
was meant for a GPU and trains on the CPU instead would look like a hang.
"""

from __future__ import annotations

import re

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(setting: str, key: str = "device") -> torch.device:
    """The torch device for a `device` setting: "auto" | "cpu" | "cuda" | "cuda:N"."""
    if not isinstance(setting, str) or not DEVICE_PATTERN.match(setting):
        raise ValueError(f"{key} must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {setting!r}")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise ValueError(
                f"{key} = {setting!r} but CUDA is not available (torch {torch.__version__}, {build}, "
                f"no GPU visible); set {key} = 'cpu' or 'auto'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{key} = {setting!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (all of them live on one device here)."""
    return next(model.parameters()).device


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on `device` (timings on CUDA are otherwise launch times)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
