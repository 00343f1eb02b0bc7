"""`stream: true` for `rlpipe serve`: tokens as the engine samples them, as OpenAI chunks.

    events = live_events(state, prompts, params)        # ("token", i, j, token, logprob) ... ("done", groups, served)
    events = replay_events(groups, served)              # the same from finished completions
    chunks = completion_chunks(events, head, tokenizer, req, n, prompt_tokens, tops)
    return StreamingResponse(sse(chunks), media_type="text/event-stream")

A live stream sends each token's chunk as soon as the batcher's engine call samples it (the
engine calls back from its thread: engines/torch_engine.py `on_token`). What needs the whole
completion first streams a replay of it, in the same chunks: top log-probs (a scoring pass after
sampling) and chat replies parsed for tool calls (engines/chat_api.py).

Text deltas (`ChoiceStream`): each token's chunk carries what its token adds to the decoded text
(decoded incrementally, engines/stop_strings.py), holding back as many characters as a stop
string could still need (and a partial UTF-8 character), so no stop string is ever sent; a choice
ends at the first stop string completed (its own last chunk, `finish_reason` "stop") or with its
engine completion. Every prefix of the deltas is a prefix of the answer without `stream`
(engines/openai_output.py `finish`, the same cutter), and all of them add up to it. Chunks of several
choices interleave, each carrying its `index`; a usage chunk (`choices: []`) follows with
`stream_options.include_usage`; the stream ends with `data: [DONE]`. An error after the stream
began (the request deadline, an engine error) is sent as a `data: {"error": {...}}` event before
`[DONE]`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from rlpipe.engines.base import SamplingParams
from rlpipe.engines.openai_output import (
    Finished,
    chat_logprobs,
    stopped,
    token_strings,
    unstopped,
    usage,
)
from rlpipe.engines.protocol import end_of_turn_ids
from rlpipe.engines.request_pipeline import RequestError
from rlpipe.engines.stop_strings import StopCutter


class ChoiceStream:
    """One choice's tokens in, text deltas out, cut at the first stop string completed.

    The text and its cut are engines/stop_strings.py's `StopCutter` (the rule the answer without
    `stream` follows); a delta is final text that no stop string can still reach: the last
    `longest - 1` characters wait, so every delta sent is a prefix of the whole answer's text."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], eos_ids: tuple[int, ...], skip: bool,
                 include_stop: bool) -> None:
        self.cutter = StopCutter(tokenizer, stops, skip, include_stop)
        self.eos_ids = eos_ids
        self.held = max(self.cutter.longest - 1, 0)
        self.tokens = self.cutter.tokens
        self.logprobs: list[float] = []
        self.sent = 0  # characters of the text sent
        self.done: Finished | None = None

    def add(self, token: int, logprob: float) -> str:
        """The text `token` adds that can be sent now (`done` is set when a stop string ends it)."""
        self.logprobs.append(logprob)
        self.cutter.add(token)
        if self.cutter.hit is not None:
            return self._stopped()
        return self._send(self.cutter.text, len(self.cutter.text) - self.held)

    def close(self, finish_reason: str) -> str:
        """The rest of the text, once the engine's completion ended with `finish_reason` (a stop
        string the rest completes ends it there)."""
        self.cutter.close()
        if self.cutter.hit is not None:
            return self._stopped()
        self.done = unstopped(finish_reason, list(self.tokens), list(self.logprobs), self.cutter.text, self.eos_ids)
        return self._send(self.done.text, len(self.done.text))

    def _stopped(self) -> str:
        self.done = stopped(self.cutter.hit, self.tokens, self.logprobs)
        return self._send(self.done.text, len(self.done.text))

    def _send(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent:upto], upto
        return delta


