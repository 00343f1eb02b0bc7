"""A CPU implementation of torch's varlen attention op, for tests of the CUDA flash path on a CPU.

`torch.nn.attention.varlen.varlen_attn` dispatches to the custom op `torch_attn::_varlen_attn`
(and `_varlen_attn_backward` for autograd), whose only real kernels are CUDA ones. Registering
the dense maths below as their CPU kernels lets a test run rlpipe's flash path unchanged on the
CPU: the same argument checks in `varlen_attn` (GQA included), the same custom-op dispatch and
autograd formula, and the same fake implementation when dynamo traces it into a compiled graph.
Only the kernel differs, so these tests say nothing about the CUDA kernel's numerics
(tests/gpu does).
"""

from __future__ import annotations

import torch

_registered = False


def _segments(q, k, v, cu_q, cu_k):
    """Per segment: q [H, Lq, D], k and v [H, Lk, D] in float32 (GQA: kv heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i]:bounds_q[i + 1]].transpose(0, 1).float()
        ks, vs = (x[bounds_k[i]:bounds_k[i + 1]].transpose(0, 1).float().repeat_interleave(rep, 0)
                  for x in (k, v))
        yield qs, ks, vs


def _probs(qs, ks, is_causal, scale):
    """softmax(q kᵀ · scale), bottom-right causal (query a sees keys 0 .. a + Lk - Lq); and its lse."""
    scores = qs @ ks.transpose(-1, -2) * scale
    if is_causal:
        lq, lk = qs.shape[1], ks.shape[1]
        hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1), torch.logsumexp(scores, -1)


def _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
             window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for qs, ks, vs in _segments(query, key, value, cu_seq_q, cu_seq_k):
        probs, lse = _probs(qs, ks, is_causal, scale)
        outs.append((probs @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(query.dtype), torch.cat(lses, -1), torch.zeros(2, dtype=torch.uint64)


def _backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
              rng_state, scale=None, window_size=None):
    # the textbook attention backward (kernels run below autograd, so no autograd.grad here)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    rep = query.shape[1] // key.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (query, key, value))
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    segments = _segments(query, key, value, cu_seq_q, cu_seq_k)
    for i, (qs, ks, vs) in enumerate(segments):
        rows_q, rows_k = slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_k[i], bounds_k[i + 1])
        probs, _ = _probs(qs, ks, is_causal, scale)
        d_out = grad_out[rows_q].transpose(0, 1).float()  # [H, Lq, D]
        o = probs @ vs
        d_probs = d_out @ vs.transpose(-1, -2)
        d_scores = probs * (d_probs - (d_out * o).sum(-1, keepdim=True))
        dq[rows_q] = (d_scores @ ks * scale).transpose(0, 1)
        d_keys = (d_scores.transpose(-1, -2) @ qs * scale)  # [Hq, Lk, D]: fold the query heads of a kv group
        d_values = probs.transpose(-1, -2) @ d_out
        for grad, part in ((dk, d_keys), (dv, d_values)):
            grad[rows_k] += part.unflatten(0, (-1, rep)).sum(1).transpose(0, 1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def register_cpu_varlen_kernel() -> None:
    """Give `torch_attn::_varlen_attn` (and its backward) CPU kernels, once per process."""
    global _registered
    if _registered:
        return
    import torch.nn.attention.varlen  # noqa: F401  (defines the ops)

    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _backward)
    _registered = True
