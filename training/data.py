"""Data sources for pretraining and SFT, as `Sequence` records ready for `pack`.

- `pretrain_sequences`: token documents → windows of at most seq_len tokens, weight 1.
- `sft_sequences`: chat conversations → ChatML tokens with the assistant mask as weights,
  found by incremental chat-template tokenisation (messages[:1], [:2], ...), so the mask is
  exactly what the template renders, whatever the template.
- `batches_for_step`: the micro-batches of one optimizer step.

Index convention (training/batch.py): weights[i] is the weight of the loss on predicting
tokens[i]; `pack` shifts it onto labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import Literal

from transformers import PreTrainedTokenizerBase

from training.batch import PackedBatch, Sequence, pack

Overflow = Literal["error", "truncate", "drop"]
END_OF_TURN = "<|im_end|>"


def pretrain_sequences(
    token_docs: SequenceABC[SequenceABC[int]],
    seq_len: int,
    mode: Literal["pack", "split"] = "pack",
) -> list[Sequence]:
    """Documents of token ids → sequences of at most `seq_len` tokens, every weight 1.

    mode "pack": the documents concatenated into one stream and cut into seq_len windows (put an
    end-of-text token at the end of each document yourself); "split": each document cut on its
    own. Pieces of a single token (nothing to predict) are dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2; got {seq_len}")
    if mode not in ("pack", "split"):
        raise ValueError(f"unknown pretrain mode {mode!r}; expected 'pack' or 'split'")
    if not any(len(doc) for doc in token_docs):
        raise ValueError("pretrain_sequences: no tokens (empty dataset)")
    streams = [[t for doc in token_docs for t in doc]] if mode == "pack" else token_docs
    out: list[Sequence] = []
    for stream in streams:
        for start in range(0, len(stream), seq_len):
            piece = list(stream[start : start + seq_len])
            if len(piece) >= 2:
                out.append(Sequence(tokens=piece, weights=[1.0] * len(piece)))
    if not out:
        raise ValueError("pretrain_sequences: every document is shorter than 2 tokens")
    return out


def _template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    if isinstance(ids, Mapping):  # older/newer transformers may still return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _check_prefix(prefix: list[int], ids: list[int], what: str, conv: int) -> None:
    if ids[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), len(ids))  # noqa: B905
        raise ValueError(
            f"conversation {conv}: the chat template is not prefix-stable ({what} changes the "
            f"tokens before it, first at position {at}); cannot derive the assistant mask "
            "by incremental tokenisation"
        )


def chat_tokens_and_weights(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], conv: int = 0
) -> tuple[list[int], list[float]]:
    """ChatML tokens of `messages` and their weights: 1 on the tokens an assistant message adds
    after its header (its content and the end-of-turn token), 0 elsewhere (system/user turns,
    the `<|im_start|>assistant\\n` header, anything after the end-of-turn token)."""
    vocab = tokenizer.get_vocab()
    end_id = vocab.get(END_OF_TURN, tokenizer.eos_token_id)
    tokens: list[int] = []
    weights: list[float] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"conversation {conv}, message {i}: need a dict with 'role' and 'content'")
        ids = _template_ids(tokenizer, list(messages[: i + 1]))
        if message["role"] == "assistant":
            header = _template_ids(tokenizer, list(messages[:i]), add_generation_prompt=True)
            _check_prefix(tokens, header, "the generation prompt", conv)
            _check_prefix(header, ids, f"assistant message {i}", conv)
            added = ids[len(header) :]
            body = len(added)
            if end_id is not None and end_id in added:
                body = added.index(end_id) + 1  # train on the end-of-turn token, not after it
            weights += [0.0] * (len(header) - len(tokens)) + [1.0] * body + [0.0] * (len(added) - body)
        else:
            _check_prefix(tokens, ids, f"message {i} ({message['role']})", conv)
            weights += [0.0] * (len(ids) - len(tokens))
        tokens = ids
    return tokens, weights


def sft_sequences(
    conversations: SequenceABC[list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    overflow: Overflow = "error",
) -> list[Sequence]:
    """Chat conversations ([{role, content}, ...] each) → sequences weighted by the assistant mask.

    A conversation longer than max_len tokens raises ValueError naming it (overflow="error"),
    is cut to max_len ("truncate"), or is left out ("drop"). A conversation whose assistant
    tokens are all cut or absent is left out. Raises ValueError if nothing remains.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2; got {max_len}")
    if overflow not in ("error", "truncate", "drop"):
        raise ValueError(f"unknown overflow policy {overflow!r}; expected error, truncate or drop")
    if len(conversations) == 0:
        raise ValueError("sft_sequences: no conversations (empty dataset)")
    out: list[Sequence] = []
    for c, messages in enumerate(conversations):
        tokens, weights = chat_tokens_and_weights(tokenizer, list(messages), conv=c)
        if len(tokens) > max_len:
            if overflow == "error":
                raise ValueError(
                    f"conversation {c} has {len(tokens)} tokens, more than max_len={max_len} "
                    "(use overflow='truncate' or 'drop')"
                )
            if overflow == "drop":
                continue
            tokens, weights = tokens[:max_len], weights[:max_len]
        if any(weights[1:]):
            out.append(Sequence(tokens=tokens, weights=weights))
    if not out:
        raise ValueError("sft_sequences: no conversation left with assistant tokens to train on")
    return out


def batches_for_step(sequences: SequenceABC[Sequence], token_budget: int) -> list[PackedBatch]:
    """The micro-batches (at most token_budget tokens each) of one optimizer step."""
    if len(sequences) == 0:
        raise ValueError("batches_for_step: no sequences for this step")
    return pack(sequences, token_budget)
