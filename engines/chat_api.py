"""POST /v1/chat/completions for `rlpipe serve`, in OpenAI's shape with vLLM's token extensions.

OpenAI-client environments (verifiers, OpenEnv, agent loops) drive a policy through this route;
the trainer needs the exact sampled token ids and their log-probs back, which vLLM returns as:

- `return_token_ids: true` (the default here): `prompt_token_ids` at the top level (the chat
  template's rendering of `messages`, generation prompt included) and `choices[i].token_ids`
  (the sampled ids, a final stop token included);
- `logprobs: true`: `choices[i].logprobs.content = [{"token", "logprob", "bytes", "top_logprobs"}]`
  per sampled token, `token` being "token_id:<id>" when `return_tokens_as_token_ids` is true;
  `top_logprobs: k` fills each token's `top_logprobs` with the k most likely tokens (one scoring
  pass after sampling). Log-probs follow engines/base.py (softmax(logits / temperature),
  untruncated).

The prompt is the model's chat template over `messages`, with `tools` and the server's
`--chat-template-kwargs` under the request's `chat_template_kwargs` (models/chat.py
template_ids), rendered in a thread under the request deadline. A request's own `chat_template`
(field, or key of chat_template_kwargs) is refused unless the server runs with
`--allow-client-chat-template`. Sampling stops at the tokenizer's end-of-turn tokens
(`<|im_end|>`, eos) plus `stop_token_ids` unless `ignore_eos`, and at `stop` strings
(engines/openai_output.py).

Caps: the rendered prompt and the sampling parameters go through the same check as
/v1/completions (engines/request_pipeline.py `check_request_limits`: --max-n, --max-tokens,
prompt + max_tokens within the context), max_tokens (or max_completion_tokens) as requested,
never shrunk to fit; unset, it is what the context leaves after the prompt, within --max-tokens.

Tool calls: with `--tool-call-parser NAME` (models/tool_calls.py) and `tools` in the request
(`tool_choice` "auto", the default, or "none" to skip parsing), the reply's calls become
`message.tool_calls` ({id, type "function", function {name, arguments as a JSON string}}), its
content the text outside them (null when none), and `finish_reason` "tool_calls". An assistant
message's `tool_calls` in the request reach the template as they are, or, for a parser whose
format the template does not render (calculator), become the text the model wrote.

`stream: true`: live (engines/streaming.py), except with top_logprobs or tool-call parsing,
where the sampled reply is streamed once whole (tool calls as one `delta.tool_calls` chunk each).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import field_validator
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.openai_output import Finished, chat_logprobs, finish_all, text_pieces, usage
from rlpipe.engines.protocol import (
    OpenAIRequest,
    check_model,
    end_of_turn_ids,
    sample,
    sampling_params,
    top_of,
)
from rlpipe.engines.request_pipeline import (
    RequestError,
    check_request_limits,
    default_max_tokens,
    read_request,
    until_answered,
)
from rlpipe.engines.streaming import chat_chunks as stream_chat_chunks
from rlpipe.engines.streaming import live_events, replay_events, sse
from rlpipe.models.chat import template_ids
from rlpipe.models.tool_calls import ToolCallParser, calls_of_message, openai_tool_calls

# chat_template_kwargs keys that template_ids sets itself
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                            "return_dict", "tokenizer_kwargs")


class ChatRequest(OpenAIRequest):
    """The accepted fields of POST /v1/chat/completions (unknown fields are refused by name)."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | int = 1.0
    top_p: float | int = 1.0
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not value:
            raise ValueError("messages is empty")
        for i, message in enumerate(value):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no role")
        return [_plain_message(m, i) for i, m in enumerate(value)]

    @field_validator("top_logprobs")
    @classmethod
    def _top_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {value}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value):
        if value not in (None, "auto", "none"):
            raise ValueError(f"tool_choice {value!r} is not supported (only 'auto' or 'none')")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value):
        for i, tool in enumerate(value or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        for key in value or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"chat_template_kwargs.{key} is set by the server")
        return value

    def sampling_params(self, end_of_turn: tuple[int, ...], default_max: int) -> SamplingParams:
        """Our SamplingParams (ValueError names the bad field); stops at the end-of-turn tokens
        unless ignore_eos."""
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        max_tokens = self.requested_max_tokens or default_max
        return sampling_params(
            n=self.n, max_tokens=max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop_token_ids=self.stop_ids(end_of_turn),
        )

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (the server's default applies)."""
        return next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None), None)

    def client_template(self) -> str | None:
        """The chat template the request brings (field or chat_template_kwargs), if any."""
        return self.chat_template or (self.chat_template_kwargs or {}).get("chat_template")


