"""Chat conversations → training segments, for any chat template, prefix-stable or not.

Incremental tokenisation (messages[:1], [:2], ...) finds what each assistant message adds, so the
assistant mask is exactly what the template renders. Some templates are not prefix-stable: Qwen3
drops the `<think>` block of an assistant turn once a later user message exists, so the rendering
of turn 1 inside the whole conversation differs from the one the model saw when it wrote turn 1.

Each assistant turn is therefore trained in the context the template renders *for it*:
`template(messages[:i], add_generation_prompt=True)` followed by what `template(messages[:i+1])`
adds. Consecutive turns whose contexts extend one another share one segment (a prefix-stable
template gives one segment per conversation, as before); where a context rewrites earlier tokens,
a new segment starts. Segments of one conversation share their common leading tokens through the
packer's shared-prefix layout (`Sequence.prefix_len`, training/batch.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class ChatSegment:
    """One training sequence of a conversation.

    tokens:  the template's rendering of the segment's context and assistant turns
    weights: 1 on the tokens its assistant turns add (content through the end-of-turn token)
    turns:   indices (into the messages) of the assistant messages trained in this segment
    """

    tokens: list[int]
    weights: list[float]
    turns: tuple[int, ...]


def template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False,
    **template_kwargs,
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False,
        **template_kwargs,
    )
    if isinstance(ids, Mapping):  # older/newer transformers may still return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id of `<|im_end|>`, else the EOS id (None when neither exists)."""
    return tokenizer.get_vocab().get(END_OF_TURN, tokenizer.eos_token_id)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: B905


def _check_messages(messages: list[dict], conv: int) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"conversation {conv}, message {i}: need a dict with 'role' and 'content'")


def chat_segments(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], conv: int = 0
) -> list[ChatSegment]:
    """The segments of one conversation (see the module docstring), in turn order.

    Raises ValueError when an assistant turn's own rendering does not start with its generation
    prompt (the template, or a tokenizer merge across the header, rewrites the header): no
    context exists in which that turn's tokens were produced.
    """
    messages = list(messages)
    _check_messages(messages, conv)
    end_id = end_of_turn_id(tokenizer)
    segments: list[ChatSegment] = []
    tokens: list[int] = []
    weights: list[float] = []
    turns: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(f"conversation {conv}: message 0 is an assistant message; "
                             "an assistant turn needs a context to answer")
        header = template_ids(tokenizer, messages[:i], add_generation_prompt=True)
        ids = template_ids(tokenizer, messages[: i + 1])
        if ids[: len(header)] != header:
            raise ValueError(
                f"conversation {conv}: the chat template is not prefix-stable (assistant message {i} "
                f"changes the tokens before it, first at position {_first_difference(header, ids)}); "
                "its generation prompt is not a prefix of its own rendering"
            )
        if header[: len(tokens)] != tokens:  # the context rewrites earlier tokens: a new segment
            segments.append(ChatSegment(tokens, weights, tuple(turns)))
            tokens, weights, turns = [], [], []
        added = ids[len(header):]
        body = len(added)
        if end_id is not None and end_id in added:
            body = added.index(end_id) + 1  # train on the end-of-turn token, not after it
        weights = weights + [0.0] * (len(header) - len(tokens)) + [1.0] * body + [0.0] * (len(added) - body)
        tokens = ids
        turns.append(i)
    if messages:
        whole = template_ids(tokenizer, messages)
        if whole[: len(tokens)] == tokens:  # keep trailing messages where they do not disturb
            weights = weights + [0.0] * (len(whole) - len(tokens))
            tokens = whole
    segments.append(ChatSegment(tokens, weights, tuple(turns)))
    return segments


def shared_prefix_len(token_lists: list[list[int]], weight_lists: list[list[float]]) -> int:
    """Leading tokens common to all sequences and weightless in each (for `Sequence.prefix_len`)."""
    if len(token_lists) < 2:
        return 0
    first = token_lists[0]
    n = min(len(t) for t in token_lists)
    for other in token_lists[1:]:
        n = min(n, _first_difference(first, other))
    for weights in weight_lists:
        weighted = next((i for i, w in enumerate(weights) if i >= 1 and w != 0), len(weights))
        n = min(n, weighted)
    return n if n > 1 else 0
