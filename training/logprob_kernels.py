"""Per-chunk work of the selective log-softmax (training/logprobs.py): eager and compiled.

For one chunk of tokens, z = (h · Wᵀ + b) · s with s = 1/temperature, and
- forward:  logp[label] = z[label] − lse, with lse = logsumexp(z) saved for the backward;
- backward: d logp / d raw logits = g · (onehot(label) − exp(z − lse)), where g already holds the
  incoming gradient × s × (label valid). With lse saved, the backward reduces nothing over V:
  one elementwise pass over the recomputed logits.

The matmuls are the only real work; everything else is memory-bound passes over [C, V]. Two
implementations of the same arithmetic:
- `fused=True`: two small functions compiled with torch.compile (one kernel each on CUDA): the
  forward reads the matmul output once (in its own dtype, bf16 under autocast) and accumulates
  in float32; the backward writes grad_logits straight in the matmul dtype. No float32 [C, V]
  tensor exists. `dynamic=True`, so the shorter last chunk does not recompile (a chunk of exactly
  one token does, once: torch specialises sizes 0 and 1).
- `fused=False` (eager): the float32 logits go into one [C, V] workspace reused by every chunk
  (on the CPU a fresh 600 MB tensor costs ~0.4 s of page faults per chunk), bias and 1/τ fold
  into the GEMM (1/τ scales h, addmm adds the bias) when it runs in float32, and the passes run in place:
  forward amax, sub, exp, sum; backward sub, exp, mul (+ a [C]-element scatter).
"""

from __future__ import annotations

import functools

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for logits of `dtype`: float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def make_workspace(rows: int, vocab: int, cdtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The eager path's [rows, V] buffer in the accumulation dtype, reused across chunks."""
    return torch.empty(rows, vocab, dtype=acc_dtype(cdtype), device=device)


# --- eager ---------------------------------------------------------------------------------


def _eager_logits(h, w, bias, scale, workspace):
    """z = (h · Wᵀ + b) · scale into the workspace's first C rows (overwritten), float32."""
    z = workspace[: h.shape[0]]
    if h.dtype == z.dtype:  # float32/64 GEMM: 1/τ scales h ([C, H]), the bias rides on addmm
        if bias is None:  # mm is ~10% faster than addmm with beta = 0 on the CPU
            return torch.mm(h * scale if scale != 1.0 else h, w.t(), out=z)
        return torch.addmm(bias, h, w.t(), beta=scale, alpha=scale, out=z)
    z.copy_(h @ w.t())  # low-precision GEMM (autocast): round once to its dtype, then upcast
    if bias is not None:
        z.add_(bias.to(z.dtype))
    if scale != 1.0:
        z.mul_(scale)
    return z


def _eager_forward(z, labels):
    """(logp[label], lse) of the rows of z; overwrites z."""
    picked = z.gather(1, labels[:, None]).squeeze(1)
    row_max = z.amax(dim=-1, keepdim=True)
    lse = z.sub_(row_max).exp_().sum(dim=-1).log_().add_(row_max.squeeze(1))
    return picked - lse, lse


def _eager_grad_logits(z, labels, lse, g, need_bias_grad, out_dtype):
    """g · (onehot − exp(z − lse)) in out_dtype, and its column sum (float32) if asked; overwrites z."""
    z.sub_(lse[:, None]).exp_().mul_(-g[:, None])
    z.scatter_add_(1, labels[:, None], g[:, None])
    grad_b = z.sum(dim=0) if need_bias_grad else None
    return z.to(out_dtype), grad_b


# --- fused (torch.compile) -----------------------------------------------------------------


def _scaled_logits(logits, bias, scale):
    z = logits.to(acc_dtype(logits.dtype))
    if bias is not None:
        z = z + bias
    return z * scale


def _fused_forward(logits, labels, bias, scale):
    """(logp[label], lse) from the matmul output `logits` [C, V] (any float dtype)."""
    z = _scaled_logits(logits, bias, scale)
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(1, labels[:, None]).squeeze(1) - lse, lse


def _fused_grad_logits(logits, labels, lse, g, bias, scale, need_bias_grad: bool):
    """g · (onehot − exp(z − lse)) in logits' dtype, and its float32 column sum if asked."""
    z = _scaled_logits(logits, bias, scale)
    onehot = labels[:, None] == torch.arange(z.shape[1], device=z.device)
    grad = g[:, None] * (onehot.to(z.dtype) - torch.exp(z - lse[:, None]))
    return grad.to(logits.dtype), (grad.sum(dim=0) if need_bias_grad else None)


@functools.cache
def _compiled(kernel):
    """`kernel` compiled, built at first use so processes that never fuse skip importing inductor.
    One graph per dtype / bias-or-not, shared by every chunk length."""
    return torch.compile(kernel, dynamic=True)


# --- per-chunk entry points ----------------------------------------------------------------


def chunk_forward(h, w, bias, labels, scale: float, fused: bool, workspace):
    """One chunk's (logp[label] [C], lse [C]) in the accumulation dtype.

    h [C, H], w [V, H] already in the matmul dtype; bias [V] in the accumulation dtype or None;
    labels [C] all valid indices; workspace from `make_workspace` (eager only, else None).
    """
    if fused:  # [C] vectors cloned: a view makes dynamo guard on its base's size (recompiles)
        return _compiled(_fused_forward)(h @ w.t(), labels.clone(), bias, scale)
    return _eager_forward(_eager_logits(h, w, bias, scale, workspace), labels)


def chunk_grad_logits(h, w, bias, labels, lse, g, scale: float, need_bias_grad: bool, fused: bool, workspace):
    """One chunk's gradient w.r.t. its raw logits h · Wᵀ (+ b), [C, V] in h's dtype (the matmul
    dtype), and its column sum [V] in the accumulation dtype when need_bias_grad (else None)."""
    if fused:
        return _compiled(_fused_grad_logits)(h @ w.t(), labels.clone(), lse.clone(), g.clone(), bias, scale, need_bias_grad)
    z = _eager_logits(h, w, bias, scale, workspace)
    return _eager_grad_logits(z, labels, lse, g, need_bias_grad, h.dtype)
