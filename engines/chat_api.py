"""POST /v1/chat/completions for `rlpipe serve`, in OpenAI's shape with vLLM's token extensions.

OpenAI-client environments (verifiers, OpenEnv, agent loops) drive a policy through this route;
the trainer needs the exact sampled token ids and their log-probs back, which vLLM returns as:

- `return_token_ids: true` (the default here): `prompt_token_ids` at the top level (the chat
  template's rendering of `messages`, generation prompt included) and `choices[i].token_ids`
  (the sampled ids, a final stop token included);
- `logprobs: true`: `choices[i].logprobs.content = [{"token", "logprob", "bytes", "top_logprobs"}]`
  per sampled token, `token` being "token_id:<id>" when `return_tokens_as_token_ids` is true.
  Log-probs follow engines/base.py (softmax(logits / temperature), untruncated); top_logprobs
  is always [] (not computed).

The prompt is `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tools=..., **chat_template_kwargs)`. Sampling stops at the tokenizer's end-of-turn tokens
(`<|im_end|>`, eos) plus `stop_token_ids`, unless `ignore_eos`. The reply's `content` is the
decoded completion without special tokens; tool calls are not parsed out of it (`tool_calls` is
always [], `tools` only reach the chat template). Unsupported OpenAI fields (stream, stop strings,
response_format, ...) are refused by name, not ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError, field_validator
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.protocol import (
    OpenAIRequest,
    RequestError,
    check_request_limits,
    read_json_body,
    sampling_params,
    until_answered,
    validation_message,
)
from rlpipe.models.chat import template_ids


class ChatRequest(OpenAIRequest):
    """The accepted fields of POST /v1/chat/completions (unknown fields are refused by name)."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: bool = False
    top_logprobs: int | None = None
    ignore_eos: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not value:
            raise ValueError("messages is empty")
        for i, message in enumerate(value):
            if "role" not in message:
                raise ValueError(f"messages[{i}] has no role")
        return [_plain_message(m, i) for i, m in enumerate(value)]

    def sampling_params(self, end_of_turn: tuple[int, ...], default_max: int) -> SamplingParams:
        """Our SamplingParams (ValueError names the bad field); stops at the end-of-turn tokens
        unless ignore_eos."""
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported (only the sampled token's log-prob)")
        stops = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else end_of_turn)
        return sampling_params(
            n=self.n, max_tokens=self.max_completion_tokens or self.max_tokens or default_max,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop_token_ids=list(dict.fromkeys(stops)),
        )


def _plain_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"messages[{index}]: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return message


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """`<|im_end|>` and the eos token, where the tokenizer has them."""
    ids = [tokenizer.get_vocab().get("<|im_end|>"), tokenizer.eos_token_id]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))


def chat_prompt_ids(tokenizer: Any, req: ChatRequest) -> list[int]:
    """The chat template's token ids for the request's messages, ending in the generation prompt."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    return template_ids(tokenizer, req.messages, add_generation_prompt=True, **kwargs)


def chat_choice(index: int, completion, tokenizer: Any, req: ChatRequest) -> dict[str, Any]:
    """One OpenAI chat choice with vLLM's token-id and log-prob extensions."""
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant",
                    "content": tokenizer.decode(completion.tokens, skip_special_tokens=True),
                    "tool_calls": []},
        "logprobs": None,
        "finish_reason": completion.finish_reason,
        "stop_reason": None,
    }
    if req.return_token_ids:
        choice["token_ids"] = list(completion.tokens)
    if req.logprobs:
        content = []
        for token, logprob in zip(completion.tokens, completion.logprobs, strict=True):
            piece = tokenizer.decode([token], skip_special_tokens=False)
            content.append({
                "token": f"token_id:{token}" if req.return_tokens_as_token_ids else piece,
                "logprob": float(logprob), "bytes": list(piece.encode()), "top_logprobs": [],
            })
        choice["logprobs"] = {"content": content}
    return choice


def add_chat_completions(app: FastAPI, state: Any) -> None:
    """Register POST /v1/chat/completions on `app`; `state` is engines/server.py's ServerState."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json_body(request, state.limits)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        current = state.slot.current
        try:
            req = ChatRequest.model_validate(body)
            default_max = max(1, (current.max_model_len or 4096) - 1)
            params = req.sampling_params(end_of_turn_ids(current.tokenizer), default_max)
        except ValidationError as err:
            raise RequestError(validation_message(err)) from err
        except ValueError as err:
            raise RequestError(str(err)) from err
        if req.model is not None and req.model != state.model_name:
            raise RequestError(f"the model {req.model!r} does not exist; serving {state.model_name!r}", 404)
        try:
            prompt = chat_prompt_ids(current.tokenizer, req)
        except Exception as err:  # noqa: BLE001 - a template that refuses the messages (jinja raise)
            raise RequestError(f"the chat template cannot render these messages: {err}") from err
        limit = current.max_model_len
        if limit is not None and len(prompt) + params.max_new_tokens > limit:
            params = replace(params, max_new_tokens=max(1, limit - len(prompt)))
            if len(prompt) >= limit:
                raise RequestError(f"the prompt has {len(prompt)} tokens; the model's context is {limit}")
        check_request_limits([prompt], params, state.limits, limit)
        try:
            (group,), served = await until_answered(
                request, state.batcher.submit([prompt], params), state.limits.request_timeout_s)
        except ValueError as err:
            raise RequestError(str(err)) from err
        choices = [chat_choice(j, c, served.tokenizer, req) for j, c in enumerate(group)]
        n_completion = sum(len(c.tokens) for c in group)
        out = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_completion,
                      "total_tokens": len(prompt) + n_completion},
            "policy_version": served.policy_version,
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = prompt
        return out
