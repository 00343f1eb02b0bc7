"""Named model presets: small Qwen3 (dense) and Qwen3-MoE shapes built from configs, no hub.

    from rlpipe.models.presets import build_model
    model = build_model("tiny-dense", vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id, ...)

Every model built here uses the packed (varlen) attention of `models.attention` and
`use_cache=False` in its config: with the cache on by default, transformers builds no per-sequence
mask for packed rows and packed logits come out silently wrong (off by ~1.1). Generation
still passes `use_cache=True` explicitly.

The MoE presets are the Qwen3-30B-A3B shape scaled down: many small experts, top-2 routing with
renormalised top-k probabilities, and the router's load-balancing loss switched on.
"""

from __future__ import annotations

from typing import Any

import torch
from rlpipe.models.attention import VARLEN_ATTENTION
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": _ROPE,
    "attention_dropout": 0.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "use_cache": False,
}

_MOE: dict[str, Any] = {
    "norm_topk_prob": True,  # as Qwen3-30B-A3B
    "output_router_logits": True,
    "router_aux_loss_coef": 0.001,
    "decoder_sparse_step": 1,
}

PRESETS: dict[str, dict[str, Any]] = {
    # 0.41M parameters at vocab 100: unit tests, the fastest demo.
    "tiny-dense": {
        "model_type": "qwen3",
        **_COMMON,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    # 3.2M parameters at vocab 100: demo-sized (close to the 3.7M model of bench_trl's TRL anchor).
    "small-dense": {
        "model_type": "qwen3",
        **_COMMON,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    # 8 experts, top-2: 0.9M parameters at vocab 100, ~0.3M active per token.
    "tiny-moe": {
        "model_type": "qwen3_moe",
        **_COMMON,
        **_MOE,
        "hidden_size": 128,
        "intermediate_size": 384,  # unused while every layer is sparse; kept for mlp_only_layers
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    # 16 experts, top-2: 10.3M parameters at vocab 100, ~2M active per token.
    "small-moe": {
        "model_type": "qwen3_moe",
        **_COMMON,
        **_MOE,
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 192,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    # Qwen3-0.6B's transformer body (28 layers, GQA 16/8 heads of 128, SwiGLU 3072, tied
    # embeddings, rope theta 1e6): 0.44B parameters without the embedding, 0.60B at its
    # 151,936-token vocabulary. For GPUs (configs/gpu.toml); a real checkpoint uses model.path.
    "qwen3-0.6b": {
        "model_type": "qwen3",
        **_COMMON,
        "max_position_embeddings": 40_960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    # Qwen3-1.7B, -4B and -8B shapes (their public config.json: hidden, intermediate, layers, heads,
    # kv heads, head_dim, rope theta, tied embeddings), randomly initialised, so benchmarks can
    # measure memory and speed per GPU without the hub. At Qwen3's 151,936-token vocabulary:
    # 1.72B (1.41B without embeddings), 4.02B (3.63B), 8.19B (6.95B), as Qwen publishes.
    "qwen3-1.7b": {
        "model_type": "qwen3",
        **_COMMON,
        "max_position_embeddings": 40_960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "qwen3-4b": {
        "model_type": "qwen3",
        **_COMMON,
        "max_position_embeddings": 40_960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        **_COMMON,
        "max_position_embeddings": 40_960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "tie_word_embeddings": False,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}

_CONFIGS: dict[str, type[PretrainedConfig]] = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}
_MODELS: dict[str, type[PreTrainedModel]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def _preset(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[preset])


def _config_keys(config_cls: type[PretrainedConfig]) -> set[str]:
    """Field names a config class accepts (its defaults, as to_dict() lists them)."""
    return set(config_cls().to_dict())


def build_config(preset: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """The transformers config of `preset` with `vocab_size` and `overrides` applied.

    Overrides are config fields (e.g. pad_token_id, eos_token_id, num_hidden_layers); an unknown
    key raises ValueError naming it. use_cache stays False unless overridden.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    fields = _preset(preset)
    config_cls = _CONFIGS[fields.pop("model_type")]
    valid = _config_keys(config_cls)
    unknown = sorted(k for k in overrides if k not in valid)
    if unknown:
        raise ValueError(f"unknown config override(s) {unknown} for preset {preset!r}")
    config = config_cls(**{**fields, "vocab_size": vocab_size, **overrides})
    config._attn_implementation = VARLEN_ATTENTION
    return config


def build_model(
    preset: str,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """A freshly initialised causal LM of `preset` (deterministic for a given seed), in train mode."""
    config = build_config(preset, vocab_size, **overrides)
    model_cls = _MODELS[config.model_type]
    # Seed a private generator's worth of state without leaking it: fork the global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.to(dtype=dtype)
    if model.generation_config is not None:
        # generation_config copied use_cache=False from the config; decoding wants its KV cache.
        model.generation_config.use_cache = True
    model.train()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
