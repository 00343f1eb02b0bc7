"""The varlen-kernel (flash) path of packed attention, run on the CPU through a reference kernel.

On CUDA, packed rows go through torch's varlen attention op; here tests/varlen_cpu_kernel.py gives
that op a CPU kernel, so everything around it (the GQA argument, continuations' key gathering,
the custom op's autograd, compiled layers tracing it) is checked against the bucket path.
"""

from __future__ import annotations

import pytest
import rlpipe.models.attention as attention
import torch
from rlpipe.models.attention import takes_gqa_flag
from rlpipe.models.presets import build_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.logprobs import token_logprobs

from tests.varlen_cpu_kernel import register_cpu_varlen_kernel

VOCAB = 64


def _groups(seed: int = 0, n_groups: int = 3, group_size: int = 3) -> list[Sequence]:
    """Prompts with several completions each (shared prefixes when packed) plus lone sequences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
        for ci in range(group_size):
            completion = torch.randint(1, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            out.append(Sequence(tokens=prompt + completion, weights=[0.0] * len(prompt) + [1.0] * len(completion),
                                sample_id=f"g{gi}:{ci}", prefix_len=len(prompt)))
    for i, n in enumerate((9, 31)):
        tokens = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        out.append(Sequence(tokens=tokens, weights=[1.0] * n, sample_id=f"s{i}"))
    return out


def _logprobs_and_grads(model, batch, flash: bool, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    monkeypatch.setattr(attention, "use_flash", lambda _model: flash)
    model.zero_grad()
    logprobs, _ = token_logprobs(model, batch)
    (logprobs * batch.token_weights).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_gqa_flag_follows_the_kernel_signature():
    """torch >= 2.13's varlen_attn refuses GQA without `enable_gqa`; 2.10-2.12's has no such argument."""

    def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                         scale=None, window_size=(-1, -1)):
        raise AssertionError("only the signature is read")

    assert not takes_gqa_flag(varlen_attn_2_11)
    assert not takes_gqa_flag(None)
    kernel = attention.flash_kernel()
    if kernel is None:
        pytest.skip("this torch has no varlen kernel")
    expects_flag = torch.__version__ >= "2.13"
    assert takes_gqa_flag(kernel) == expects_flag, torch.__version__


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_flash_path_equals_the_bucket_path_with_gqa_and_shared_prefixes(preset, monkeypatch):
    """Log-probs and gradients through the varlen op (GQA 4/2 heads, continuations reading their
    prefix's keys) equal the bucket path's."""
    if attention.flash_kernel() is None:
        pytest.skip("this torch has no varlen kernel")
    register_cpu_varlen_kernel()
    model = build_model(preset, VOCAB, seed=1, pad_token_id=0, eos_token_id=0).train()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
    (batch,) = pack(_groups(), token_budget=1024)
    assert batch.prefix_index is not None and (batch.prefix_index >= 0).any()
    buckets, bucket_grads = _logprobs_and_grads(model, batch, False, monkeypatch)
    flash, flash_grads = _logprobs_and_grads(model, batch, True, monkeypatch)
    torch.testing.assert_close(flash, buckets, atol=1e-5, rtol=1e-5)
    assert bucket_grads.keys() == flash_grads.keys() and len(flash_grads) > 0
    for name, grad in bucket_grads.items():
        torch.testing.assert_close(flash_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_flash_plan_for_another_row_is_refused(monkeypatch):
    if attention.flash_kernel() is None:
        pytest.skip("this torch has no varlen kernel")
    register_cpu_varlen_kernel()
    model = build_model("tiny-dense", VOCAB, seed=1, pad_token_id=0, eos_token_id=0)
    (batch,) = pack(_groups(), token_budget=1024)
    kwargs = attention.packed_forward_kwargs(batch, flash=True)
    kwargs["input_ids"] = kwargs["input_ids"][:, :-1]
    kwargs["position_ids"] = kwargs["position_ids"][:, :-1]
    with pytest.raises(ValueError, match=f"varlen plan covers {batch.n_tokens} tokens"):
        model.model(**kwargs)