async def live_events(state: Any, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[tuple]:
    """("token", i, j, token, logprob) as the batcher's engine samples them, then ("done",
    groups, served); the request deadline applies, and closing the iterator drops the request's
    remaining work (`state` is engines/serve_app.py's ServerState)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_token(i: int, j: int, token: int, logprob: float) -> None:  # the engine's thread
        loop.call_soon_threadsafe(queue.put_nowait, ("token", i, j, token, logprob))

    task = asyncio.ensure_future(state.batcher.submit(prompts, params, on_token))
    task.add_done_callback(lambda _: queue.put_nowait(("end",)))
    timeout = state.limits.request_timeout_s
    deadline = loop.time() + timeout
    try:
        while True:  # the deadline bounds each wait here, never a `yield`: a timeout scope held
            try:     # across `yield` would cancel whatever the consumer awaits (the socket send)
                event = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise RequestError(f"request took longer than request_timeout_s={timeout:g} "
                                   "(--request-timeout-s)", 504) from None
            if event[0] == "end":
                break
            yield event
        groups, served = task.result()
        yield ("done", groups, served)
    finally:
        task.cancel()


async def replay_events(groups: list, served: Any) -> AsyncIterator[tuple]:
    """The events of `live_events` from finished completions, choice after choice."""
    for i, group in enumerate(groups):
        for j, completion in enumerate(group):
            for token, logprob in zip(completion.tokens, completion.logprobs, strict=True):
                yield ("token", i, j, token, float(logprob))
    yield ("done", groups, served)


class _Choices:
    """The ChoiceStreams of one request, by choice index (prompt × n + sample)."""

    def __init__(self, tokenizer: Any, req: Any, n: int) -> None:
        self.tokenizer, self.req, self.n = tokenizer, req, n
        self.streams: dict[int, ChoiceStream] = {}
        self.eos = end_of_turn_ids(tokenizer)

    def get(self, index: int) -> ChoiceStream:
        if index not in self.streams:
            self.streams[index] = ChoiceStream(self.tokenizer, self.req.stop_strings, self.eos,
                                               self.req.skip_special_tokens, self.req.include_stop_str_in_output)
        return self.streams[index]

    def completion_tokens(self) -> int:
        return sum(len(s.done.tokens if s.done is not None else s.tokens) for s in self.streams.values())


async def completion_chunks(events: AsyncIterator[tuple], head: dict[str, Any], tokenizer: Any, req: Any, n: int,
                            prompt_tokens: int, tops: list | None = None) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed /v1/completions answer (see the module docstring)."""
    choices = _Choices(tokenizer, req, n)
    offsets: dict[int, int] = {}

    def final(index: int, done: Finished) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "text": "", "logprobs": None,
                                     "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}]}

    async for event in events:
        if event[0] == "token":
            _, i, j, token, logprob = event
            index = i * n + j
            stream = choices.get(index)
            if stream.done is not None:
                continue
            position = len(stream.tokens)
            part: dict[str, Any] = {"index": index, "text": stream.add(token, logprob), "logprobs": None,
                                    "finish_reason": None, "stop_reason": None}
            if req.logprobs is not None:
                name = token_strings([token], tokenizer, req.return_tokens_as_token_ids)[0]
                top = {name: logprob}
                for other, value in (tops[index][position] if tops else []):
                    top.setdefault(token_strings([other], tokenizer, req.return_tokens_as_token_ids)[0], value)
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(token_strings([token], tokenizer, False)[0])
                part["logprobs"] = {"tokens": [name], "token_logprobs": [logprob], "top_logprobs": [top],
                                    "text_offset": [offset]}
            if req.return_token_ids:
                part["token_ids"] = [token]
            yield {**head, "choices": [part]}
            if stream.done is not None:
                yield final(index, stream.done)
        else:
            for i, group in enumerate(event[1]):
                for j, completion in enumerate(group):
                    index = i * n + j
                    stream = choices.get(index)
                    if stream.done is not None:
                        continue
                    rest = stream.close(completion.finish_reason)
                    if rest:
                        yield {**head, "choices": [{"index": index, "text": rest, "logprobs": None,
                                                    "finish_reason": None, "stop_reason": None}]}
                    yield final(index, stream.done)
    answer_usage = usage(prompt_tokens, choices.completion_tokens())  # also the request log's counts
    if req.include_usage:
        yield {**head, "choices": [], "usage": answer_usage}


async def chat_chunks(events: AsyncIterator[tuple], head: dict[str, Any], tokenizer: Any, req: Any,
                      prompt_tokens: int, tops: list | None = None) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed /v1/chat/completions answer without tool-call parsing: a role
    chunk per choice, then content deltas as the tokens come (see the module docstring)."""
    choices = _Choices(tokenizer, req, req.n)

    def part(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                                     **extra}]}

    for index in range(req.n):
        yield part(index, {"role": "assistant", "content": ""})
    async for event in events:
        if event[0] == "token":
            _, _, index, token, logprob = event
            stream = choices.get(index)
            if stream.done is not None:
                continue
            position = len(stream.tokens)
            extra: dict[str, Any] = {}
            if req.logprobs:
                one = Finished([token], [logprob], "", "length")
                top = [tops[index][position]] if tops else None
                extra["logprobs"] = {"content": chat_logprobs(one, tokenizer, top, req.return_tokens_as_token_ids)}
            if req.return_token_ids:
                extra["token_ids"] = [token]
            yield part(index, {"content": stream.add(token, logprob)}, **extra)
            if stream.done is not None:
                yield part(index, {}, finish_reason="stop", stop_reason=stream.done.stop_reason)
        else:
            for index, completion in enumerate(event[1][0]):
                stream = choices.get(index)
                if stream.done is not None:
                    continue
                rest = stream.close(completion.finish_reason)
                if rest:
                    yield part(index, {"content": rest})
                yield part(index, {}, finish_reason=stream.done.finish_reason, stop_reason=stream.done.stop_reason)
    answer_usage = usage(prompt_tokens, choices.completion_tokens())  # also the request log's counts
    if req.include_usage:
        yield {**head, "choices": [], "usage": answer_usage}


async def sse(chunks: AsyncIterator[dict[str, Any]] | Iterable[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one `data: {json}` per chunk, an error event if the stream fails
    after it began, then `data: [DONE]`."""
    try:
        if hasattr(chunks, "__aiter__"):
            async for chunk in chunks:  # type: ignore[union-attr]
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        else:
            for chunk in chunks:  # type: ignore[union-attr]
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except (RequestError, ValueError) as err:
        status = getattr(err, "status", 400)
        error = {"message": str(err), "type": "invalid_request_error", "code": status}
        yield f"data: {json.dumps({'error': error})}\n\n"
    except Exception as err:  # noqa: BLE001 - the status line is sent: say so in the stream
        error = {"message": f"{type(err).__name__}: {err}", "type": "internal_error", "code": 500}
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"
