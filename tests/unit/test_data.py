"""Data sources: assistant masks line up with labels after the shift; bad data fails by name."""

from __future__ import annotations

import copy

import pytest
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.batch import pack
from rlpipe.training.data import batches_for_step, pretrain_sequences, sft_sequences


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _weighted_label_text(tokenizer, seq) -> str:
    """Decode the labels that carry weight after packing (the shift happens in pack)."""
    (batch,) = pack([seq], token_budget=len(seq.tokens))
    ids = batch.labels[batch.token_weights != 0].tolist()
    return tokenizer.decode(ids, skip_special_tokens=False)


CHAT = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2 (easy)"},
]


def test_only_assistant_tokens_carry_weight_after_shift(tokenizer):
    (seq,) = sft_sequences([CHAT[:3]], tokenizer, max_len=200)
    assert _weighted_label_text(tokenizer, seq) == "42<|im_end|>"
    assert seq.tokens == tokenizer.apply_chat_template(CHAT[:3], return_dict=False)
    # The weights are exactly 0/1 and the prompt is untouched.
    assert set(seq.weights) == {0.0, 1.0}
    prompt = tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_dict=False)
    assert not any(seq.weights[: len(prompt)])


def test_multi_turn_weights_every_assistant_turn(tokenizer):
    (seq,) = sft_sequences([CHAT], tokenizer, max_len=200)
    assert _weighted_label_text(tokenizer, seq) == "42<|im_end|>2 (easy)<|im_end|>"


def test_matches_transformers_generation_mask(tokenizer):
    # Our template marks assistant spans with {% generation %}; both routes must agree.
    out = tokenizer.apply_chat_template(CHAT, return_assistant_tokens_mask=True, return_dict=True)
    (seq,) = sft_sequences([CHAT], tokenizer, max_len=200)
    assert [float(x) for x in out["assistant_masks"]] == seq.weights


def test_prefix_unstable_template_is_rejected(tokenizer):
    bad = copy.deepcopy(tokenizer)
    # Renders the number of messages first: every new message rewrites the beginning.
    bad.chat_template = "{{ messages|length }}" + tokenizer.chat_template
    with pytest.raises(ValueError, match="conversation 0: the chat template is not prefix-stable"):
        sft_sequences([CHAT], bad, max_len=200)


def test_overlong_conversation(tokenizer):
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    long = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 50}]
    with pytest.raises(ValueError, match="conversation 1 has .* tokens, more than max_len=60"):
        sft_sequences([short, long], tokenizer, max_len=60)
    assert len(sft_sequences([short, long], tokenizer, max_len=60, overflow="drop")) == 1
    kept = sft_sequences([short, long], tokenizer, max_len=80, overflow="truncate")
    assert len(kept) == 2 and len(kept[1].tokens) == 80 and any(kept[1].weights)


def test_empty_inputs_error(tokenizer):
    with pytest.raises(ValueError, match="empty dataset"):
        sft_sequences([], tokenizer, max_len=10)
    with pytest.raises(ValueError, match="no conversation left"):
        sft_sequences([[{"role": "user", "content": "hi"}]], tokenizer, max_len=100)
    with pytest.raises(ValueError, match="empty dataset"):
        pretrain_sequences([[], []], seq_len=8)
    with pytest.raises(ValueError, match="no sequences"):
        batches_for_step([], token_budget=8)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        sft_sequences([[{"content": "hi"}]], tokenizer, max_len=100)


def test_pretrain_pack_and_split():
    docs = [list(range(10)), list(range(100, 105)), [7]]
    packed = pretrain_sequences(docs, seq_len=4, mode="pack")
    assert [s.tokens for s in packed] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 100, 101], [102, 103, 104, 7],
    ]
    split = pretrain_sequences(docs, seq_len=4, mode="split")
    assert [s.tokens for s in split] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [100, 101, 102, 103],
    ]  # [104] and [7] have nothing to predict
    assert all(w == 1.0 for s in packed + split for w in s.weights)
    with pytest.raises(ValueError, match="mode"):
        pretrain_sequences(docs, seq_len=4, mode="stream")


def test_batches_for_step_respects_budget(tokenizer):
    seqs = pretrain_sequences([list(range(50))], seq_len=8)
    batches = batches_for_step(seqs, token_budget=16)
    assert all(b.n_tokens <= 16 for b in batches)
    assert sum(b.n_tokens for b in batches) == 50
    with pytest.raises(ValueError, match="more than token_budget"):
        batches_for_step(seqs, token_budget=4)
