"""TorchEngine: log-probs equal the trainer's recomputation, sampling rules, batching, sharing."""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines import qwen3_fast, qwen3_support
from rlpipe.engines.base import Completion, Engine, SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 96


def _sharpen(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Scale the (untied) lm_head so next-token distributions are peaked, like a trained model."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model.eval()


def dense_model(scale: float = 8.0) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    return _sharpen(Qwen3ForCausalLM(cfg), scale)


def moe_model(scale: float = 8.0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return _sharpen(Qwen3MoeForCausalLM(cfg), scale)


def llama_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return _sharpen(LlamaForCausalLM(cfg), 8.0)


MODELS = {"dense": dense_model, "moe": moe_model}


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def recompute_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """What the trainer does: one plain forward of prompt + completion. -> [len(tokens), V]
    (row i: the logits that predicted tokens[i])."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def recompute_logprobs(model, prompt, completion: Completion, temperature: float) -> torch.Tensor:
    logits = recompute_logits(model, prompt, completion.tokens)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(completion.tokens)[:, None]).squeeze(1)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fast_forward_logits_match_hf_forward(kind):
    model = MODELS[kind]()
    assert qwen3_support.unsupported_reason(model) is None
    lengths = [3, 8, 5]
    prompts = prompts_of(lengths)
    extra = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        w = qwen3_fast.QwenWeights.from_model(model)
        rope = qwen3_fast.rope_tables(w, 16)
        width = max(lengths)
        tokens = torch.zeros(3, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p) :] = torch.tensor(p)
        cache = qwen3_fast.KVCache.empty(w, 3, 16)
        steps = [
            qwen3_fast.prefill(w, tokens, torch.tensor([width - n for n in lengths]), cache, rope)
        ]
        for t in range(4):
            positions = torch.tensor(lengths) + t
            steps.append(qwen3_fast.decode(w, extra[:, t], cache, rope, positions))
    for i, p in enumerate(prompts):
        ref = recompute_logits(model, p, extra[i].tolist() + [0])
        got = torch.stack([s[i] for s in steps])
        assert (ref - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logprobs_match_full_forward_recomputation(kind, temperature):
    model = MODELS[kind](scale=2.0)
    engine = TorchEngine(model)
    prompts = prompts_of([4, 9, 6])
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=3)
    out = engine.generate(prompts, params)
    assert [len(group) for group in out] == [3, 3, 3]
    worst = 0.0
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            assert len(c.tokens) == len(c.logprobs) == 12 and c.finish_reason == "length"
            ref = recompute_logprobs(model, prompt, c, temperature)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= 1e-4


def test_hf_fallback_for_other_architectures_matches_recomputation():
    model = llama_model()
    engine = TorchEngine(model)
    assert engine.fast_path_reason is not None
    prompts = prompts_of([3, 7])
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=0))
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            ref = recompute_logprobs(model, prompt, c, 1.0)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8))
    assert greedy[0][0].tokens == _hf_greedy(model, prompts[0], 8)


def _kept_sets(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> list[set[int]]:
    """Reference truncation, position by position: k most likely, then the shortest
    most-likely-first prefix of the renormalised rest whose mass reaches top_p."""
    kept = []
    for row in torch.softmax(logits / temperature, dim=-1).tolist():
        order = sorted(range(len(row)), key=lambda i: -row[i])
        if top_k:
            order = order[:top_k]
        total = sum(row[i] for i in order)
        chosen, mass = [], 0.0
        for i in order:
            chosen.append(i)
            mass += row[i] / total
            if mass >= top_p:
                break
        kept.append(set(chosen))
    return kept


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(5, 1.0, 1.0), (0, 0.6, 1.0), (8, 0.8, 0.7), (1, 1.0, 1.0)]
)
def test_top_k_top_p_never_sample_outside_the_kept_set(top_k, top_p, temperature):
    model = dense_model(scale=1.5)  # flat enough that truncation bites
    engine = TorchEngine(model)
    prompts = prompts_of([5, 3])
    params = SamplingParams(
        n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=0
    )
    out = engine.generate(prompts, params)
    smallest = VOCAB
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            logits = recompute_logits(model, prompt, c.tokens)
            kept = _kept_sets(logits, temperature, top_k, top_p)
            for t, token in enumerate(c.tokens):
                assert token in kept[t]
                smallest = min(smallest, len(kept[t]))
            # reported log-probs stay those of the untruncated tempered distribution
            ref = recompute_logprobs(model, prompt, c, temperature)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4
    assert smallest < VOCAB  # the truncation actually excluded tokens


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_equals_hf_greedy(kind):
    model = MODELS[kind]()
    engine = TorchEngine(model)
    prompts = prompts_of([6, 2])
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10, temperature=0.5))
    for prompt, group in zip(prompts, out, strict=True):
        c = group[0]
        assert c.tokens == _hf_greedy(model, prompt, 10)
        # greedy log-probs are at temperature 1, whatever params.temperature says
        ref = recompute_logprobs(model, prompt, c, 1.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4


def test_stop_tokens_end_sequences_and_length_otherwise():
    model = dense_model(scale=1.0)
    engine = TorchEngine(model)
    stops = tuple(range(0, VOCAB, 6))  # ~1/6 of the vocabulary
    params = SamplingParams(n=8, max_new_tokens=12, stop_token_ids=stops, seed=5)
    out = engine.generate(prompts_of([4, 7, 5]), params)
    reasons = {c.finish_reason for group in out for c in group}
    assert reasons == {"stop", "length"}
    for group in out:
        for c in group:
            early = [t for t in c.tokens[:-1] if t in stops]
            assert early == []
            if c.finish_reason == "stop":
                assert c.tokens[-1] in stops and len(c.tokens) <= 12
            else:
                assert len(c.tokens) == 12 and c.tokens[-1] not in stops


def test_same_seed_same_output_different_seed_different():
    engine = TorchEngine(dense_model(scale=1.0))
    prompts = prompts_of([5, 3, 8])
    run = lambda seed: engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, seed=seed))  # noqa: E731
    first, again, other = run(11), run(11), run(12)
    assert first == again
    assert [c.tokens for g in first for c in g] != [c.tokens for g in other for c in g]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batched_prompts_of_different_lengths_equal_one_at_a_time(kind):
    model = MODELS[kind]()
    engine = TorchEngine(model, max_batch_size=4)  # two batches, compaction on stop tokens
    prompts = prompts_of([2, 9, 5, 11, 3, 7])
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
    stop = (greedy[0][0].tokens[3], greedy[3][0].tokens[1])
    params = SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=stop)
    batched = engine.generate(prompts, params)
    assert {c.finish_reason for g in batched for c in g} == {"stop", "length"}
    for prompt, group in zip(prompts, batched, strict=True):
        alone = engine.generate([prompt], params)[0][0]
        assert group[0].tokens == alone.tokens
        assert group[0].finish_reason == alone.finish_reason
        assert torch.allclose(
            torch.tensor(group[0].logprobs), torch.tensor(alone.logprobs), atol=1e-5
        )


def test_engine_reads_the_live_parameters_without_sync():
    model = dense_model(scale=2.0)
    engine = TorchEngine(model)
    prompts = prompts_of([4, 6])
    params = SamplingParams(greedy=True, max_new_tokens=8)
    before = engine.generate(prompts, params)
    with torch.no_grad():  # what an optimizer step does: in-place update of the same tensors
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    after = engine.generate(prompts, params)
    assert engine.policy_version == 0
    assert [g[0].tokens for g in before] != [g[0].tokens for g in after]
    for prompt, group in zip(prompts, after, strict=True):
        assert group[0].tokens == _hf_greedy(model, prompt, 8)
    engine.sync(None, 1)
    assert engine.policy_version == 1


def test_sync_from_checkpoint_path_loads_weights_in_place(tmp_path):
    model = dense_model()
    other = dense_model(scale=-1.0)
    other.save_pretrained(tmp_path)
    engine = TorchEngine(model)
    weight = model.lm_head.weight
    engine.sync(str(tmp_path), 7)
    assert engine.policy_version == 7
    assert model.lm_head.weight is weight and torch.equal(weight, other.lm_head.weight)
    with pytest.raises(ValueError, match="checkpoint_path"):
        engine.sync(str(tmp_path / "missing"), 8)


def test_engine_protocol_and_closing():
    engine = TorchEngine(dense_model())
    assert isinstance(engine, Engine)
    engine.close()
    with pytest.raises(RuntimeError):
        engine.generate([[1, 2]], SamplingParams())


def test_bad_prompts_raise_value_error():
    engine = TorchEngine(dense_model())
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        engine.generate([[VOCAB]], SamplingParams())


def test_bf16_engine_runs_on_fp32_weights_with_close_logprobs():
    model = dense_model(scale=2.0)
    engine = TorchEngine(model, dtype=torch.bfloat16)
    prompts = prompts_of([5, 8])
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert next(model.parameters()).dtype == torch.float32  # the trainer's weights are untouched
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            ref = recompute_logprobs(model, prompt, c, 1.0)
            assert (ref - torch.tensor(c.logprobs)).abs().mean().item() < 0.05


def test_preset_models_with_packed_attention_config():
    # the project's own module: an import error fails, never skips
    from rlpipe.models import presets

    for name in ("tiny-dense", "tiny-moe"):
        model = presets.build_model(name, vocab_size=VOCAB)  # train mode, varlen attention
        engine = TorchEngine(model)
        assert engine.fast_path_reason is None
        prompt = prompts_of([6])[0]
        c = engine.generate([prompt], SamplingParams(max_new_tokens=6, seed=1))[0][0]
        assert model.training  # generate restores the mode
        model.eval()
        ref = recompute_logprobs(model, prompt, c, 1.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4


def test_stop_token_sampled_at_the_last_step_is_a_stop():
    engine = TorchEngine(dense_model())
    prompts = prompts_of([4, 6, 3])
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6))
    last = next(g[0].tokens[-1] for g in greedy if g[0].tokens[-1] not in g[0].tokens[:-1])
    out = engine.generate(
        prompts, SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=(last,))
    )
    for before, after in zip(greedy, out, strict=True):
        if last in before[0].tokens:
            cut = before[0].tokens.index(last) + 1
            assert after[0].tokens == before[0].tokens[:cut] and after[0].finish_reason == "stop"
        else:
            assert after[0].tokens == before[0].tokens and after[0].finish_reason == "length"


def test_a_cancelled_generation_stops_between_decode_steps():
    from rlpipe.engines.decode_loop import GenerationCancelled

    engine = TorchEngine(dense_model())
    params = SamplingParams(n=2, max_new_tokens=50, seed=1)
    asked: list[int] = []

    def cancelled() -> bool:  # True from the fourth decode step on
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(GenerationCancelled, match="after 3 of 50 tokens"):
        engine.generate([[1, 2, 3]], params, cancelled=cancelled)
    assert len(asked) == 4
    # never cancelled: the same completions as without the hook, and the engine still serves
    plain = engine.generate([[1, 2, 3]], params)
    assert engine.generate([[1, 2, 3]], params, cancelled=lambda: False) == plain
