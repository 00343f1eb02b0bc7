"""A decode step whose shapes and memory addresses stay fixed, so that a CUDA graph can hold it.

Same maths as `qwen3_fast.decode`, with everything that changes from step to step moved into
device tensors of fixed size (`StepInputs`):

    tokens[:batch], positions[:batch]   the token fed to each row and its RoPE position
    column                              the cache column this step writes (= columns filled)

K/V are written with `index_copy_` at `column`; attention runs over a fixed `span` of cache
columns, with the columns after `column` masked (and padding columns, through the cache's
key_bias). The Python ints `batch` and `span` fix every shape: engines/decode_graphs.py
captures one graph per (batch, span) pair. Nothing reads a device value on the host, so a
step never waits for the GPU.

It differs from the eager step only in float rounding (tested): attention also sums the masked
columns (exact zeros), and MoE blocks run `moe_static` (engines/qwen3_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rlpipe.engines.qwen3_fast import (
    KVCache,
    QwenWeights,
    attention,
    finish_layer,
    logits_of,
    project_qkv,
)
from rlpipe.engines.qwen3_moe import moe_static


@dataclass
class StepInputs:
    """The per-step inputs, in buffers sized for the largest batch (rows past the live ones
    keep stale but valid values: their outputs are computed and ignored)."""

    tokens: torch.Tensor  # int64 [B_max]
    positions: torch.Tensor  # int64 [B_max]
    column: torch.Tensor  # int64 [1]

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> StepInputs:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        return cls(tokens=zeros(rows), positions=zeros(rows), column=zeros(1))


def decode_static(
    weights: QwenWeights,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    inputs: StepInputs,
    batch: int,
    span: int,
) -> torch.Tensor:
    """Feed inputs.tokens[:batch] at cache column inputs.column, attending to columns
    [0, span) (span > column). Returns logits float32 [batch, V]; `cache.length` is not used."""
    tokens, positions = inputs.tokens[:batch], inputs.positions[:batch]
    cos, sin = rope[0][positions][:, None, None], rope[1][positions][:, None, None]  # [B,1,1,D]
    x = F.embedding(tokens[:, None], weights.embed)  # [B, 1, H]
    future = torch.arange(span, device=tokens.device) > inputs.column  # [span]
    bias = cache.key_bias[:batch, :span].masked_fill(future, float("-inf"))[:, None]  # [B,1,S]
    for i, layer in enumerate(weights.layers):
        q, k, v = project_qkv(weights, layer, x, cos, sin)
        k_cache, v_cache = cache.k[i][:batch], cache.v[i][:batch]
        k_cache.index_copy_(3, inputs.column, k.permute(0, 2, 3, 1).to(k_cache.dtype))
        v_cache.index_copy_(2, inputs.column, v.transpose(1, 2).to(v_cache.dtype))
        att = attention(q, k_cache[..., :span], v_cache[:, :, :span], bias, weights.n_kv_heads)
        x = finish_layer(weights, layer, x, att, moe_static)
    return logits_of(weights, x[:, 0])
