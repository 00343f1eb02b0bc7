"""Fused kernels of the trained model: `train.fused` = "auto" | "liger" | "none".

    used = apply_fused_kernels(model, "auto", compiled=False)    # "liger" or "none": what it now runs

"liger" patches a Qwen3 (dense or MoE) in place with Liger Kernel's Triton kernels for RMSNorm,
rotary embeddings and, in a dense Qwen3, SwiGLU (`apply_liger_kernel_to_qwen3[_moe](model=...)`):
the elementwise work that held an eager H100 train step at 13% MFU (docs/BENCHMARKS_GPU.md). A
Qwen3-MoE keeps transformers' experts: on transformers 5 Liger replaces them with its fused MoE
kernel (matmuls and SwiGLU in one Triton kernel), which did not give the unpatched experts'
log-probs and gradients within the fp32 bounds the dense patch meets (tests/gpu/test_cuda.py,
on an H200), so rlpipe does not swap a model's expert matmuls for it. Triton kernels need
CUDA, and Liger is an optional extra (`pip install 'rlpipe[liger]'`); "liger" asks for it and is
an error of one line where it cannot be had; "none" leaves the model as built.

"auto" is chosen by measurement, not by presence (docs/BENCHMARKS_GPU.md, the note "fused
kernels under torch.compile"): on an H100, qwen3-0.6b, fp32 master + bf16 autocast, a compiled
train step took 0.403 s and the same step with Liger patched in 0.547 s (36% slower, MFU 31.1%
-> 22.9%): inductor cannot analyse Liger's RMSNorm Triton kernel and treats its inputs as
mutated, and compile already fuses what Liger fuses. So "auto" never patches a model whose
layers are compiled (`train.compile`, the CUDA default). It patches an eager Qwen3 on CUDA with
Liger installed: there the profile of the eager step (same note list, "where the train step's
GPU time goes") put about 60% of it in the unfused elementwise work Liger's kernels replace.
"liger" with compile is honoured (the user asked), though it measured slower.

The vocabulary projection is never Liger's: Liger's fused linear + cross-entropy computes its
gradient inside the forward for a loss reduced to one number, while every rlpipe loss weights
per-token log-probs (advantages, ratios, KL) after the projection. rlpipe's own chunked
linear + log-softmax (training/logprobs.py) gives those log-probs without ever holding the
[tokens, vocab] logits, with an exact backward for any upstream gradient, and runs compiled on
CUDA with `train.compile` (training/logprob_kernels.py).

Liger's rotary patch replaces transformers' Qwen3 `apply_rotary_pos_emb` for the whole process
(the KL reference and an in-process engine built from the same model class use it too); its
RMSNorm and SwiGLU patches swap the modules of `model` alone. Patch before `train.compile`
compiles the layers (tasks/setup.py `place_model` does).
"""

from __future__ import annotations

import importlib.util
import logging

from torch import nn

FUSED = ("auto", "liger", "none")
# model_type -> Liger's patch function (liger_kernel.transformers)
LIGER_PATCHES = {"qwen3": "apply_liger_kernel_to_qwen3", "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}


def liger_unavailable_reason(device_type: str, model_type: str | None = None,
                             installed: bool | None = None) -> str | None:
    """None if Liger's kernels can patch a `model_type` model (None: any it knows) on
    `device_type`; else why not. installed: whether liger-kernel is importable (None: look)."""
    if device_type != "cuda":
        return f"Liger Kernel's Triton kernels need CUDA; the model trains on {device_type}"
    if model_type is not None and model_type not in LIGER_PATCHES:
        return f"rlpipe patches only {', '.join(sorted(LIGER_PATCHES))} models with Liger; this one is {model_type!r}"
    if installed is None:
        installed = importlib.util.find_spec("liger_kernel") is not None
    if not installed:
        return "liger-kernel is not installed (pip install 'rlpipe[liger]')"
    return None


def resolve_fused(setting: str, device_type: str, model_type: str, compiled: bool = False,
                  liger_installed: bool | None = None) -> str:
    """What `train.fused` = setting comes to here: "liger" or "none". "auto" never picks Liger for
    a model whose layers will be compiled (`train.compile`): measured 36% slower per step on an
    H100 (see the module docstring). "liger" where Liger cannot run is a ValueError naming why.
    liger_installed: whether liger-kernel is importable (None: look)."""
    if setting not in FUSED:
        raise ValueError(f"train.fused must be one of {FUSED}; got {setting!r}")
    if setting == "none" or (setting == "auto" and compiled):
        return "none"
    reason = liger_unavailable_reason(device_type, model_type, liger_installed)
    if reason is None:
        return "liger"
    if setting == "liger":
        raise ValueError(f"train.fused = 'liger': {reason}; use 'auto' or 'none'")
    return "none"


def apply_fused_kernels(model: nn.Module, setting: str, compiled: bool = False) -> str:
    """Patch `model` in place as `train.fused` = setting asks (see the module docstring); returns
    what it now runs: "liger" or "none". compiled: its layers will be compiled next (patch first)."""
    device_type = next(model.parameters()).device.type
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    used = resolve_fused(setting, device_type, model_type, compiled)
    if used == "liger":
        import liger_kernel.transformers as liger

        patch = getattr(liger, LIGER_PATCHES[model_type])
        patch(rope=True, rms_norm=True, swiglu=model_type == "qwen3", cross_entropy=False,
              fused_linear_cross_entropy=False, model=model)
        logging.getLogger(__name__).info("train.fused: Liger Kernel's RMSNorm, rotary%s in %s",
                                         " and SwiGLU" if model_type == "qwen3" else "", type(model).__name__)
    return used
