"""Per-token entropy of the policy, computed chunk by chunk like the log-probs.

H_t = −Σ_v p_v log p_v with p = softmax(h_t · Wᵀ (+ b) / τ): the entropy of the distribution the
engine samples from (same temperature). Entropy collapse (H → 0 on completion tokens) is the
usual sign that RL has stopped exploring, so the training step logs its mean over loss tokens
(`train/entropy`).

It is a metric, not a loss term: computed under no_grad from the detached hidden states, one
[chunk, V] float32 block at a time (never [T, V]); the cost is one extra LM-head matmul per token,
the same as TRL's GRPOTrainer, which computes entropies on every step.
"""

from __future__ import annotations

import torch
from rlpipe.models.attention import model_hidden_states
from rlpipe.training.logprobs import _chunk_logits, _compute_dtype, head_logprobs


@torch.no_grad()
def chunked_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy of softmax(hidden · Wᵀ (+ b) / temperature) per row: hidden [T, H], W [V, H] →
    float32 [T] (float64 for float64 inputs)."""
    if chunk_size < 1 or not temperature > 0:
        raise ValueError(f"need chunk_size >= 1 and temperature > 0; got {chunk_size}, {temperature}")
    hidden = hidden.detach()
    cdtype = _compute_dtype(hidden, lm_head_weight)
    out = torch.empty(hidden.shape[0], dtype=torch.promote_types(cdtype, torch.float32),
                      device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w = lm_head_weight.detach().to(cdtype)
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            z = _chunk_logits(hidden[sl].to(cdtype), w, lm_head_bias, temperature)
            z.sub_(z.amax(dim=-1, keepdim=True))  # z − max: exp cannot overflow
            e = z.exp()
            total = e.sum(dim=-1)
            # H = log Σe − Σ e·z / Σe  (with z shifted by the row max)
            out[sl] = total.log() - (e * z).sum(dim=-1) / total
            del z, e
    return out


def token_logprobs_and_entropy(
    model: torch.nn.Module, batch, temperature: float = 1.0, chunk_size: int = 1024, head: str = "chunked"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`training.logprobs.token_logprobs` plus the per-token entropy [T] (no gradient, always the
    chunked head), from one decoder pass: (logprobs float32 [T], router aux loss or None, entropy
    float32 [T])."""
    hidden, aux_loss = model_hidden_states(model, batch)
    lm_head = model.get_output_embeddings()
    logprobs = head_logprobs(model, hidden, batch.labels, temperature, chunk_size, "eager", head)
    entropy = chunked_entropy(hidden, lm_head.weight, chunk_size, temperature, getattr(lm_head, "bias", None))
    return logprobs, aux_loss, entropy
