"""What `rlpipe serve` answers, in OpenAI's and vLLM's shapes: a sampled completion cut at its
stop strings, its text pieces, log-probs and top log-probs, and the server-sent events of a
stream. Pure functions over completions and a tokenizer (no HTTP here).

Stop strings: the engine stops on token ids only, so a completion runs to a stop token or
max_tokens and is then cut at the stop string completed first, by the one rule a stream follows
too (engines/stop_strings.py): the text ends before it (with it when
`include_stop_str_in_output`), token ids and log-probs keep the tokens through the one that
completes it, `finish_reason` is "stop" and `stop_reason` the string (vLLM's extension; a
stop_token_ids id that is not the model's EOS likewise, else null).

Streams (`stream: true`) are engines/streaming.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlpipe.engines.access_log import record_usage
from rlpipe.engines.base import Completion
from rlpipe.engines.stop_strings import StopCutter, StopHit


@dataclass(frozen=True)
class Finished:
    """One choice's completion after stop strings: tokens, log-probs, text and reasons."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: str | int | None = None


def finish(completion: Completion, tokenizer: Any, stops: tuple[str, ...], eos_ids: tuple[int, ...],
           *, skip_special_tokens: bool = True, include_stop: bool = False) -> Finished:
    """`completion` cut at the first of `stops` completed in its text, by the rule a stream
    follows token by token (engines/stop_strings.py): the text is the incremental decoding a
    stream sends, with or without stop strings."""
    tokens, logprobs = list(completion.tokens), list(completion.logprobs)
    cutter = StopCutter(tokenizer, stops, skip_special_tokens, include_stop)
    for token in tokens:
        cutter.add(token)
        if cutter.hit is not None:
            break
    else:
        cutter.close()
    if cutter.hit is not None:
        return stopped(cutter.hit, tokens, logprobs)
    return unstopped(completion.finish_reason, tokens, logprobs, cutter.text, eos_ids)


def finish_all(completions: list[Completion], tokenizer: Any, stops: tuple[str, ...], eos_ids: tuple[int, ...],
               *, skip_special_tokens: bool = True, include_stop: bool = False) -> list[Finished]:
    """`finish` of each completion (a server runs this off its event loop: the incremental
    decoding costs two short decodes a token)."""
    return [finish(c, tokenizer, stops, eos_ids, skip_special_tokens=skip_special_tokens, include_stop=include_stop)
            for c in completions]


def stopped(hit: StopHit, tokens: list[int], logprobs: list[float]) -> Finished:
    """A completion a stop string ended (`hit`): the tokens it keeps, its text, the string."""
    return Finished(tokens[:hit.keep], logprobs[:hit.keep], hit.text, "stop", hit.stop)


def unstopped(finish_reason: str, tokens: list[int], logprobs: list[float], text: str,
           eos_ids: tuple[int, ...]) -> Finished:
    """A completion no stop string ended: its engine's reason, and vLLM's stop_reason (a stop
    token that is not the model's EOS, else null)."""
    stop_reason = None
    if finish_reason == "stop" and tokens and tokens[-1] not in eos_ids:
        stop_reason = tokens[-1]
    return Finished(tokens, logprobs, text, finish_reason, stop_reason)


def text_pieces(tokens: list[int], text: str, tokenizer: Any, skip: bool) -> list[str]:
    """One piece of `text` per token, in order, adding up to `text` exactly (each token's piece is
    what its decoded prefix adds; the last piece takes any rest)."""
    pieces, done = [], 0
    for k in range(1, len(tokens) + 1):
        if k == len(tokens):
            upto = len(text)
        else:
            upto = min(len(tokenizer.decode(tokens[:k], skip_special_tokens=skip)), len(text))
        upto = max(upto, done)
        pieces.append(text[done:upto])
        done = upto
    return pieces


def token_strings(tokens: list[int], tokenizer: Any, as_ids: bool) -> list[str]:
    """Each token as its own text (special tokens shown), or "token_id:<id>" when `as_ids`."""
    if as_ids:
        return [f"token_id:{t}" for t in tokens]
    return [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]


def completion_logprobs(done: Finished, tokenizer: Any, top: list[list[tuple[int, float]]] | None,
                        as_ids: bool) -> dict[str, Any]:
    """The completions route's `logprobs`: tokens, token_logprobs, top_logprobs (one
    {token: logprob} dict per position, the sampled token included, as vLLM), text_offset."""
    names = token_strings(done.tokens, tokenizer, as_ids)
    offsets, at = [], 0
    for piece in token_strings(done.tokens, tokenizer, False):
        offsets.append(at)
        at += len(piece)
    tops = []
    for i, (name, logprob) in enumerate(zip(names, done.logprobs, strict=True)):
        entry = {name: float(logprob)}
        for token, value in (top[i] if top is not None else []):
            entry.setdefault(token_strings([token], tokenizer, as_ids)[0], float(value))
        tops.append(entry)
    return {"tokens": names, "token_logprobs": [float(x) for x in done.logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_entries(prompt: list[int], scored: list[tuple[float, int, list[tuple[int, float]]]],
                            tokenizer: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `choices[i].prompt_logprobs`: null for the first prompt token, then per token
    {"<id>": {"logprob", "rank", "decoded_token"}} for the token itself and the top ones."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, (logprob, rank, top) in zip(prompt[1:], scored, strict=True):
        entry = {str(token): {"logprob": logprob, "rank": rank,
                              "decoded_token": tokenizer.decode([token], skip_special_tokens=False)}}
        for place, (other, value) in enumerate(top, start=1):
            entry.setdefault(str(other), {"logprob": value, "rank": place,
                                          "decoded_token": tokenizer.decode([other], skip_special_tokens=False)})
        out.append(entry)
    return out


def chat_logprobs(done: Finished, tokenizer: Any, top: list[list[tuple[int, float]]] | None,
                  as_ids: bool) -> list[dict[str, Any]]:
    """The chat route's `logprobs.content`: per token {token, logprob, bytes, top_logprobs}."""
    out = []
    for i, (token, logprob) in enumerate(zip(done.tokens, done.logprobs, strict=True)):
        out.append({**_chat_entry(token, logprob, tokenizer, as_ids),
                    "top_logprobs": [_chat_entry(t, v, tokenizer, as_ids) for t, v in (top[i] if top else [])]})
    return out


def _chat_entry(token: int, logprob: float, tokenizer: Any, as_ids: bool) -> dict[str, Any]:
    piece = tokenizer.decode([token], skip_special_tokens=False)
    return {"token": f"token_id:{token}" if as_ids else piece, "logprob": float(logprob),
            "bytes": list(piece.encode("utf-8"))}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object (its counts also go to the request's log line: engines/access_log.py)."""
    record_usage(prompt_tokens, completion_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