def _plain_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text", ""), str):
                raise ValueError(f"messages[{index}]: only text content parts are supported")
            texts.append(part.get("text", ""))
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    elif not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string, a list of text parts or null")
    if "tool_calls" in message:
        try:
            calls_of_message(message)
        except ValueError as err:
            raise ValueError(f"messages[{index}].{err}") from None
    return message


def template_messages(messages: list[dict[str, Any]], parser: ToolCallParser | None) -> list[dict[str, Any]]:
    """The messages as the template gets them: an assistant message's tool calls written as the
    model's own text where the parser's format is not the template's (parser.to_text)."""
    if parser is None:
        return messages
    out = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            text = parser.to_text(message.get("content") or "", calls_of_message(message))
            if text is not None:
                message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
        out.append(message)
    return out


def chat_prompt_ids(tokenizer: Any, req: ChatRequest, defaults: dict[str, Any] | None = None,
                    parser: ToolCallParser | None = None) -> list[int]:
    """The chat template's token ids for the request's messages, ending in the generation prompt:
    the server's template kwargs `defaults` under the request's own, and its tools."""
    kwargs = {**(defaults or {}), **(req.chat_template_kwargs or {})}
    if req.chat_template:
        kwargs["chat_template"] = req.chat_template
    if req.tools:
        kwargs["tools"] = req.tools
    return template_ids(tokenizer, template_messages(req.messages, parser), add_generation_prompt=True, **kwargs)


def reply_message(done: Finished, req: ChatRequest, parser: ToolCallParser | None) -> tuple[dict[str, Any], str]:
    """The assistant message of a choice and its finish_reason (tool calls parsed, if any)."""
    parsed = None
    if parser is not None and req.tools and req.tool_choice != "none":
        parsed = parser.parse(done.text)
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": done.text, "tool_calls": []}, done.finish_reason
    ids = [f"chatcmpl-tool-{uuid.uuid4().hex}" for _ in parsed.calls]
    return ({"role": "assistant", "content": parsed.content or None,
             "tool_calls": openai_tool_calls(parsed.calls, ids)}, "tool_calls")


def chat_choice(index: int, done: Finished, tokenizer: Any, req: ChatRequest, parser: ToolCallParser | None,
                top: list[list[tuple[int, float]]] | None = None) -> dict[str, Any]:
    """One OpenAI chat choice with vLLM's token-id and log-prob extensions."""
    message, reason = reply_message(done, req, parser)
    choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None,
                              "finish_reason": reason, "stop_reason": done.stop_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(done.tokens)
    if req.logprobs:
        choice["logprobs"] = {"content": chat_logprobs(done, tokenizer, top, req.return_tokens_as_token_ids)}
    return choice


