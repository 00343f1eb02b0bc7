"""Packed (varlen) attention equals unpacked attention, and never builds a T x T mask."""

from __future__ import annotations

import pytest
import rlpipe.models.attention as attention
import torch
import torch.nn.functional as F
from rlpipe.models.attention import (
    model_hidden_states,
    packed_forward_kwargs,
    packed_logits,
)
from rlpipe.models.presets import build_model
from rlpipe.models.varlen_plan import make_plan, plan_buckets
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.padding import pad_batch

VOCAB = 64
LENGTHS = [7, 33, 2, 64, 1, 40, 19]
TOL = 1e-4


def _sequences(lengths=LENGTHS, seed=0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        toks = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        out.append(Sequence(tokens=toks, weights=[1.0] * n, sample_id=f"s{i}"))
    return out


def _model(preset: str):
    return build_model(preset, VOCAB, seed=1, pad_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("train", [True, False])
def test_packed_logits_equal_per_sequence(preset, train):
    model = _model(preset).train(train)
    (batch,) = pack(_sequences(), token_budget=1024)
    with torch.no_grad():
        packed = packed_logits(model, batch)
        cu = batch.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            alone = model(input_ids=batch.tokens[a:b][None]).logits[0]
            assert (packed[a:b] - alone).abs().max().item() <= TOL


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_padded_fallback_matches_packed(preset):
    """A padded batch with an attention mask (the engine's path) gives the packed logits."""
    model = _model(preset).eval()
    seqs = _sequences()
    (batch,) = pack(seqs, token_budget=1024)
    padded = pad_batch(seqs)
    with torch.no_grad():
        packed = packed_logits(model, batch)
        logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
    by_id = dict(zip(batch.sample_ids, zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist(), strict=True), strict=True))
    for i, s in enumerate(seqs):
        a, b = by_id[s.sample_id]
        assert (logits[i, : len(s.tokens)] - packed[a:b]).abs().max().item() <= TOL


def test_position_ids_alone_select_the_packed_path():
    """Without cu_seqlens, restarting position_ids still give per-sequence attention."""
    model = _model("tiny-dense").eval()
    (batch,) = pack(_sequences(), token_budget=1024)
    with torch.no_grad():
        expected = packed_logits(model, batch)
        got = model(input_ids=batch.tokens[None], position_ids=batch.position_ids[None]).logits[0]
    assert (got - expected).abs().max().item() <= TOL


def test_packed_gradients_equal_per_sequence_gradients():
    seqs = _sequences([9, 30, 3, 17])
    model = _model("tiny-dense")
    (batch,) = pack(seqs, token_budget=1024)
    loss = F.cross_entropy(packed_logits(model, batch), batch.labels, reduction="sum")
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for s in seqs:
        ids = torch.tensor(s.tokens)[None]
        logits = model(input_ids=ids).logits[0, :-1]
        F.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()
    for g, p in zip(packed_grads, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad, atol=1e-4, rtol=1e-3)


def test_no_full_mask_for_packed_rows(monkeypatch):
    """Packed calls never build a mask and run sdpa only on per-sequence-sized buckets."""
    model = _model("tiny-dense")
    lengths = [256] + [16] * 10  # one long sequence among short ones
    (batch,) = pack(_sequences(lengths), token_budget=1024)

    def no_mask(*args, **kwargs):
        raise AssertionError("a mask was built for a packed row")

    shapes = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        assert attn_mask is None and kwargs.get("is_causal")
        shapes.append(tuple(q.shape))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention, "sdpa_mask", no_mask)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    hidden, aux = model_hidden_states(model, batch)
    assert hidden.shape == (batch.n_tokens, model.config.hidden_size) and aux is None
    assert shapes, "varlen attention did not run"
    assert all(s[2] <= max(lengths) for s in shapes)  # bucket width, never T
    # short sequences are not padded to the long one: attention pairs well under T^2 / 2
    pairs = sum(s[0] * s[2] ** 2 for s in shapes) / model.config.num_hidden_layers
    assert pairs < batch.n_tokens**2 / 2


def test_moe_aux_loss_matches_transformers():
    model = _model("tiny-moe")
    (batch,) = pack(_sequences(), token_budget=1024)
    _, aux = model_hidden_states(model, batch)
    kwargs = packed_forward_kwargs(batch)
    reference = model(**kwargs, output_router_logits=True).aux_loss
    assert aux is not None and aux.requires_grad
    assert torch.allclose(aux, reference, atol=1e-5)


def test_generation_with_cache_matches_sdpa():
    model = _model("tiny-dense").eval()
    reference = _model("tiny-dense").eval()
    reference.set_attn_implementation("sdpa")
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def test_plan_buckets_cover_each_sequence_once():
    lens = [5, 200, 7, 180, 30, 31, 1]
    for cost in (0, 1000, 10**9):
        buckets = plan_buckets(lens, call_cost=cost)
        assert sorted(i for b in buckets for i in b) == list(range(len(lens)))
    assert len(plan_buckets(lens, call_cost=10**9)) == 1
    assert len(plan_buckets(lens, call_cost=0)) == len(set(lens))


def test_plan_scatter_inverts_gather():
    cu = torch.tensor([0, 3, 10, 11, 15], dtype=torch.int32)
    plan = make_plan(cu, call_cost=0)
    flat = torch.cat([b.queries.reshape(-1) for b in plan.buckets])
    assert torch.equal(flat[plan.scatter], torch.arange(15))


def test_model_without_varlen_attention_is_rejected():
    model = _model("tiny-dense")
    model.set_attn_implementation("sdpa")
    (batch,) = pack(_sequences([4, 5]), token_budget=64)
    with pytest.raises(ValueError, match="rlpipe_varlen"):
        model_hidden_states(model, batch)


def test_several_packed_rows_without_cu_seqlens_fall_back_to_a_correct_mask():
    """Batch > 1 of packed rows (position_ids only): transformers' packed mask, still exact."""
    model = _model("tiny-dense").eval()
    (a,) = pack(_sequences([5, 11]), token_budget=16)
    (b,) = pack(_sequences([9, 7], seed=1), token_budget=16)
    ids = torch.stack([a.tokens, b.tokens])
    pos = torch.stack([a.position_ids, b.position_ids])
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits
        assert (got[0] - packed_logits(model, a)).abs().max().item() <= TOL
        assert (got[1] - packed_logits(model, b)).abs().max().item() <= TOL


def test_bf16_autocast_packed_matches_per_sequence(monkeypatch):
    """Under CPU bf16 autocast the matmul attention path runs and stays close to unpacked."""
    model = _model("tiny-dense").eval()
    (batch,) = pack(_sequences(), token_budget=1024)
    calls = []
    real = attention.causal_attention_bmm
    monkeypatch.setattr(attention, "causal_attention_bmm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = packed_logits(model, batch).float()
        cu = batch.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            alone = model(input_ids=batch.tokens[a:b][None]).logits[0].float()
            assert (packed[a:b] - alone).abs().max().item() <= 0.05
    assert calls
