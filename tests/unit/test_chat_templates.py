"""SFT on chat templates that are not prefix-stable (Qwen3 drops earlier <think> blocks).

Byte-level BPE tokenizer built here with Qwen3's chat template (tests/bpe_tokenizer.py). Cases:
1. thinking in two assistant turns, inline `<think>` (refused before; now one sequence per context)
2. the same with `reasoning_content` fields
3. plain answers (the last turn gets an empty think block, dropped once a user follows)
4. a tool-call chain after one user query (thinking kept: one sequence)
5. parallel tool responses (their rendering changes between them, not before an assistant turn)
5b. a tool call without thinking: its empty think block is dropped once the tool answers (split)
6. our own prefix-stable ChatML template on the BPE tokenizer (one sequence, = transformers' mask)
7. a template that rewrites an assistant turn's own header: still refused, by name
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.models.chat import chat_segments, template_ids
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import CHAT_TEMPLATE
from rlpipe.training.batch import pack
from rlpipe.training.data import sft_sequences
from rlpipe.training.logprobs import token_logprobs

from tests.bpe_tokenizer import build_qwen3_like_tokenizer


@pytest.fixture(scope="module")
def qwen3():
    return build_qwen3_like_tokenizer()


def _weighted(tok, seq) -> str:
    return tok.decode([t for t, w in zip(seq.tokens, seq.weights, strict=True) if w],
                      skip_special_tokens=False)


SYSTEM = {"role": "system", "content": "You add."}
THINKING = [
    SYSTEM,
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "<think>\nadd the tens\n</think>\n\n42"},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "<think>\nones\n</think>\n\n2"},
]


def test_thinking_in_two_turns_trains_each_turn_in_its_own_context(qwen3):
    first, second = sft_sequences([THINKING], qwen3, max_len=400)
    # turn 1 with its thinking, in the context it was written in
    assert first.tokens == template_ids(qwen3, THINKING[:3])
    assert _weighted(qwen3, first) == "<think>\nadd the tens\n</think>\n\n42<|im_end|>"
    # turn 2 in the whole conversation's rendering, where turn 1 lost its thinking (weight 0)
    assert second.tokens == template_ids(qwen3, THINKING)
    assert "add the tens" not in qwen3.decode(second.tokens)
    assert _weighted(qwen3, second) == "<think>\nones\n</think>\n\n2<|im_end|>"
    # each turn's context is exactly the generation prompt the template renders for it
    for seq, i in ((first, 2), (second, 4)):
        header = template_ids(qwen3, THINKING[:i], add_generation_prompt=True)
        assert seq.tokens[: len(header)] == header and not any(seq.weights[: len(header)])
    # the shared opening (system, user, assistant header) is declared and packed once
    opening = template_ids(qwen3, THINKING[:2], add_generation_prompt=True)
    assert first.prefix_len == second.prefix_len == len(opening)
    (batch,) = pack([first, second], token_budget=400)
    assert batch.prefix_index is not None
    assert batch.n_tokens == len(first.tokens) + len(second.tokens) - (len(opening) - 1)


def test_shared_layout_gives_the_unshared_logprobs(qwen3):
    seqs = sft_sequences([THINKING], qwen3, max_len=400)
    model = build_model("tiny-dense", len(qwen3), seed=0, pad_token_id=0, eos_token_id=2).eval()
    (shared,) = pack(seqs, token_budget=400)
    (plain,) = pack(seqs, token_budget=400, share_prefixes=False)
    with torch.no_grad():
        a = token_logprobs(model, shared)[0][shared.token_weights != 0]
        b = token_logprobs(model, plain)[0][plain.token_weights != 0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_reasoning_content_field(qwen3):
    chat = [
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": "3+3="},
        {"role": "assistant", "content": "6", "reasoning_content": "three and three"},
    ]
    first, second = sft_sequences([chat], qwen3, max_len=400)
    assert _weighted(qwen3, first) == "<think>\ntwo and two\n</think>\n\n4<|im_end|>"
    assert _weighted(qwen3, second) == "<think>\nthree and three\n</think>\n\n6<|im_end|>"


def test_plain_answers_split_where_the_empty_think_block_is_dropped(qwen3):
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    first, second = sft_sequences([chat], qwen3, max_len=400)
    assert _weighted(qwen3, first) == "<think>\n\n</think>\n\n3<|im_end|>"
    assert _weighted(qwen3, second) == "<think>\n\n</think>\n\n4<|im_end|>"
    assert "<|im_start|>assistant\n3<|im_end|>" in qwen3.decode(second.tokens)


def test_tool_call_chain_is_one_sequence_with_thinking_kept(qwen3):
    chat = [
        {"role": "user", "content": "What is 12+30? Use the calculator."},
        {"role": "assistant", "content": "<think>\ncall it\n</think>\n\n",
         "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "12+30"}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "<think>\nread it\n</think>\n\nThe answer is 42."},
    ]
    (seq,) = sft_sequences([chat], qwen3, max_len=400)
    assert seq.tokens == template_ids(qwen3, chat)
    text = _weighted(qwen3, seq)
    assert text.startswith("<think>\ncall it\n</think>\n\n<tool_call>\n{\"name\": \"calculator\"")
    assert text.endswith("<think>\nread it\n</think>\n\nThe answer is 42.<|im_end|>")
    assert "<tool_response>" not in text  # the tool's turn is context, weight 0


def test_parallel_tool_responses_do_not_split(qwen3):
    call = {"function": {"name": "calculator", "arguments": {"expression": "1+1"}}}
    chat = [
        {"role": "user", "content": "1+1 and 2+2?"},
        {"role": "assistant", "content": "<think>\nsplit it\n</think>\n\n", "tool_calls": [call, call]},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "2 and 4"},
    ]
    # rendering messages[:3] closes the tool turn that the 4th message extends: not prefix-stable
    assert template_ids(qwen3, chat[:4])[: len(template_ids(qwen3, chat[:3]))] != template_ids(qwen3, chat[:3])
    segments = chat_segments(qwen3, chat)
    assert len(segments) == 1 and segments[0].turns == (1, 4)


def test_tool_call_without_thinking_splits(qwen3):
    call = {"function": {"name": "calculator", "arguments": {"expression": "1+1"}}}
    chat = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]
    first, second = chat_segments(qwen3, chat)
    assert (first.turns, second.turns) == ((1,), (3,))
    assert qwen3.decode(first.tokens).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>"
                                               "\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
                                               "\"1+1\"}}\n</tool_call><|im_end|>\n")


def test_prefix_stable_template_on_bpe_is_one_sequence_matching_transformers(qwen3):
    tok = build_qwen3_like_tokenizer(chat_template=CHAT_TEMPLATE)
    chat = [m for m in THINKING]
    (seq,) = sft_sequences([chat], tok, max_len=400)
    mask = tok.apply_chat_template(chat, return_assistant_tokens_mask=True, return_dict=True)
    assert [float(x) for x in mask["assistant_masks"]] == seq.weights
    assert seq.prefix_len == 0


def test_template_rewriting_an_assistant_header_is_refused(qwen3):
    bad = build_qwen3_like_tokenizer(chat_template="{{ messages|length }}" + CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="conversation 0: .*assistant message 2"):
        sft_sequences([THINKING], bad, max_len=400)


def test_overlong_turn_context_is_named(qwen3):
    with pytest.raises(ValueError, match="conversation 0 has .* tokens \\(context of assistant message 4\\)"):
        sft_sequences([THINKING], qwen3, max_len=45)
    kept = sft_sequences([THINKING], qwen3, max_len=45, overflow="drop")
    assert len(kept) == 1 and kept[0].prefix_len == 0


@pytest.mark.parametrize("trailing", [[], [{"role": "user", "content": "and 2+2?"}]])
def test_a_conversation_is_rendered_whole_once(qwen3, trailing, monkeypatch):
    """Each assistant turn costs two renderings (its context with the generation prompt, and
    through it); the whole conversation a third only where messages follow its last assistant
    turn. Without them, the last segment is the whole rendering."""
    import rlpipe.models.chat as chat

    calls = []
    render = chat.template_ids
    monkeypatch.setattr(chat, "template_ids", lambda tok, messages, *a, **k: calls.append(len(messages)) or
                        render(tok, messages, *a, **k))
    conversation = THINKING + trailing
    segments = chat.chat_segments(qwen3, conversation)
    assert calls == [2, 3, 4, 5] + ([6] if trailing else [])
    if not trailing:
        whole = render(qwen3, conversation)
        assert segments[-1].tokens == whole and len(segments[-1].weights) == len(whole)
