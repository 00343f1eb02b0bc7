"""Presets, checkpoint loading and autocast: the shapes we promise and the errors we raise."""

from __future__ import annotations

import json

import pytest
import torch
from rlpipe.models.attention import VARLEN_ATTENTION, packed_logits
from rlpipe.models.loading import autocast_context, load_model
from rlpipe.models.presets import PRESETS, build_config, build_model
from rlpipe.training.batch import Sequence, pack

VOCAB = 50


def test_every_preset_builds_with_varlen_attention_and_no_cache():
    for name in PRESETS:
        config = build_config(name, VOCAB, pad_token_id=0, eos_token_id=0)
        assert config.vocab_size == VOCAB and config.use_cache is False
        assert config._attn_implementation == VARLEN_ATTENTION
        assert config.pad_token_id == 0 and config.eos_token_id == 0
        assert config.num_attention_heads % config.num_key_value_heads == 0  # GQA


# Qwen's published sizes at the 151,936-token vocabulary: (total, without embeddings), billions
QWEN3_PUBLISHED = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
                   "qwen3-8b": (8.2, 6.95)}


@pytest.mark.parametrize("name", sorted(QWEN3_PUBLISHED))
def test_qwen3_shaped_presets_have_the_published_parameter_counts(name):
    """Built on the meta device (no memory, no init): the counts Qwen publishes for each shape."""
    from transformers import Qwen3ForCausalLM

    config = build_config(name, 151_936)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head is the embedding: counted once
    heads = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    embeddings = sum(w.numel() for w in heads.values())
    want_total, want_body = QWEN3_PUBLISHED[name]
    assert total / 1e9 == pytest.approx(want_total, abs=0.05), total
    assert (total - embeddings) / 1e9 == pytest.approx(want_body, abs=0.01 if name == "qwen3-8b" else 0.05)
    assert config.tie_word_embeddings is (name != "qwen3-8b")
    assert config.rope_parameters["rope_theta"] == 1_000_000.0


def test_moe_preset_is_qwen3_moe_shaped():
    config = build_config("tiny-moe", VOCAB)
    assert config.model_type == "qwen3_moe"
    assert config.num_experts >= 8 and config.num_experts_per_tok == 2
    assert config.output_router_logits and config.router_aux_loss_coef > 0


def test_build_model_is_deterministic_and_tied():
    a = build_model("tiny-dense", VOCAB, seed=3)
    b = build_model("tiny-dense", VOCAB, seed=3)
    c = build_model("tiny-dense", VOCAB, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    assert a.training
    assert a.config.use_cache is False and a.generation_config.use_cache is True


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny-dense", VOCAB, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_build_model_dtype_and_overrides():
    model = build_model("tiny-dense", VOCAB, dtype=torch.bfloat16, num_hidden_layers=1)
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*tiny-dense"):
        build_model("huge", VOCAB)


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match="hiden_size"):
        build_config("tiny-dense", VOCAB, hiden_size=64)


def test_save_and_load_round_trip(tmp_path):
    model = build_model("tiny-moe", VOCAB, seed=1).eval()
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config._attn_implementation == VARLEN_ATTENTION
    assert loaded.config.use_cache is False and loaded.training
    loaded.eval()
    (batch,) = pack([Sequence(tokens=[1, 2, 3, 4], weights=[1.0] * 4)], token_budget=8)
    with torch.no_grad():
        assert torch.allclose(packed_logits(model, batch), packed_logits(loaded, batch))


def test_load_model_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    build_model("tiny-dense", VOCAB).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_model(tmp_path)
    weights.write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match=r"corrupt or truncated weights file .*model\.safetensors"):
        load_model(tmp_path)
    weights.unlink()
    with pytest.raises(ValueError, match="has no weights"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path)


def test_loads_a_foreign_llama_checkpoint(tmp_path):
    """A user's Llama-like checkpoint gets our attention and still packs exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    model = load_model(tmp_path).eval()
    seqs = [Sequence(tokens=[3, 4, 5, 6, 7], weights=[1.0] * 5), Sequence(tokens=[8, 9, 10], weights=[1.0] * 3)]
    (batch,) = pack(seqs, token_budget=16)
    with torch.no_grad():
        packed = packed_logits(model, batch)
        alone = model(input_ids=torch.tensor([[8, 9, 10]])).logits[0]
    assert (packed[5:] - alone).abs().max().item() <= 1e-4


def test_autocast_context():
    x = torch.randn(4, 4)
    with autocast_context("cpu", enabled=False):
        assert (x @ x).dtype == torch.float32
    with autocast_context("cpu", enabled=True):
        # bf16 where this CPU supports it, fp32 (with a warning) where it does not
        assert (x @ x).dtype in (torch.bfloat16, torch.float32)
