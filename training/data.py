"""Data sources for pretraining and SFT, as `Sequence` records ready for `pack`.

- `pretrain_sequences`: token documents → windows of at most seq_len tokens, weight 1.
- `sft_sequences`: chat conversations → chat-template tokens with the assistant mask as weights,
  found by incremental chat-template tokenisation (models/chat.py), so the mask is exactly what
  the template renders, whatever the template. Templates that are not prefix-stable (Qwen3 drops
  earlier `<think>` blocks) give one sequence per context the template renders, sharing their
  common prefix in packing.
- `batches_for_step`: the micro-batches of one optimizer step.

Index convention (training/batch.py): weights[i] is the weight of the loss on predicting
tokens[i]; `pack` shifts it onto labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import Any, Literal

from rlpipe.models.chat import chat_segments, shared_prefix_len
from rlpipe.training.batch import PackedBatch, Sequence, pack
from transformers import PreTrainedTokenizerBase

Overflow = Literal["error", "truncate", "drop"]


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


def sft_sequences(
    conversations: SequenceABC[list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    overflow: Overflow = "error",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Sequence]:
    """Chat conversations ([{role, content}, ...] each) → sequences weighted by the assistant mask.

    One sequence per conversation when its template is prefix-stable; otherwise one per context the
    template renders for its assistant turns (models/chat.py), sharing their common prefix.
    A sequence longer than max_len tokens raises ValueError naming it (overflow="error"),
    is cut to max_len ("truncate"), or is left out ("drop"). A conversation whose assistant
    tokens are all cut or absent is left out. Raises ValueError if nothing remains.
    `template_kwargs` (model.chat_template_kwargs) reach every rendering (models/chat.py).
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2; got {max_len}")
    if overflow not in ("error", "truncate", "drop"):
        raise ValueError(f"unknown overflow policy {overflow!r}; expected error, truncate or drop")
    if len(conversations) == 0:
        raise ValueError("sft_sequences: no conversations (empty dataset)")
    out: list[Sequence] = []
    for c, messages in enumerate(conversations):
        pieces = []
        segments = chat_segments(tokenizer, list(messages), conv=c, template_kwargs=template_kwargs)
        for segment in segments:
            tokens, weights = segment.tokens, segment.weights
            if len(tokens) > max_len:
                if overflow == "error":
                    where = f" (context of assistant message {segment.turns[0]})" if len(segments) > 1 else ""
                    raise ValueError(
                        f"conversation {c} has {len(tokens)} tokens{where}, more than max_len={max_len} "
                        "(use overflow='truncate' or 'drop')"
                    )
                if overflow == "drop":
                    continue
                tokens, weights = tokens[:max_len], weights[:max_len]
            if any(weights[1:]):
                pieces.append((tokens, weights))
        # the segments of one conversation repeat its opening: packing holds it once
        prefix = shared_prefix_len([t for t, _ in pieces], [w for _, w in pieces])
        out += [Sequence(tokens=t, weights=w, prefix_len=prefix) for t, w in pieces]
    if not out:
        raise ValueError("sft_sequences: no conversation left with assistant tokens to train on")
    return out


def batches_for_step(sequences: SequenceABC[Sequence], token_budget: int) -> list[PackedBatch]:
    """The micro-batches (at most token_budget tokens each) of one optimizer step."""
    if len(sequences) == 0:
        raise ValueError("batches_for_step: no sequences for this step")
    return pack(sequences, token_budget)
