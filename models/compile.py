"""Regional compilation for training: `torch.compile` of the decoder layer, not the whole model.

    compile_layers(model)     # in place; every decoder layer now runs one shared compiled graph
    is_compiled(model)

Why: on an H100 the eager train step of a Qwen3-0.6B spent ~60% of its GPU time in elementwise
kernels (RMSNorm's fp32 upcasts, rotary, SwiGLU, autocast's dtype copies and their backward) and
only 17% in matmuls (docs/BENCHMARKS_GPU.md). Inductor fuses those into a few kernels per layer.

How:
- One compiled function, `_layer_forward(layer, ...)`, serves every layer of every model: the
  layer is an argument, its parameters become graph inputs, so 28 layers compile once (not 28
  times). Shapes are automatic-dynamic (torch's default): the first micro-batch compiles with
  static shapes, the first one of another length recompiles once with the token count symbolic,
  and that graph serves every later length. `dynamic=True` would save that recompile but make the
  model's own sizes (hidden, heads) symbolic too, which costs inductor its specialised kernels.
- Attention: on CUDA the packed row runs through torch's varlen kernel, a custom op with a fake
  implementation, planned outside the layers: dynamo traces it, so each layer is ONE graph
  (forward and backward), attention included (tests/unit/test_compile.py checks: no graph
  break). The bucket path (CPU, fp32) plans buckets from cu_seqlens on the host, data-dependent
  work that would recompile or break anyway, so it stays out of the graph
  (`torch.compiler.disable`): there a layer is a graph before and a graph after one eager
  attention call.
- Calls with a KV cache (the HF fallback of the torch engine, generation) run the eager layer:
  a cache object and one-token steps would only add recompiles, and decoding has its own path.
- Nothing is renamed: the layer keeps its class, parameters and state_dict keys (no
  `_orig_mod.` prefix), so checkpoints stay loadable by transformers and vLLM. The layer's
  `forward` is a partial bound to the layer itself, which `copy.deepcopy` re-binds to the copy
  (the KL reference and the async snapshot engine are deep copies of the trainer's model).

Cost: compile time at the first steps (see benchmarks/bench_compile.py for the CPU figures) and
one more compile per new mode (no-grad log-prob recomputation, eval-mode reference).

Default: `train.compile` unset means auto (`compile_enabled`): on for a model trained on CUDA,
where an H100 step ran 2.4x faster (docs/BENCHMARKS_GPU.md), off on the CPU, where the compile
costs tens of seconds for ~1.2x (benchmarks/bench_compile.py), and off with activation
checkpointing. `compile_seconds` reads how long torch has spent compiling in this process, so the
first compiled step can say what its compile cost.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def compile_enabled(setting: bool | None, device_type: str, activation_checkpointing: bool = False) -> bool:
    """What `train.compile` resolves to: an explicit true/false as set; unset (None) = auto, on
    for a model on CUDA without activation checkpointing, else off."""
    if setting is not None:
        return bool(setting)
    return device_type == "cuda" and not activation_checkpointing


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (dynamo's frame compiles and the
    AOT backward compiles they defer to the first backward), from dynamo's own timers; 0 where
    this torch does not keep them."""
    from torch._dynamo import utils

    spent = getattr(utils, "cumulative_time_spent_ns", {})
    return sum(spent.get(key, 0.0) for key in ("entire_frame_compile", "entire_backward_compile")) / 1e9


def _layer_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # the class's forward, not the instance attribute `forward` (that is `_dispatch`)
    return type(layer).forward(layer, *args, **kwargs)


@functools.cache
def _compiled_layer_forward():
    """One compiled callable for every layer (see the module docstring), built at first use:
    `torch.compile` imports inductor, ~1-2 s per process that runs that never compile need not pay."""
    return torch.compile(_layer_forward)


def _dispatch(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # transformers >= 5.24 names the KV cache `cache`; earlier 5.x `past_key_values`
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return _layer_forward(layer, *args, **kwargs)
    return _compiled_layer_forward()(layer, *args, **kwargs)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a causal LM (`model.model.layers` for Qwen3)."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"train.compile: {type(model).__name__} has no decoder layers at "
                         f"model.{getattr(model, 'base_model_prefix', 'model')}.layers")
    return layers


def compile_layers(model: nn.Module) -> nn.Module:
    """Compile every decoder layer of `model` in place (idempotent); returns the same object."""
    if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        # non-reentrant checkpointing runs each layer under saved-tensor hooks, which dynamo does
        # not trace: every layer would silently run eager (measured, torch 2.13)
        raise ValueError("train.compile with train.activation_checkpointing is not supported: the "
                         "checkpointed layers would run uncompiled; turn one of them off")
    for layer in decoder_layers(model):
        if not _is_compiled_layer(layer):
            layer.forward = functools.partial(_dispatch, layer)
    return model


def _is_compiled_layer(layer: nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _dispatch


def is_compiled(model: nn.Module) -> bool:
    """Whether `compile_layers` was applied to `model` (or to the model it was copied from)."""
    return all(_is_compiled_layer(layer) for layer in decoder_layers(model))
