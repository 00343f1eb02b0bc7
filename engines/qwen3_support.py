"""Which models the lean forward of `engines.qwen3_fast` can run, and why not the others."""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
_STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def unsupported_reason(model: nn.Module) -> str | None:
    """None if `forward` can run `model`; otherwise why not (the engine then uses HF forward)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if getattr(model, "peft_config", None):  # `.weight` of a LoRA layer is its base weight alone
        return "LoRA adapters are injected (training/lora.py): the fast path would read base weights only"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "sliding-window layers are not supported"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention is not supported"
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} changes with sequence length"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    for i, layer in enumerate(getattr(getattr(model, "model", None), "layers", [])):
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            experts = mlp.experts
            gate_up = getattr(experts, "gate_up_proj", None)
            if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3:
                return f"layer {i}: experts are not stored as fused 3-D tensors"
            if getattr(experts, "gate_up_proj_bias", None) is not None:
                return f"layer {i}: expert biases are not supported"
            own = {n.split(".")[0] for n, _ in mlp.named_parameters()}
            if own != {"experts", "gate"}:
                return f"layer {i}: MoE block has extra parts {sorted(own - {'experts', 'gate'})}"
        elif not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}: unknown MLP {type(mlp).__name__}"
    return None