def tool_call_chunks(head: dict[str, Any], choices: list[dict[str, Any]], finished: list[Finished], tokenizer: Any,
                     req: ChatRequest, answer_usage: dict[str, int]):
    """The chunks of a streamed chat answer parsed for tool calls (sent once it is sampled): per
    choice a role chunk, then one content chunk per token (or, for a reply with tool calls, its
    content then one chunk per call), then its finish_reason; the usage chunk if asked."""
    for choice, done in zip(choices, finished, strict=True):
        index, message = choice["index"], choice["message"]

        def chunk(delta: dict[str, Any], logprobs=None, token_ids=None, reason=None, stop_reason=None,
                  index=index):
            part = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                part["stop_reason"] = stop_reason
            if token_ids is not None:
                part["token_ids"] = token_ids
            return {**head, "choices": [part]}

        entries = (choice["logprobs"] or {}).get("content")
        ids = done.tokens if req.return_token_ids else None
        yield chunk({"role": "assistant", "content": ""})
        if message["tool_calls"]:
            if message["content"]:
                yield chunk({"content": message["content"]})
            for k, call in enumerate(message["tool_calls"]):
                yield chunk({"tool_calls": [{"index": k, **call}]},
                            {"content": entries} if entries is not None and k == 0 else None,
                            ids if k == 0 else None)
        else:
            for t, piece in enumerate(text_pieces(done.tokens, done.text, tokenizer, req.skip_special_tokens)):
                yield chunk({"content": piece}, None if entries is None else {"content": [entries[t]]},
                            None if ids is None else [ids[t]])
        yield chunk({}, reason=choice["finish_reason"], stop_reason=done.stop_reason)
    if req.include_usage:
        yield {**head, "choices": [], "usage": answer_usage}


def add_chat_completions(app: FastAPI, state: Any) -> None:
    """Register POST /v1/chat/completions on `app`; `state` is engines/serve_app.py's ServerState."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, state.limits, ChatRequest)
        if req.client_template() is not None and not state.allow_client_chat_template:
            raise RequestError("chat_template: a client chat template is refused (start the server with "
                               "--allow-client-chat-template to accept one)", 403)
        current = state.slot.current
        try:
            params = req.sampling_params(end_of_turn_ids(current.tokenizer), state.limits.max_tokens)
        except ValueError as err:
            raise RequestError(str(err)) from err
        model = check_model(req.model, state)
        render = asyncio.to_thread(chat_prompt_ids, current.tokenizer, req, state.chat_template_kwargs,
                                   state.tool_parser)
        try:
            prompt = await until_answered(request, render, state.limits.request_timeout_s)
        except RequestError:
            raise
        except Exception as err:  # noqa: BLE001 - a template that refuses the messages (jinja raise)
            raise RequestError(f"messages: the chat template cannot render them: {err}") from err
        if req.requested_max_tokens is None:  # unset: what the context leaves, within --max-tokens
            params = replace(params, max_new_tokens=default_max_tokens(len(prompt), state.limits,
                                                                        current.max_model_len))
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        check_request_limits([prompt], params, state.limits, current.max_model_len, field)
        parse_tools = state.tool_parser is not None and bool(req.tools) and req.tool_choice != "none"
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        if req.stream and not parse_tools and not (req.logprobs and req.top_logprobs):  # live
            chunks = stream_chat_chunks(live_events(state, [prompt], params), head, current.tokenizer, req, len(prompt))
            return StreamingResponse(sse(chunks), media_type="text/event-stream")
        (group,), served = await sample(request, state, [prompt], params)
        tok = served.tokenizer
        finished = await asyncio.to_thread(finish_all, list(group), tok, req.stop_strings, end_of_turn_ids(tok),
                                           skip_special_tokens=req.skip_special_tokens,
                                           include_stop=req.include_stop_str_in_output)
        tops = None
        if req.logprobs and req.top_logprobs:
            tops = await top_of(request, state, served, [(prompt, d.tokens) for d in finished], req.top_logprobs,
                                params)
        choices = [chat_choice(j, d, tok, req, state.tool_parser, tops[j] if tops else None)
                   for j, d in enumerate(finished)]
        answer_usage = usage(len(prompt), sum(len(d.tokens) for d in finished))
        if req.stream and parse_tools:
            return StreamingResponse(sse(tool_call_chunks(head, choices, finished, tok, req, answer_usage)),
                                     media_type="text/event-stream")
        if req.stream:  # top log-probs need the whole completion: its replay, in the same chunks
            chunks = stream_chat_chunks(replay_events([group], served), head, tok, req, len(prompt), tops)
            return StreamingResponse(sse(chunks), media_type="text/event-stream")
        head = {**head, "object": "chat.completion"}
        out = {**head, "choices": choices, "usage": answer_usage, "policy_version": served.policy_version}
        if req.return_token_ids:
            out["prompt_token_ids"] = prompt
        return out
