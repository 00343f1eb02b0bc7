"""A lean forward pass for Qwen3 and Qwen3-MoE that reads the model's own parameters.

Why: on CPU, decoding a small model through `model.forward` is bound by overhead (cache
objects, mask building, many small ops), not arithmetic. This module runs the same maths with
few ops per layer, against a preallocated KV cache indexed in place:

    embed -> per layer: RMSNorm -> fused q/k/v -> per-head q_norm/k_norm -> RoPE -> GQA attention
    over the cache -> o_proj -> residual -> RMSNorm -> SwiGLU MLP or top-k MoE -> residual
    -> final norm -> lm_head

`QwenWeights.from_model` collects the parameter tensors at the start of each `generate`, so the
weights are the trainer's current ones (no sync step). Where it fuses (q/k/v, gate/up) or casts
to another dtype it copies, once per call. Prompts are left-padded: row b has `pad[b]` padding
columns first; positions restart at 0 at its first real token, and padding keys are masked.

Attention never goes through `config._attn_implementation`, so a trainer-registered attention
function does not affect generation. Logits match the Hugging Face forward to ~1e-6 in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rlpipe.engines.qwen3_moe import MoeMLP, moe_sparse
from rlpipe.engines.qwen3_support import unsupported_reason
from torch import nn


@dataclass
class DenseMLP:
    gate_up: torch.Tensor  # [2I, H]: gate rows then up rows
    down: torch.Tensor  # [H, I]


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    qk_norm: torch.Tensor  # [Hq + Hkv, D]: q_norm weight per q head, then k_norm per kv head
    o: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None
    ln2: torch.Tensor  # [H]
    mlp: DenseMLP | MoeMLP


@dataclass
class QwenWeights:
    """Parameter tensors and shapes of a Qwen3 / Qwen3-MoE causal LM, ready for `forward`."""

    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    inv_freq: torch.Tensor  # [D / 2] float32
    rope_scale: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> QwenWeights:
        """Collect `model`'s current parameters (moved / cast to `device` / `dtype` if given;
        otherwise views of the parameters, except fused q/k/v and gate/up, which are copies).
        Raises ValueError if the model is not a supported Qwen3 layout (see
        `unsupported_reason`)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"model: {reason}")
        cfg = model.config
        dt = dtype or model.lm_head.weight.dtype
        dev = torch.device(device) if device is not None else model.lm_head.weight.device

        def w(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(device=dev, dtype=dt)

        layers = []
        for layer in model.model.layers:
            att = layer.self_attn
            biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
            layers.append(
                LayerWeights(
                    ln1=w(layer.input_layernorm.weight),
                    qkv=w(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                    qkv_bias=None if biases[0] is None else w(torch.cat(biases)),
                    qk_norm=w(
                        torch.cat(
                            [
                                att.q_norm.weight.expand(cfg.num_attention_heads, -1),
                                att.k_norm.weight.expand(cfg.num_key_value_heads, -1),
                            ]
                        )
                    ),
                    o=w(att.o_proj.weight),
                    o_bias=w(att.o_proj.bias),
                    ln2=w(layer.post_attention_layernorm.weight),
                    mlp=_mlp_weights(layer.mlp, w),
                )
            )
        rotary = model.model.rotary_emb
        return cls(
            embed=w(model.model.embed_tokens.weight),
            layers=layers,
            norm=w(model.model.norm.weight),
            lm_head=w(model.lm_head.weight),
            inv_freq=rotary.inv_freq.detach().to(device=dev, dtype=torch.float32).clone(),
            rope_scale=float(rotary.attention_scaling),
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=model.model.layers[0].self_attn.head_dim,
            eps=cfg.rms_norm_eps,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _mlp_weights(mlp: nn.Module, w) -> DenseMLP | MoeMLP:
    if hasattr(mlp, "experts"):
        return MoeMLP(
            router=w(mlp.gate.weight),
            gate_up=w(mlp.experts.gate_up_proj),
            down=w(mlp.experts.down_proj),
            top_k=mlp.gate.top_k,
            norm_topk_prob=bool(mlp.gate.norm_topk_prob),
        )
    return DenseMLP(
        gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
        down=w(mlp.down_proj.weight),
    )


@dataclass
class KVCache:
    """Keys and values of every layer, float32 whatever the weights' dtype (attention is a
    small share of the work and bf16 batched matmuls were slower here):
    k[l]: [B, Hkv, D, S_max] (transposed: q @ k is then a plain strided matmul),
    v[l]: [B, Hkv, S_max, D]. Columns < `length` are filled; all rows share the column index
    (prompts are left-padded to a common length)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int
    key_bias: torch.Tensor  # [B, S_max] float32: -inf on padding columns, 0 elsewhere

    @classmethod
    def empty(cls, weights: QwenWeights, batch: int, max_len: int) -> KVCache:
        """A zeroed cache (masked columns must hold finite values: 0 x NaN is NaN)."""
        hkv, d, n = weights.n_kv_heads, weights.head_dim, len(weights.layers)
        dev, dt = weights.device, torch.float32
        return cls(
            k=[torch.zeros((batch, hkv, d, max_len), dtype=dt, device=dev) for _ in range(n)],
            v=[torch.zeros((batch, hkv, max_len, d), dtype=dt, device=dev) for _ in range(n)],
            length=0,
            key_bias=torch.zeros(batch, max_len, dtype=dt, device=dev),
        )

    def select(self, rows: torch.Tensor) -> KVCache:
        """A cache holding only `rows` (int64 [B']), in that order (copies the filled part)."""
        n = self.length

        def pick(t: torch.Tensor, dim: int) -> torch.Tensor:
            out = torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype, device=t.device)
            out.narrow(dim, 0, n).copy_(t.narrow(dim, 0, n)[rows])
            return out

        return KVCache(
            k=[pick(t, 3) for t in self.k],
            v=[pick(t, 2) for t in self.v],
            length=n,
            key_bias=self.key_bias[rows],
        )


def rope_tables(weights: QwenWeights, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, D] for positions 0..max_len-1, as HF computes them (fp32, then cast).

    sin carries the sign of rotate_half: x * cos + swap_halves(x) * sin equals HF's
    x * cos + rotate_half(x) * sin.
    """
    pos = torch.arange(max_len, dtype=torch.float32, device=weights.device)
    freqs = pos[:, None] * weights.inv_freq.to(weights.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = (emb.cos() * weights.rope_scale).to(weights.dtype)
    sin = (emb.sin() * weights.rope_scale).to(weights.dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos, sin


def prefill(
    weights: QwenWeights,
    tokens: torch.Tensor,
    pad: torch.Tensor,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Run left-padded prompts through the model, filling cache columns [0, P).

    tokens: int64 [B, P]; pad: int64 [B] padding columns per row. Returns last-position logits
    float32 [B, V]. Runs of rows of similar length (in the given order: sort rows by length
    for the best effect) are prefilled together over only their own width, so short prompts
    do not pay for the padding of long ones.
    """
    width = tokens.shape[1]
    lengths = (width - pad).tolist()
    logits = []
    for lo, hi in length_buckets(lengths):
        rows = slice(lo, hi)
        span = max(lengths[lo:hi])
        view = KVCache(
            k=[t[rows] for t in cache.k],
            v=[t[rows] for t in cache.v],
            length=0,
            key_bias=cache.key_bias[rows],
        )
        view.key_bias[:, : width - span] = float("-inf")
        logits.append(
            _prefill_span(
                weights,
                tokens[rows, width - span :],
                pad[rows] - (width - span),
                view,
                rope,
                width - span,
            )
        )
    cache.length = width
    return torch.cat(logits)


def length_buckets(lengths: list[int], slack: float = 7 / 8) -> list[tuple[int, int]]:
    """Split rows into consecutive runs [lo, hi) whose shortest is > slack x their longest."""
    buckets, lo, longest = [], 0, lengths[0] if lengths else 0
    for i, n in enumerate(lengths):
        if i > lo and (n > longest or n <= slack * longest):
            buckets.append((lo, i))
            lo, longest = i, n
        longest = max(longest, n)
    if lengths:
        buckets.append((lo, len(lengths)))
    return buckets


def _prefill_span(
    weights: QwenWeights,
    tokens: torch.Tensor,
    pad: torch.Tensor,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    start: int,
) -> torch.Tensor:
    """Prefill tokens [B, W] (left-padded by pad [B]) into cache columns [start, start + W)."""
    batch, length = tokens.shape
    cols = torch.arange(length, device=tokens.device)
    positions = (cols[None, :] - pad[:, None]).clamp_(min=0)  # [B, W]
    is_pad = cols[None, :] < pad[:, None]  # [B, W]
    cache.key_bias[:, start : start + length].masked_fill_(is_pad, float("-inf"))
    # causal and not padding; a padding query also sees itself so its (unused) row stays finite
    allowed = (cols[None, :, None] >= cols[None, None, :]) & ~is_pad[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=tokens.device)[None]
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=tokens.device)
    bias.masked_fill_(~allowed, float("-inf"))  # [B, W, W]
    cos, sin = rope[0][positions][:, :, None], rope[1][positions][:, :, None]  # [B, W, 1, D]
    x = F.embedding(tokens, weights.embed)
    for i, layer in enumerate(weights.layers):
        x = _layer(weights, layer, x, cos, sin, cache, i, start, bias, attend_from=start)
    return logits_of(weights, x[:, -1])


def decode(
    weights: QwenWeights,
    tokens: torch.Tensor,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    """Append one token per row at cache column `cache.length`.

    tokens: int64 [B]; positions: int64 [B] (its RoPE position). Returns logits float32 [B, V].
    """
    col = cache.length
    cos, sin = rope[0][positions][:, None, None], rope[1][positions][:, None, None]  # [B,1,1,D]
    x = F.embedding(tokens[:, None], weights.embed)  # [B, 1, H]
    bias = cache.key_bias[:, None, : col + 1]  # [B, 1, S]
    for i, layer in enumerate(weights.layers):
        x = _layer(weights, layer, x, cos, sin, cache, i, col, bias)
    cache.length = col + 1
    return logits_of(weights, x[:, 0])


def logits_of(weights: QwenWeights, x: torch.Tensor) -> torch.Tensor:
    """x: [B, H] -> float32 [B, V]."""
    x = F.rms_norm(x, (x.shape[-1],), weights.norm, weights.eps)
    return F.linear(x, weights.lm_head).float()


def _layer(
    w: QwenWeights,
    layer: LayerWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    index: int,
    start: int,
    bias: torch.Tensor,
    attend_from: int = 0,
) -> torch.Tensor:
    """One decoder layer. x: [B, T, H]; writes cache columns [start, start + T) and attends
    to columns [attend_from, start + T) with additive bias [B, T, start + T - attend_from]."""
    q, k, v = project_qkv(w, layer, x, cos, sin)
    k_cache, v_cache = cache.k[index], cache.v[index]
    end = start + x.shape[1]
    k_cache[:, :, :, start:end] = k.permute(0, 2, 3, 1)
    v_cache[:, :, start:end] = v.transpose(1, 2)
    keys, values = k_cache[..., attend_from:end], v_cache[:, :, attend_from:end]
    att = attention(q, keys, values, bias, w.n_kv_heads)
    return finish_layer(w, layer, x, att, moe_sparse)


def project_qkv(
    w: QwenWeights, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [B, T, H] -> q [B, T, Hq, D], k [B, T, Hkv, D] (normed, rotated), v [B, T, Hkv, D]."""
    batch, steps, hidden = x.shape
    hq, hkv, d = w.n_heads, w.n_kv_heads, w.head_dim
    h = F.rms_norm(x, (hidden,), layer.ln1, w.eps)
    qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(batch, steps, hq + 2 * hkv, d)
    qk = F.rms_norm(qkv[:, :, : hq + hkv], (d,), None, w.eps) * layer.qk_norm
    qk = qk * cos + qk.view(batch, steps, hq + hkv, 2, d // 2).flip(3).view_as(qk) * sin
    return qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv :]


def finish_layer(
    w: QwenWeights,
    layer: LayerWeights,
    x: torch.Tensor,
    att: torch.Tensor,
    moe: Callable[[MoeMLP, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """o_proj + residual, then the MLP block (`moe` runs a MoE one) + residual. x: [B, T, H];
    att: float32 [B, T, Hq * D] -> [B, T, H]."""
    batch, steps, hidden = x.shape
    x = x + F.linear(att.to(x.dtype), layer.o, layer.o_bias)
    h = F.rms_norm(x, (hidden,), layer.ln2, w.eps)
    if isinstance(layer.mlp, MoeMLP):
        return x + moe(layer.mlp, h.view(batch * steps, hidden)).view(batch, steps, hidden)
    gate, up = F.linear(h, layer.mlp.gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, layer.mlp.down)


def attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, hkv: int
) -> torch.Tensor:
    """Grouped-query attention in float32. q: [B, T, Hq, D]; keys: [B, Hkv, D, S] (transposed);
    values: [B, Hkv, S, D]; bias: [B, T, S] (0 or -inf). Returns float32 [B, T, Hq * D].

    Plain matmuls rather than sdpa: the query heads of a kv head are stacked as extra query
    rows, so no key/value is repeated; and on a small, loaded CPU torch's sdpa kernel stalled
    (10-50x slower) where batched matmuls did not.
    """
    batch, steps, hq, d = q.shape
    group = hq // hkv
    q = q.reshape(batch, steps, hkv, group, d).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, hkv, group * steps, d).float()
    scores = torch.matmul(q, keys).view(batch, hkv, group, steps, -1)
    scores = scores.mul_(d**-0.5).add_(bias[:, None, None])
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(batch, hkv, group * steps, -1), values)
    out = out.view(batch, hkv, group, steps, d).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, steps, hq * d)
