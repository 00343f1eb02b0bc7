"""The fused vocabulary head: `train.logprobs` = "auto" | "fused" | "chunked".

    head = resolve_logprobs("fused", device_type="cuda", has_bias=False)   # "fused" or "chunked"
    logprobs = fused_logprobs(hidden, head_weight, labels, temperature=0.8)

"chunked" is rlpipe's own linear + log-softmax (training/logprobs.py): chunks of [C, V] logits,
each written and read again in the forward and recomputed in the backward. "fused" is Apple's Cut
Cross-Entropy (`cut-cross-entropy`, the `cce` extra: pip install 'rlpipe[cce]'): Triton kernels
that compute each token's logsumexp and its label's logit block by block in on-chip memory and
never write [tokens, vocab] logits, with a backward for any upstream gradient.
`linear_cross_entropy(e, c, labels, reduction="none")` returns per-token losses −log p(label), so
the log-probs are their negation; temperature is a scale of the embeddings, (h / τ) · Wᵀ = z / τ,
and autograd carries 1/τ back into the hidden states. Its default gradient filtering skips softmax
terms below a threshold; rlpipe's losses weight every token (advantages, ratios, KL) and need the
exact gradient, so the filter is off (`filter_eps=None`). Its backward takes bf16 or fp16
embeddings only: the fused head runs where the head's matmul is bf16 (bf16 autocast, the GPU
default, or bf16 weights), and a float32 head without autocast runs chunked.

Where the fused head cannot run, the chunked one runs, and one log line says why: no CUDA (the
kernels are Triton), the extra not installed, an LM head with a bias (the kernel takes none;
Qwen3 has none), or a float32 head.

"auto" is the chunked head, by measurement (`python -m benchmarks.bench_gpu --quick`,
docs/BENCHMARKS_GPU.md): on one H200, qwen3-0.6b at its 151,936-token vocabulary, the compiled
train step of 32,386 tokens took 0.367 s with the chunked head (its compiled kernels) and 0.446 s
with the fused one (fp32 master weights, bf16 autocast; 0.351 s against 0.438 s with bf16
weights), and the head alone at 32,768 tokens 0.101 s against 0.178 s forward + backward. The
fused head holds less: 0.35 GiB above its inputs against 1.22 GiB in pure bf16, so "fused" is a
memory option (a long-sequence or large-vocabulary step), not a speed one.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

LOGPROBS = ("auto", "fused", "chunked")
_said: set[str] = set()  # reasons already logged in this process


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("cut_cross_entropy") is not None


def fused_head_unavailable_reason(device_type: str, has_bias: bool = False,
                                  installed: bool | None = None,
                                  dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None if Cut Cross-Entropy's kernels can compute the log-probs here; else why not.
    installed: whether cut-cross-entropy is importable (None: look); dtype: the head's matmul dtype."""
    if device_type != "cuda":
        return f"Cut Cross-Entropy's Triton kernels need CUDA; the model trains on {device_type}"
    if has_bias:
        return "the LM head has a bias, which Cut Cross-Entropy's kernel does not take"
    if dtype not in (torch.bfloat16, torch.float16):
        return (f"Cut Cross-Entropy's backward takes bf16 or fp16 only and this head computes in "
                f"{str(dtype).removeprefix('torch.')} (no bf16 autocast)")
    if not (_installed() if installed is None else installed):
        return "cut-cross-entropy is not installed (pip install 'rlpipe[cce]')"
    return None


def resolve_logprobs(setting: str, device_type: str, has_bias: bool = False,
                     installed: bool | None = None, dtype: torch.dtype = torch.bfloat16) -> str:
    """What `train.logprobs` = setting comes to here: "fused" or "chunked". "auto" is "chunked"
    (measured; see the module docstring); "fused" where it cannot run is "chunked", logged once
    with why. dtype: the dtype the head's matmul runs in (head_matmul_dtype)."""
    if setting not in LOGPROBS:
        raise ValueError(f"train.logprobs must be one of {LOGPROBS}; got {setting!r}")
    if setting != "fused":
        return "chunked"
    reason = fused_head_unavailable_reason(device_type, has_bias, installed, dtype)
    if reason is None:
        return "fused"
    if reason not in _said:
        _said.add(reason)
        logging.getLogger(__name__).warning("train.logprobs = 'fused': %s; the chunked head runs instead", reason)
    return "chunked"


def head_matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul runs in: autocast's where autocast is on, else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   temperature: float = 1.0, ignore_index: int = -100) -> torch.Tensor:
    """log softmax(hidden · Wᵀ / temperature)[labels] from Cut Cross-Entropy, exact gradients:
    hidden [T, H], weight [V, H], labels [T] (ignore_index = no label) → float32 [T], 0 where
    ignored. The matmul runs in the autocast dtype where autocast is on, like the chunked head."""
    from cut_cross_entropy import linear_cross_entropy

    device_type = hidden.device.type
    dtype = head_matmul_dtype(hidden, weight)
    with torch.autocast(device_type, enabled=False):
        e = hidden.to(dtype)
        if temperature != 1.0:
            e = e / temperature
        loss = linear_cross_entropy(e, weight.to(dtype), labels, ignore_index=ignore_index,
                                    reduction="none", filter_eps=None)
    return -loss.float()
