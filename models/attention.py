"""Varlen attention for packed rows, registered with transformers: a varlen kernel on CUDA,
padded buckets through sdpa elsewhere.

On CUDA in 16-bit (bf16 autocast or bf16 weights), a packed row runs through torch's varlen
FlashAttention kernel (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10): no padding, no
mask, causal per segment; a shared-prefix continuation's keys are its prefix's then its own, and
the kernel's bottom-right causal alignment is exactly "all of the prefix, then causal" (measured
against a dense reference). fp32 on CUDA, and the CPU, use the buckets below.

Why: transformers' sdpa path builds a full T x T mask for a packed row, so a 2048-token pack costs
attention over 2048^2 pairs and trains slower than padding; torch's flex_attention has no CPU
backward. Here the projections and MLPs run on the packed tokens (no padding at all) and only
attention pads, per sequence: sequences are grouped into length buckets, each bucket is padded
to its own max length and run through sdpa with `is_causal=True`, and the outputs are unpadded.
Attention cost is then ~sum over buckets of n_b * L_b^2 instead of T^2.

In bf16 on CPU the per-bucket attention is two batched matmuls and a float32 softmax
(`causal_attention_bmm`): torch's bf16 flash kernel is slower than that at these lengths.

Right padding is exact under a causal mask: a real query at position i only sees keys 0..i, all
real. Padded query rows compute garbage that is never gathered back.

Usage: models built by `models.presets` / `models.loading` have
`config._attn_implementation == VARLEN_ATTENTION`. For packed rows call

    hidden, aux = model_hidden_states(model, batch)     # [T, H] after the final norm
    logits = packed_logits(model, batch)                # [T, V] (tests, small vocabularies)

or pass `**packed_forward_kwargs(batch)` to `model(...)` yourself. Calls without cu_seqlens (padded
batches with an attention mask, generation with a KV cache) fall back to plain sdpa with the mask
transformers builds, so the same model object serves the inference engine.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from rlpipe.models.varlen_plan import FlashViews, VarlenPlan, make_flash_views, make_plan
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN_ATTENTION = "rlpipe_varlen"

# bf16 on CPU: attention as matmuls + a float32 softmax, chunked to ~4 MB of scores at a time
# (measured: 1.1-3.8x faster fwd+bwd than torch's bf16 flash kernel for L <= 256, which runs
# slower than its own fp32 version; in fp32 the fused kernel is as fast or faster, so it stays).
_BMM_SCORE_ELEMENTS = 1 << 20


def _cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Boundaries of the sequences in a packed [1, T] row whose positions restart at 0."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([pos.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, end]).to(torch.int32)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype sdpa would run in: the autocast dtype inside autocast, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def visible_keys(offset: torch.Tensor, q_width: int, k_width: int) -> torch.Tensor:
    """bool [n, 1, Lq, Lk]: query slot a of view i sees key slot b iff b <= a + offset[i]."""
    a = torch.arange(q_width, device=offset.device)[:, None]
    b = torch.arange(k_width, device=offset.device)[None, :]
    return (b[None] <= a[None] + offset[:, None, None])[:, None]


def causal_attention_bmm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention as two batched matmuls and a float32 softmax.

    q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] (GQA: the query heads of a kv group are stacked
    along the rows, so k and v are never expanded); visible: bool [B, 1, Lq, Lk] or None (plain
    causal, Lq == Lk). Returns [B, Hq, Lq, D] in v's dtype. Chunked over B so the scores stay
    near cache size.
    """
    b, hq, q_width, d = q.shape
    hkv, k_width = k.shape[1], k.shape[2]
    rep = hq // hkv
    scale = scaling if scaling is not None else d**-0.5
    if visible is None:
        hidden = torch.ones(q_width, k_width, dtype=torch.bool, device=q.device).triu(1)
        hidden = hidden.repeat(rep, 1)  # [rep * Lq, Lk]
    else:
        hidden = (~visible).repeat(1, 1, rep, 1)  # [B, 1, rep * Lq, Lk]
    q = q.reshape(b, hkv, rep * q_width, d)
    step = max(1, _BMM_SCORE_ELEMENTS // (hq * q_width * k_width))
    outs = []
    for i in range(0, b, step):
        mask = hidden if visible is None else hidden[i : i + step]
        scores = torch.matmul(q[i : i + step], k[i : i + step].transpose(-1, -2))
        scores = scores.float().mul_(scale).masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        outs.append(torch.matmul(probs, v[i : i + step]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    return out.view(b, hq, q_width, d)


def flash_kernel():
    """torch's varlen FlashAttention kernel (CUDA, torch >= 2.10), or None where it is missing."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def takes_gqa_flag(kernel) -> bool:
    """Whether the varlen kernel wants `enable_gqa=True` for fewer kv heads than query heads:
    torch >= 2.13 refuses GQA without it (ValueError); torch 2.10-2.12 has no such argument and
    does GQA anyway."""
    return kernel is not None and "enable_gqa" in inspect.signature(kernel).parameters


# resolved once at import: the compiled decoder layer traces flash_attention, which must not
# import or inspect anything
_FLASH_KERNEL = flash_kernel()
_FLASH_TAKES_GQA = takes_gqa_flag(_FLASH_KERNEL)


def flash_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, views: FlashViews, scaling: float | None
) -> torch.Tensor:
    """Causal attention of a packed row through the varlen kernel: no padding, no T x T mask.

    query: [1, Hq, T, D]; key, value: [1, Hkv, T, D] (GQA: the kernel reads the kv heads in place).
    Returns [1, T, Hq, D].
    """
    low = _compute_dtype(query)
    q, k, v = (x[0].transpose(0, 1).to(low).contiguous() for x in (query, key, value))  # [T, H, D]
    if views.keys is not None:  # continuations: their prefix's keys, then their own
        k, v = k.index_select(0, views.keys), v.index_select(0, views.keys)
    gqa = {"enable_gqa": True} if _FLASH_TAKES_GQA and q.shape[1] != k.shape[1] else {}
    out = _FLASH_KERNEL(q, k, v, views.cu_q, views.cu_k, views.max_q, views.max_k, scale=scaling,
                        window_size=(-1, 0), **gqa)
    return out.unsqueeze(0)


def use_flash(model: PreTrainedModel) -> bool:
    """Whether packed rows of `model` go through the varlen kernel: CUDA, a kernel in this torch,
    16-bit compute (autocast or 16-bit weights), no attention dropout while training."""
    param = next(model.parameters())
    if param.device.type != "cuda" or _FLASH_KERNEL is None:
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else param.dtype
    dropout = float(getattr(model.config, "attention_dropout", 0.0) or 0.0)
    return dtype in (torch.bfloat16, torch.float16) and not (dropout > 0 and model.training)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: VarlenPlan,
    scaling: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention per view of one packed row.

    query: [1, Hq, T, D]; key, value: [1, Hkv, T, D] (GQA: Hq a multiple of Hkv).
    Returns [1, T, Hq, D] (transformers' attention-output layout).
    """
    if plan.flash is not None:
        return flash_attention(query, key, value, plan.flash, scaling)
    hq, hkv = query.shape[1], key.shape[1]
    low = _compute_dtype(query)
    use_bmm = query.device.type == "cpu" and low in (torch.bfloat16, torch.float16) and dropout == 0.0
    if use_bmm:
        query, key, value = (x.to(low) for x in (query, key, value))
    q_rows, k_rows, v_rows = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    outs = []
    for bucket in plan.buckets:
        nb, q_width = bucket.queries.shape
        k_width = bucket.keys.shape[1]
        q = q_rows.index_select(0, bucket.queries.reshape(-1)).view(nb, q_width, hq, -1).transpose(1, 2)
        k = k_rows.index_select(0, bucket.keys.reshape(-1)).view(nb, k_width, hkv, -1).transpose(1, 2)
        v = v_rows.index_select(0, bucket.keys.reshape(-1)).view(nb, k_width, hkv, -1).transpose(1, 2)
        visible = None if bucket.offset is None else visible_keys(bucket.offset, q_width, k_width)
        if use_bmm:
            o = causal_attention_bmm(q, k, v, scaling, visible)
        else:  # enable_gqa: sdpa broadcasts the kv heads itself (no repeat_kv copies)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible, dropout_p=dropout, is_causal=visible is None,
                scale=scaling, enable_gqa=hq != hkv,
            )
        outs.append(o.transpose(1, 2).reshape(nb * q_width, hq, -1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    return out.index_select(0, plan.scatter).unsqueeze(0)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls per layer (registered as VARLEN_ATTENTION).

    Packed path when a `varlen_plan` or `cu_seq_lens_q` is passed, or when there is no mask, no
    cache offset (q_len == k_len, batch 1) and `position_ids` restart inside the row. Otherwise
    plain sdpa with the mask transformers built (padded batches, KV-cache decoding).

    A plan for the varlen kernel (`plan.flash`, CUDA) runs right here, so a compiled decoder layer
    (models/compile.py) traces it into one graph with its projections and MLP: the kernel is a
    custom op with a fake implementation, and the plan was made outside the layers. Every other
    case goes through `_eager_attention_forward`, which compiled layers call out of the graph.
    """
    plan: VarlenPlan | None = kwargs.get("varlen_plan")
    if plan is not None and plan.flash is not None and kwargs.get("sliding_window") is None:
        _check_plan_covers(plan, query, key)
        return flash_attention(query, key, value, plan.flash, scaling), None
    return _eager_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _check_plan_covers(plan: VarlenPlan, query: torch.Tensor, key: torch.Tensor) -> None:
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or plan.n_tokens != query.shape[2]:
        raise ValueError(f"varlen plan covers {plan.n_tokens} tokens but the row has query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")


@torch.compiler.disable
def _eager_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # out of compiled graphs: bucket plans are made and read on the host (`.tolist()`), which
    # would break the graph or recompile per batch
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN_ATTENTION} does not support sliding-window attention")
    plan: VarlenPlan | None = kwargs.get("varlen_plan")
    same_len = query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if plan is None and same_len and attention_mask is None:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None and kwargs.get("position_ids") is not None:
            cu = _cu_seqlens_from_position_ids(kwargs["position_ids"])
        if cu is not None and cu.numel() > 2:
            plan = make_plan(cu)
    if plan is not None and same_len:
        _check_plan_covers(plan, query, key)
        return varlen_attention(query, key, value, plan, scaling, dropout), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function for VARLEN_ATTENTION: never a T x T mask for a packed training row.

    For one row (batch 1) with no padding mask and no cache offset, the attention function
    handles causality and packing itself (from cu_seqlens or position_ids), so return None.
    Otherwise (padded batches, several packed rows, decoding) build the mask sdpa would.
    """
    q_offset = kwargs.get("q_offset", 0)
    one_row = (
        kwargs.get("batch_size") == 1
        and kwargs.get("attention_mask") is None
        and isinstance(q_offset, int)
        and q_offset == 0
        and kwargs.get("q_length") == kwargs.get("kv_length")
    )
    return None if one_row else sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register VARLEN_ATTENTION with transformers (idempotent; done at import)."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)


register()


def packed_forward_kwargs(batch: Any, flash: bool = False) -> dict[str, Any]:
    """Keyword arguments that run a model on a PackedBatch (input_ids [1, T], ...).

    Includes FlashAttention-style `cu_seq_lens_q/k`, `max_length_q/k`, and a precomputed
    `varlen_plan` so the views are planned once per forward, not once per layer: for the varlen
    kernel when `flash` (see `use_flash`), else padded buckets.
    """
    cu = batch.cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    prefix_index = getattr(batch, "prefix_index", None)
    plan = make_flash_views(cu, prefix_index) if flash else make_plan(cu, prefix_index=prefix_index)
    return {
        "input_ids": batch.tokens.reshape(1, -1),
        "position_ids": batch.position_ids.reshape(1, -1),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
        "varlen_plan": plan,
        "use_cache": False,
    }


def _decoder(model: PreTrainedModel) -> torch.nn.Module:
    decoder = getattr(model, model.base_model_prefix, None)
    if decoder is None:
        raise ValueError(f"{type(model).__name__} has no base model {model.base_model_prefix!r}")
    return decoder


def _check_attention(model: PreTrainedModel) -> None:
    impl = model.config._attn_implementation
    if impl != VARLEN_ATTENTION:
        raise ValueError(
            f"model uses attention {impl!r}; packed rows need {VARLEN_ATTENTION!r} "
            "(build it with models.presets or load it with models.loading)"
        )


def model_hidden_states(
    model: PreTrainedModel, batch: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the decoder on a PackedBatch; final hidden states [T, H] (after the final norm).

    Returns (hidden, aux_loss): aux_loss is the router load-balancing loss (a scalar, not yet
    multiplied by config.router_aux_loss_coef) when the model is MoE with output_router_logits,
    else None. The lm_head is not applied (the loss helper applies it in chunks).
    """
    _check_attention(model)
    kwargs = packed_forward_kwargs(batch, flash=use_flash(model))
    want_router = bool(getattr(model.config, "output_router_logits", False))
    if want_router:
        kwargs["output_router_logits"] = True
    out = _decoder(model)(**kwargs)
    hidden = out.last_hidden_state[0]
    aux = None
    if want_router:
        aux = router_aux_loss(model, out.router_logits)
    return hidden, aux


def router_aux_loss(model: PreTrainedModel, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Switch-style load-balancing loss over all layers' router logits ([T, E] each).

    Same formula as transformers' load_balancing_loss_func without a padding mask (packed rows have
    no padding): E * sum_e (fraction of top-k assignments to e) * (mean router prob of e).
    """
    n_experts = model.config.num_experts
    top_k = model.config.num_experts_per_tok
    logits = torch.cat([r.float() for r in router_logits], 0)  # [layers * T, E]
    probs = torch.softmax(logits, dim=-1)
    top = torch.topk(probs, top_k, dim=-1).indices
    counts = torch.zeros(n_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, top.reshape(-1), torch.ones(top.numel(), device=logits.device))
    tokens_per_expert = counts / logits.shape[0]
    prob_per_expert = probs.mean(0)
    return n_experts * torch.sum(tokens_per_expert * prob_per_expert)


def packed_logits(model: PreTrainedModel, batch: Any) -> torch.Tensor:
    """Logits [T, V] of a PackedBatch (float32 output head; for tests and small vocabularies)."""
    hidden, _ = model_hidden_states(model, batch)
    return model.get_output_embeddings()(hidden)
