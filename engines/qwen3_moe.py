"""Top-k routed experts of Qwen3-MoE for `engines.qwen3_fast`, in two forms.

- `moe_sparse`: each expert runs over only the tokens routed to it (eager decode and prefill).
  Its slice sizes come from the router, so it reads them on the host (`.tolist()`): a sync and
  shapes that change each step, which a CUDA graph cannot hold.
- `moe_static`: every expert runs over every token and the router's weights (0 for the experts
  a token was not routed to) mix the results. Shapes depend only on the batch and there is no
  host read, so it can be captured (engines/decode_graphs.py). It computes E / top_k times the
  expert FLOPs of `moe_sparse`; at decode it reads the same expert weights once the batch
  routes to most experts, so it costs little where decode is bound by memory or launches
  (small batches, few experts) and much where it is bound by arithmetic (big batches, many
  experts): keep `engine.cuda_graphs` off for large MoE models until a GPU run says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MoeMLP:
    """One MoE layer's weights as `engines.qwen3_fast` holds them."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor  # [E, H, I]
    top_k: int
    norm_topk_prob: bool


def route(mlp: MoeMLP, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H] -> top-k weights float32 [N, k] and expert ids int64 [N, k]."""
    probs = torch.softmax(F.linear(x, mlp.router), dim=-1, dtype=torch.float32)
    top_w, top_e = torch.topk(probs, mlp.top_k, dim=-1)
    if mlp.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w, top_e


def moe_sparse(mlp: MoeMLP, x: torch.Tensor) -> torch.Tensor:
    """x: [N, H] -> [N, H]. Token-expert pairs are sorted by expert so each expert runs one
    matmul over a contiguous slice."""
    top_w, top_e = route(mlp, x)
    flat_e = top_e.flatten()
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=mlp.router.shape[0]).tolist()
    token = order // mlp.top_k
    xs = x[token]
    outs, offset = [], 0
    for e, count in enumerate(counts):
        if count:
            gate, up = F.linear(xs[offset : offset + count], mlp.gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, mlp.down[e]))
            offset += count
    ys = torch.cat(outs) * top_w.flatten()[order].to(x.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, token, ys)


def moe_static(mlp: MoeMLP, x: torch.Tensor) -> torch.Tensor:
    """x: [N, H] -> [N, H], every expert over every token (see the module docstring)."""
    top_w, top_e = route(mlp, x)
    experts = mlp.router.shape[0]
    mix = torch.zeros(x.shape[0], experts, dtype=x.dtype, device=x.device)
    mix.scatter_(1, top_e, top_w.to(x.dtype))  # [N, E]
    gate, up = torch.matmul(x, mlp.gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
    ys = torch.matmul(F.silu(gate) * up, mlp.down.transpose(1, 2))  # [E, N, H]
    return torch.einsum("enh,ne->nh", ys, mix)
