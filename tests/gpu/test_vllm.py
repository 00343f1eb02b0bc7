"""VllmEngine on a CUDA machine with vLLM: log-probs that match the trainer's recomputation and
weights that follow the optimizer (its CPU-side checks: tests/unit/test_vllm_engine.py)."""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.engines.vllm_lifecycle import vllm_unavailable_reason
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.batch import Sequence, pack_one
from rlpipe.training.logprobs import token_logprobs

REASON = vllm_unavailable_reason()
# Engine vs trainer log-probs, fp32 on both sides. Dense: both run fp32 cuBLAS GEMMs, 1e-3.
# MoE: vLLM's fused-expert Triton kernel multiplies fp32 operands with `tl.dot` at Triton's default
# fp32 precision, TF32 (10-bit mantissa, unit roundoff 2^-11), while the trainer's expert GEMMs are
# full fp32. Rounding the trainer's own expert GEMM operands to TF32 (round to nearest even, eager
# experts; 4 seeds x 320 tokens of the tiny-moe preset, temperature 0.8) moves its log-probs by at
# most 1.2e-4 at initialisation and 1.04e-3 after the test's 0.05 weight perturbation (p99 6.5e-4;
# log-prob error grows with the logits' scale). The MoE bound is the dense budget plus twice that
# worst TF32 deviation (vLLM's accumulation order differs from the emulation's): 1e-3 + 2 x 1.04e-3.
ATOL = {"tiny-dense": 1e-3, "tiny-moe": 3e-3}


def _recompute(model, prompt, completion, temperature):
    seq = Sequence(tokens=prompt + completion, weights=[1.0] * (len(prompt) + len(completion)))
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, pack_one([seq]).to("cuda"), temperature=temperature)
    return logprobs[len(prompt) - 1 : len(prompt) + len(completion) - 1].cpu()


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None or not torch.cuda.is_available(),
                    reason=REASON or "needs a CUDA GPU (vLLM's CPU build: tests/integration/test_vllm_cpu.py)")
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])  # MoE: vLLM's fused-expert layout
def test_logprobs_match_trainer_and_follow_the_optimizer(preset):
    from rlpipe.engines.vllm_engine import VllmEngine

    tok = build_tokenizer()
    model = build_model(preset, vocab_size=len(tok), seed=0).to("cuda")
    engine = VllmEngine(model, dtype="float32", gpu_memory_utilization=0.2)
    try:
        assert isinstance(engine, Engine)
        prompts = [tok("12+30=", add_special_tokens=False)["input_ids"], [5, 6, 7]]
        params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, seed=0)
        out = engine.generate(prompts, params)
        model.eval()
        for prompt, group in zip(prompts, out, strict=True):
            assert len(group) == 2
            for c in group:
                expected = _recompute(model, prompt, c.tokens, 0.8)
                assert torch.allclose(torch.tensor(c.logprobs), expected, atol=ATOL[preset])
        # an optimizer step changes the weights; sync(None) makes vLLM sample from them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync(None, 1)
        after = engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, greedy=True))[0][0]
        expected = _recompute(model, prompts[0], after.tokens, 1.0)
        assert torch.allclose(torch.tensor(after.logprobs), expected, atol=ATOL[preset])
        assert engine.policy_version == 1
    finally:
        engine.close()
    # closed, vLLM's sleep-mode pool is empty: the next preset's engine can load its weights
    # (vLLM asserts it; "CuMem allocator can only be used for one instance per process")
    from rlpipe.engines.vllm_lifecycle import cumem_pool_bytes

    assert cumem_pool_bytes() == 0
