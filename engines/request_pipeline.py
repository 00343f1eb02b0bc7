"""The one request pipeline of `rlpipe serve`: checks every route makes of a request before it
reads what the request asks for, and the server's limits. Nothing here knows FastAPI routes or
request models (those are engines/protocol.py):

    check_host(headers, allowed)            403 unless the Host header names an allowed host
    check_content_type(headers)             415 unless the body is application/json
    body = await read_json_body(request, limits)   413 over limits.max_body_bytes; 400 for bad JSON
    check_json_tree(body)                   400 for a body nested too deeply or a lone surrogate
    check_request_limits(prompts, params, limits, context)   400 naming the cap a request exceeds
    result = await until_answered(request, work, timeout_s)  499 when the client left, 504 past the timeout
    validation_message(err)                 a pydantic error as one line for a 400

    req = await read_request(request, limits, Model)   all of the body checks above, in order, then
                                            the pydantic model (400)

Every POST route reads its body through `read_request`, so every route refuses alike. Every
refusal is a `RequestError` carrying its HTTP status; the app turns it into an OpenAI-style
error body. Nothing a client sends gives a 500: bad JSON (also too deep), non-finite numbers, a
lone surrogate are all 4xx naming the place.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from rlpipe.engines.base import SamplingParams

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_JSON_DEPTH = 32


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServeLimits:
    """Caps of one server; each refusal names the command-line option that sets it."""

    max_n: int = 64
    """Completions per prompt (--max-n)."""
    max_tokens: int = 4096
    """max_tokens of a request (--max-tokens); prompt + max_tokens must also fit the context."""
    max_prompts: int = 256
    """Prompts in one request (--max-prompts)."""
    max_body_bytes: int = 16 << 20
    """Request body size (--max-body-bytes)."""
    chunk_sequences: int = 64
    """A request is generated in engine calls of at most this many sequences (prompts x n), so
    other requests and weight updates take turns with a long one (--chunk-sequences)."""
    request_timeout_s: float = 600.0
    """A request still unanswered after this many seconds gets 504 and its remaining work is
    dropped (--request-timeout-s)."""
    body_timeout_s: float = 30.0
    """A request body not fully received within this many seconds gets 408 (--body-timeout-s)."""
    header_timeout_s: float = 30.0
    """A connection whose request headers are not complete within this many seconds is closed
    (--header-timeout-s; engines/serve_cli.py's HTTP protocol)."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_tokens", "max_prompts", "max_body_bytes", "chunk_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "body_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def check_host(headers: Any, allowed: tuple[str, ...] | None) -> None:
    """403 unless the Host header (port stripped) is in `allowed` (None = any host). A browser
    page on another site can reach a loopback server through DNS rebinding, but its requests
    carry that site's host name."""
    if allowed is None:
        return
    host = headers.get("host", "")
    if host_name(host) not in allowed:
        raise RequestError(f"Host {host!r} is not allowed (allowed: {', '.join(allowed)}; --allow-host)", 403)


def host_name(host: str) -> str:
    """A Host header's name without its port, lower-cased ('[::1]:8000' -> '::1')."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0].lower()
    if host.count(":") == 1:
        return host.split(":", 1)[0].lower()
    return host.lower()  # a bare name, or a bare IPv6 address


def check_content_type(headers: Any) -> None:
    """415 unless the body is declared JSON (a form post from a web page cannot be)."""
    kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise RequestError(f"Content-Type must be application/json, got {kind or 'none'!r}", 415)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def read_json_body(request: Any, limits: ServeLimits) -> Any:
    """The request's JSON body: 413 past limits.max_body_bytes (checked while reading), 400 for
    invalid, too deeply nested or non-finite (NaN, Infinity) JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(f"request body of {declared} bytes exceeds max_body_bytes={limits.max_body_bytes} "
                           "(--max-body-bytes)", 413)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise RequestError(f"request body exceeds max_body_bytes={limits.max_body_bytes} "
                                       "(--max-body-bytes)", 413)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(f"request body not received within body_timeout_s={limits.body_timeout_s:g} "
                           "(--body-timeout-s)", 408) from None
    try:
        return json.loads(b"".join(chunks), parse_constant=_no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        raise RequestError(f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply") from None


def validation_message(err: ValidationError) -> str:
    """The first five problems of a rejected request body, as "field: message; ..."."""
    parts = []
    for e in err.errors()[:5]:
        where = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


async def _disconnected(request: Any) -> None:
    """Returns once the client has gone (after the body was read, receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_answered(request: Any, work: Any, timeout_s: float) -> Any:
    """`await work`, unless the client goes away first (the work is cancelled: a request's
    remaining parts are dropped) or `timeout_s` passes (the same, and a 504)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    if gone in done:
        raise RequestError("client closed the connection", 499)
    raise RequestError(f"request took longer than request_timeout_s={timeout_s:g} (--request-timeout-s)", 504)




def check_json_tree(value: Any, where: str = "body", depth: int = 0) -> None:
    """400 naming the place of a body nested deeper than MAX_JSON_DEPTH, or of a string (key
    or value) that is not valid Unicode text (a lone surrogate such as "\\ud800")."""
    if depth > MAX_JSON_DEPTH:
        raise RequestError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, f"{where} key")
            check_json_tree(item, f"{where}.{key}" if where != "body" else key, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json_tree(item, f"{where}[{i}]", depth + 1)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{where}: not valid Unicode text (a lone surrogate)") from None


async def read_request(request: Any, limits: ServeLimits, model: type[BaseModel]) -> Any:
    """The one request pipeline of every POST route: JSON content type (415), the body within
    limits.max_body_bytes (413) and limits.body_timeout_s (408), valid JSON (400), depth and
    text checks (400), a JSON object validated by `model` (400 naming the field)."""
    check_content_type(request.headers)
    body = await read_json_body(request, limits)
    check_json_tree(body)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise RequestError(validation_message(err)) from err
    except ValueError as err:  # a validator's own ValueError outside pydantic's wrapping
        raise RequestError(str(err)) from err


def default_max_tokens(prompt_tokens: int, limits: ServeLimits, context: int | None) -> int:
    """A request's max_tokens when it sets none: what the context leaves after its prompt, within
    --max-tokens (at least 1, so a prompt that fills the context is refused by
    `check_request_limits` naming the context)."""
    room = limits.max_tokens if context is None else context - prompt_tokens
    return max(1, min(limits.max_tokens, room))


def check_request_limits(prompts: list[list[int]], params: SamplingParams, limits: ServeLimits,
                         context: int | None, max_tokens_field: str = "max_tokens") -> None:
    """400 naming the cap (and its option) that a request exceeds: the one check every route
    runs on the prompts and sampling parameters it will generate with, max_tokens as requested
    (never clamped to fit first), named by the request's own field (`max_tokens_field`)."""
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"{len(prompts)} prompts exceed max_prompts={limits.max_prompts} (--max-prompts)")
    if params.n > limits.max_n:
        raise RequestError(f"n={params.n} exceeds max_n={limits.max_n} (--max-n)")
    if params.max_new_tokens > limits.max_tokens:
        raise RequestError(f"{max_tokens_field}={params.max_new_tokens} exceeds max_tokens={limits.max_tokens} "
                           "(--max-tokens)")
    if context is not None:
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        need = len(prompts[longest]) + params.max_new_tokens
        if need > context:
            raise RequestError(f"prompt[{longest}] has {len(prompts[longest])} tokens; with {max_tokens_field}="
                               f"{params.max_new_tokens} that is {need}, over the model's context of {context}")
