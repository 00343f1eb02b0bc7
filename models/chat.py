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

Every rendering takes the template's extra variables (`model.chat_template_kwargs`, e.g. Qwen3's
`enable_thinking`). A completion's reasoning block and its answer are told apart here too
(`split_thinking_tokens` on token ids, `split_thinking` on text): the answer follows the last
`</think>`, as Qwen3's guide parses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], conv: int = 0,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[ChatSegment]:
    """The segments of one conversation (see the module docstring), in turn order.

    `template_kwargs` (`model.chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) reach every
    rendering, so an assistant turn's context is the generation prompt a sampler sees: what the
    template writes into it (Qwen3's empty `<think>\n\n</think>\n\n` with thinking off) is
    prompt, and the loss starts after it.

    Raises ValueError when an assistant turn's own rendering does not start with its generation
    prompt (the template, or a tokenizer merge across the header, rewrites the header): no
    context exists in which that turn's tokens were produced.
    """
    messages = list(messages)
    _check_messages(messages, conv)
    kwargs = dict(template_kwargs or {})
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
        header = template_ids(tokenizer, messages[:i], add_generation_prompt=True, **kwargs)
        ids = template_ids(tokenizer, messages[: i + 1], **kwargs)
        if ids[: len(header)] != header:
            raise ValueError(
                f"conversation {conv}: the chat template is not prefix-stable (assistant message {i} "
                f"changes the tokens before it, first at position {_first_difference(header, ids)}); "
                "its generation prompt is not a prefix of its own rendering"
                + (f" with model.chat_template_kwargs {kwargs}" if kwargs else "")
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
    if messages and messages[-1]["role"] != "assistant":  # else `tokens` is its whole rendering
        whole = template_ids(tokenizer, messages, **kwargs)
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


THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ThinkTags:
    """The token ids of a template's reasoning block delimiters (Qwen3: `<think>`, `</think>`)."""

    start: int
    end: int


def think_tags(tokenizer: PreTrainedTokenizerBase) -> ThinkTags | None:
    """`<think>` / `</think>` when the vocabulary holds both as single tokens, else None."""
    vocab = tokenizer.get_vocab()
    if THINK_START in vocab and THINK_END in vocab:
        return ThinkTags(vocab[THINK_START], vocab[THINK_END])
    return None


def thinking_open(tokens: list[int], tags: ThinkTags | None) -> bool:
    """Whether `tokens` end inside a reasoning block (a `<think>` after the last `</think>`): a
    generation prompt that opens the block makes the completion start in it."""
    if tags is None:
        return False
    last_start = max((i for i, t in enumerate(tokens) if t == tags.start), default=-1)
    last_end = max((i for i, t in enumerate(tokens) if t == tags.end), default=-1)
    return last_start > last_end


@dataclass(frozen=True)
class ThinkingSplit:
    """A completion's tokens told apart: reasoning (its block, tags included) and answer.

    thinking_tokens: tokens through the completion's last `</think>` (all of them when it ends
                     inside a block it or its prompt opened)
    answer_tokens:   the rest (the whole completion without a reasoning block)
    cut_in_thinking: the completion ends with its reasoning block still open (no answer)
    """

    thinking_tokens: int
    answer_tokens: int
    cut_in_thinking: bool


def split_thinking_tokens(prompt: list[int], completion: list[int], tags: ThinkTags | None) -> ThinkingSplit:
    """Reasoning and answer tokens of `completion`, split as Qwen3's guide parses its output: the
    answer follows the last `</think>`. Without one, a block opened by the prompt (a generation
    prompt ending in `<think>`) or by the completion was cut before its end; else it is all answer."""
    n = len(completion)
    if tags is not None and tags.end in completion:
        start = n - completion[::-1].index(tags.end)
        return ThinkingSplit(start, n - start, False)
    if tags is not None and (thinking_open(prompt, tags) or tags.start in completion):
        return ThinkingSplit(n, 0, True)
    return ThinkingSplit(0, n, False)


def split_thinking(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a completion's text: the answer is what follows the last
    `</think>`, stripped; the reasoning is what comes before it, without the tags. A completion
    whose block never closes (cut inside its thinking) has no answer; one without tags is all answer."""
    if THINK_END in text:
        reasoning, answer = text.rsplit(THINK_END, 1)
        return reasoning.split(THINK_START)[-1].strip(), answer.strip()
    if THINK_START in text:
        return text.split(THINK_START, 1)[1].strip(), ""
    return "", text
