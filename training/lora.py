"""LoRA adapters through `peft` (the optional extra `lora`): train low-rank adapters, keep the base.

    add_lora(model, LoraOptions(rank=8))   inject adapters in place; only they stay trainable
    with_lora(model, options or None)      the same, or the model unchanged without options
    merged_state_dict(model)               base weights + scale · B·A, under the plain HF names
    save_model_files(model, folder)        what a checkpoint holds (below)
    load_adapter(model, folder / "adapter") restore the adapters of a checkpoint

The model object stays the same `Qwen3ForCausalLM` (peft's `inject_adapter_in_model` swaps each
target Linear for a LoRA layer in place), so the training step, the packed attention and the
in-process torch engine run it unchanged: engine and trainer read the same adapters, no sync.

A LoRA checkpoint folder holds both forms: `model.safetensors` + `config.json` are the MERGED
weights under the base model's names (loads with `AutoModelForCausalLM.from_pretrained`, serves
from `rlpipe serve`, vLLM and SGLang, and is what HTTP engines sync to), and `adapter/` is a PEFT
adapter folder (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(base, folder / "adapter")` loads over the starting weights; resume
reads the adapters from there (the frozen base is rebuilt from the run's start).
"""

from __future__ import annotations

from pathlib import Path

import torch
from rlpipe.training.loss_choice import DEFAULT_TARGETS, LoraOptions  # noqa: F401 - kept without torch, for the config

ADAPTER_DIR = "adapter"


def _peft():
    try:
        import peft
    except ImportError as error:  # an optional extra: say how to get it
        raise ImportError("LoRA needs peft: pip install -e '.[lora]' in the checkout (or pip install peft)") from error
    return peft


def has_lora(model: torch.nn.Module) -> bool:
    """Whether `add_lora` (or peft) injected adapters into `model`."""
    return bool(getattr(model, "peft_config", None))


def add_lora(model: torch.nn.Module, options: LoraOptions) -> torch.nn.Module:
    """Inject LoRA adapters into `model` in place (B = 0: the function is unchanged at first) and
    freeze every other parameter; returns the same object."""
    peft = _peft()
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(options.targets) - present)
    if missing:
        raise ValueError(f"LoRA targets {missing} are not modules of this model; it has e.g. "
                         f"{sorted(present & set(DEFAULT_TARGETS)) or sorted(present)[:8]}")
    config = peft.LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
                             target_modules=list(options.targets), bias="none")
    peft.inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with each adapter folded in (W + scale · B·A), under the base model's
    names: what `save_pretrained` of the un-adapted model would write. The model is not changed."""
    peft = _peft()
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            out[name.replace(".base_layer.", ".")] = tensor.detach()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and not isinstance(module, peft.tuners.lora.Embedding):
                for adapter in module.active_adapters:
                    key = f"{name}.weight"
                    delta = module.get_delta_weight(adapter)
                    out[key] = (out[key] + delta.to(out[key].dtype)).contiguous()
    return out


def save_adapter(model: torch.nn.Module, folder: Path) -> None:
    """A PEFT adapter folder: adapter_config.json + adapter_model.safetensors (PeftModel's names)."""
    peft = _peft()
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(str(folder))
    state = peft.get_peft_model_state_dict(model)
    save_file({f"base_model.model.{k}": v.detach().contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"))


def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Load the adapter weights of a PEFT folder written by `save_adapter` into `model` (which
    has the same adapters injected)."""
    peft = _peft()
    from safetensors.torch import load_file

    file = Path(folder) / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA checkpoint {str(folder)!r} has no adapter_model.safetensors")
    state = {k.removeprefix("base_model.model."): v for k, v in load_file(str(file)).items()}
    result = peft.set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter {str(file)!r} does not fit this model: unexpected {result.unexpected_keys[:3]}")


def with_lora(model: torch.nn.Module, options: LoraOptions | None) -> torch.nn.Module:
    """`add_lora(model, options)`, or `model` unchanged when `options` is None (LoRA off)."""
    return model if options is None else add_lora(model, options)


def save_model_files(model, folder: Path) -> None:
    """The weight files of a checkpoint: `save_pretrained`, merged plus `adapter/` with LoRA."""
    if not has_lora(model):
        model.save_pretrained(folder)
        return
    model.save_pretrained(folder, state_dict=merged_state_dict(model))
    save_adapter(model, folder / ADAPTER_DIR)
