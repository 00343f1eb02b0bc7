"""Shared-prefix packing: an RL group's prompt is laid out once per micro-batch, and the
log-probs, losses and gradients equal those of the unshared layout."""

from __future__ import annotations

import pytest
import torch
from rlpipe.models.presets import build_model
from rlpipe.models.varlen_plan import make_plan
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.logprobs import token_logprobs
from rlpipe.training.loss_inputs import bind_old_logprobs
from rlpipe.training.losses import batch_counts
from rlpipe.training.rl_loss import build_rl_loss
from rlpipe.training.step import StepOptions, forward_backward

VOCAB = 64


def _groups(n_groups=3, group_size=4, seed=0) -> list[Sequence]:
    """RL-like sequences: per group one prompt, completions of varied lengths, weight = advantage."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for ci in range(group_size):
            completion = torch.randint(1, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            adv = float(torch.randn(1, generator=g))
            out.append(Sequence(
                tokens=prompt + completion,
                weights=[0.0] * len(prompt) + [adv] * len(completion),
                logprobs=[0.0] * len(prompt) + [-1.0] * len(completion),
                reward=adv, sample_id=f"g{gi}:{ci}", prefix_len=len(prompt),
            ))
    return out


def _model(preset="tiny-dense"):
    return build_model(preset, VOCAB, seed=3, pad_token_id=0, eos_token_id=0)


def _per_sample_logprobs(batch, logprobs) -> dict[str, list[float]]:
    """sample_id -> log-probs of its weighted (completion) labels, in order."""
    cu = batch.cu_seqlens.tolist()
    out = {}
    for s, sid in enumerate(batch.sample_ids):
        if not sid:
            continue
        sl = slice(cu[s], cu[s + 1])
        mask = batch.token_weights[sl] != 0
        out[sid] = logprobs[sl][mask].tolist()
    return out


def test_layout_shares_each_prompt_once():
    seqs = _groups()
    (shared,) = pack(seqs, token_budget=4096)
    (plain,) = pack(seqs, token_budget=4096, share_prefixes=False)
    prompt_lens = {s.sample_id.split(":")[0]: s.prefix_len for s in seqs}
    saved = sum(3 * (p - 1) for p in prompt_lens.values())  # 4 completions share prompt[:-1]
    assert plain.n_tokens - shared.n_tokens == saved
    assert shared.prefix_index is not None and plain.prefix_index is None
    # each continuation's positions continue from its prefix; the prefix restarts at 0
    cu = shared.cu_seqlens.tolist()
    for s, j in enumerate(shared.prefix_index.tolist()):
        first = int(shared.position_ids[cu[s]])
        assert first == (cu[j + 1] - cu[j] if j >= 0 else 0)
    full = dict(zip(shared.sample_ids, shared.full_lengths(), strict=True))
    assert all(full[s.sample_id] == len(s.tokens) for s in seqs)
    assert sorted(s for s in shared.sample_ids if s) == sorted(s.sample_id for s in seqs)
    # the same loss tokens, weights and engine log-probs, only laid out differently
    assert batch_counts(shared)["loss_tokens"] == batch_counts(plain)["loss_tokens"]
    assert sorted(shared.token_weights[shared.token_weights != 0].tolist()) == sorted(
        plain.token_weights[plain.token_weights != 0].tolist())


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_logprobs_equal_the_unshared_layout(preset):
    model = _model(preset).eval()
    seqs = _groups()
    (shared,) = pack(seqs, token_budget=4096)
    (plain,) = pack(seqs, token_budget=4096, share_prefixes=False)
    with torch.no_grad():
        a = _per_sample_logprobs(shared, token_logprobs(model, shared)[0])
        b = _per_sample_logprobs(plain, token_logprobs(model, plain)[0])
    assert a.keys() == b.keys()
    for sid in a:
        assert torch.allclose(torch.tensor(a[sid]), torch.tensor(b[sid]), atol=1e-5), sid


@pytest.mark.parametrize("normaliser", ["token", "sequence"])
def test_gradients_equal_the_unshared_layout(normaliser):
    seqs = _groups()
    loss_fn = build_rl_loss("reinforce")
    grads = []
    for share in (True, False):
        model = _model()
        metrics = forward_backward(model, pack(seqs, 4096, share_prefixes=share), loss_fn, StepOptions(normaliser=normaliser))
        grads.append((metrics["loss"], {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, ga), (loss_b, gb) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6, rtol=1e-4), name


def test_small_budget_splits_a_group_and_keeps_every_sample():
    seqs = _groups(n_groups=2, group_size=6)
    budget = max(len(s.tokens) for s in seqs) + 6
    batches = pack(seqs, token_budget=budget)
    assert all(b.n_tokens <= budget for b in batches)
    ids = [s for b in batches for s in b.sample_ids if s]
    assert sorted(ids) == sorted(s.sample_id for s in seqs)


def test_sequences_without_prefix_or_alone_are_packed_whole():
    seqs = _groups(n_groups=2, group_size=1) + [Sequence(tokens=[5, 6, 7], weights=[0, 1, 1])]
    (batch,) = pack(seqs, token_budget=4096)
    assert batch.prefix_index is None  # nothing to share: the plain layout
    assert batch.n_tokens == sum(len(s.tokens) for s in seqs)


def test_weighted_prefix_is_refused():
    with pytest.raises(ValueError, match="shared prefix must carry no loss"):
        Sequence(tokens=[1, 2, 3, 4], weights=[0, 1, 0, 1], prefix_len=3)
    with pytest.raises(ValueError, match="prefix_len"):
        Sequence(tokens=[1, 2], weights=[0, 1], prefix_len=5)


def test_plan_rejects_a_prefix_that_has_a_prefix():
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="earlier segment without a prefix"):
        make_plan(cu, prefix_index=torch.tensor([-1, 0, 1]))


def test_old_logprobs_bind_to_shared_batches():
    seqs = _groups()
    batches = pack(seqs, 4096)
    model = _model()
    with torch.no_grad():
        old = [token_logprobs(model, b)[0] for b in batches]
    loss_fn = bind_old_logprobs(build_rl_loss("ppo_clip"), batches, old)
    metrics = forward_backward(model, batches, loss_fn)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_bf16_autocast_logprobs_match_the_unshared_layout():
    """The bf16 matmul attention path with a shared prefix (masked, Lq != Lk)."""
    model = _model().eval()
    seqs = _groups(seed=1)
    (shared,) = pack(seqs, token_budget=4096)
    (plain,) = pack(seqs, token_budget=4096, share_prefixes=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = _per_sample_logprobs(shared, token_logprobs(model, shared)[0])
        b = _per_sample_logprobs(plain, token_logprobs(model, plain)[0])
    with torch.no_grad():
        exact = _per_sample_logprobs(plain, token_logprobs(model, plain)[0])
    for sid in a:
        gap = (torch.tensor(a[sid]) - torch.tensor(b[sid])).abs().max()
        assert gap <= 0.05, sid  # bf16 rounding differs with the layout, not the result
        assert (torch.tensor(a[sid]) - torch.tensor(exact[sid])).abs().max() <= 0.1


def _with_loss_mask(seqs: list[Sequence], zero_group: str | None = None) -> list[Sequence]:
    """RL packing's sequences: every completion token a loss token; `zero_group`'s advantages 0."""
    out = []
    for s in seqs:
        adv = 0.0 if s.sample_id.startswith(f"{zero_group}:") else None
        weights = s.weights if adv is None else [0.0] * len(s.weights)
        out.append(Sequence(tokens=s.tokens, weights=weights, logprobs=s.logprobs, reward=s.reward,
                            sample_id=s.sample_id, prefix_len=s.prefix_len,
                            loss_mask=[False] * s.prefix_len + [True] * (len(s.tokens) - s.prefix_len)))
    return out


@pytest.mark.parametrize("share", [True, False])
def test_zero_advantage_completions_still_count_in_the_token_normaliser(share):
    """TRL's dapo / DAPO: the token mean runs over every completion token of the step."""
    seqs = _with_loss_mask(_groups(), zero_group="g1")
    batches = pack(seqs, 4096, share_prefixes=share)
    completion_tokens = sum(len(s.tokens) - s.prefix_len for s in seqs)
    assert sum(batch_counts(b)["loss_tokens"] for b in batches) == completion_tokens
    # the same gradient as the weighted sum over all completion tokens, computed by hand
    model = _model()
    forward_backward(model, batches, build_rl_loss("reinforce"), StepOptions(normaliser="token"))
    got = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    (plain,) = pack(seqs, 4096, share_prefixes=False)
    logprobs, _ = token_logprobs(model, plain)
    (-(plain.token_weights * logprobs).sum() / completion_tokens).backward()
    assert torch.allclose(got, model.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-4)


def test_loss_mask_on_a_shared_prefix_is_refused():
    with pytest.raises(ValueError, match="shared prefix must carry no loss"):
        Sequence(tokens=[1, 2, 3, 4], weights=[0, 0, 0, 1], prefix_len=3, loss_mask=[False, True, False, True])


def test_a_step_whose_advantages_are_all_zero_is_skipped_without_touching_the_weights():
    from rlpipe.tasks.train import train_on_batches
    from rlpipe.training.step import build_optimizer
    from rlpipe.training.trainer import LocalTrainer, TrainOptions

    seqs = _with_loss_mask(_groups(n_groups=1), zero_group="g0")
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(model, lr=1e-2)
    trainer = LocalTrainer(model, optimizer, None, TrainOptions(step=StepOptions(normaliser="token", autocast=False, entropy=True),
                                                                max_grad_norm=1.0))
    metrics = train_on_batches(trainer, pack(seqs, 4096), build_rl_loss("reinforce"), step=1)
    assert metrics["skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
