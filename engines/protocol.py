"""What `rlpipe serve` accepts: request checks shared by every route, limits, and the
completions request model. Nothing here knows FastAPI routes; a new route (chat completions)
calls the same functions:

    check_host(headers, allowed)            403 unless the Host header names an allowed host
    check_content_type(headers)             415 unless the body is application/json
    body = await read_json_body(request, limits)   413 over limits.max_body_bytes; 400 for bad JSON
    check_request_limits(prompts, params, limits, context)   400 naming the cap a request exceeds
    result = await until_answered(request, work, timeout_s)  499 when the client left, 504 past the timeout
    validation_message(err)                 a pydantic error as one line for a 400

    req = await read_request(request, limits, Model)   all of the body checks above, in order, then
                                            the depth / text checks and the pydantic model (400)

Every POST route reads its body through `read_request`, so every route refuses alike. Every
refusal is a `RequestError` carrying its HTTP status; the app turns it into an OpenAI-style
error body. Nothing a client sends gives a 500: bad JSON (also too deep), non-finite numbers, a
lone surrogate, a seed outside [0, 2**64), a temperature so small the log-probs overflow, are
all 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from rlpipe.engines.base import SamplingParams

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Below this, logits / temperature overflow float32 for ordinary logits (NaN log-probs).
MIN_TEMPERATURE = 1e-3


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


MAX_JSON_DEPTH = 32
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


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


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


async def sample(request: Any, state: Any, prompts: list[list[int]], params: SamplingParams):
    """The batcher's (`state` is engines/server.py's ServerState) completions for `prompts` and the model that made them, under the request's
    deadline and dropped when the client goes away."""
    try:
        return await until_answered(request, state.batcher.submit(prompts, params), state.limits.request_timeout_s)
    except RequestError:
        raise
    except ValueError as err:  # the engine refused the prompts (e.g. a reload changed vocab)
        raise RequestError(str(err)) from err


async def top_of(request: Any, state: Any, served: Any,
                 sequences: list[tuple[list[int], list[int]]], k: int, params: SamplingParams):
    """`ModelSlot.top_logprobs` off the event loop, under the request's deadline."""
    temperature = 1.0 if params.greedy else params.temperature
    work = asyncio.to_thread(state.slot.top_logprobs, served, sequences, k, temperature)
    return await until_answered(request, work, state.limits.request_timeout_s)


def check_model(name: str | None, state: Any) -> str:
    """The served name a request asked for (404 for another one); the first when it names none."""
    if name is None:
        return state.served_names[0]
    if name not in state.served_names:
        raise RequestError(f"the model {name!r} does not exist; serving {', '.join(map(repr, state.served_names))}",
                           404)
    return name


class OpenAIRequest(BaseModel):
    """Fields and refusals both OpenAI routes share; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = 1
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | int = 0
    presence_penalty: float | int = 0
    repetition_penalty: float | int = 1

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """A null where the field has a default means the default (clients send
        `"max_tokens": null`, `"temperature": null`)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None and not fields[k].is_required())}
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("echo", check_fields=False)
    @classmethod
    def _not_supported(cls, value: bool, info) -> bool:
        if value:
            raise ValueError(f"{info.field_name}=true is not supported by rlpipe serve")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, value):
        if value != 1:
            raise ValueError("repetition_penalty is not supported (only 1)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stops)} strings, at most {MAX_STOP_STRINGS}")
        for i, stop in enumerate(stops):
            if not 0 < len(stop) <= MAX_STOP_CHARS:
                raise ValueError(f"stop[{i}] must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (empty when unset)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_ids(self, end_of_turn: tuple[int, ...]) -> list[int]:
        """stop_token_ids, plus the model's end-of-turn / EOS tokens unless ignore_eos."""
        stops = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else end_of_turn)
        return list(dict.fromkeys(stops))


class CompletionRequest(OpenAIRequest):
    """The accepted fields of POST /v1/completions (unknown fields are refused by name)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float | int = 1.0
    top_p: float | int = 1.0
    logprobs: int | None = None
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {value}")
        return value

    def sampling_params(self, end_of_turn: tuple[int, ...] = ()) -> SamplingParams:
        """Our SamplingParams (ValueError names the bad field); stops at `end_of_turn` (the
        model's EOS tokens) unless ignore_eos."""
        return sampling_params(n=self.n, max_tokens=self.max_tokens, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                               stop_token_ids=self.stop_ids(end_of_turn))


class ReloadRequest(BaseModel):
    """POST /update_weights_from_disk (SGLang's shape; its other fields are accepted, unused)."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    weight_version: str | None = None


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """`<|im_end|>` and the eos token, where the tokenizer has them: where generation stops
    unless a request sets ignore_eos (vLLM stops at the model's EOS tokens likewise)."""
    ids = [tokenizer.get_vocab().get("<|im_end|>"), tokenizer.eos_token_id]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))


def sampling_params(*, n: int, max_tokens: int, temperature: float, top_p: float, top_k: int,
                    seed: int | None, stop_token_ids: list[int] | None) -> SamplingParams:
    """OpenAI sampling fields as SamplingParams; ValueError naming the field for values the
    engine cannot sample with (temperature 0 = greedy)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}: "
                         "smaller ones overflow the log-probs")
    if top_k < -1:
        raise ValueError(f"top_k must be -1, 0 (off) or positive, got {top_k}")
    if seed is not None and not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    greedy = temperature == 0
    return SamplingParams(
        n=n,
        temperature=1.0 if greedy else float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        max_new_tokens=max_tokens,
        stop_token_ids=tuple(stop_token_ids or ()),
        seed=seed,
        greedy=greedy,
    )


def check_request_limits(prompts: list[list[int]], params: SamplingParams, limits: ServeLimits,
                         context: int | None) -> None:
    """400 naming the cap (and its option) that a request exceeds."""
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"{len(prompts)} prompts exceed max_prompts={limits.max_prompts} (--max-prompts)")
    if params.n > limits.max_n:
        raise RequestError(f"n={params.n} exceeds max_n={limits.max_n} (--max-n)")
    if params.max_new_tokens > limits.max_tokens:
        raise RequestError(f"max_tokens={params.max_new_tokens} exceeds max_tokens={limits.max_tokens} (--max-tokens)")
    if context is not None:
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        need = len(prompts[longest]) + params.max_new_tokens
        if need > context:
            raise RequestError(f"prompt[{longest}] has {len(prompts[longest])} tokens; with max_tokens="
                               f"{params.max_new_tokens} that is {need}, over the model's context of {context}")


def prompt_token_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt of a request; RequestError for empty or out-of-vocabulary ones."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt is empty")
    out = []
    for i, p in enumerate(prompts):
        ids = tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise RequestError(f"prompt[{i}] is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def resolve_model_path(model_path: Any, allow_root: Path) -> Path:
    """The resolved checkpoint folder, if inside `allow_root` (symlinks resolved first).

    RequestError 403 for any path outside the root, whether it exists or not (the answer must
    not tell a client what exists outside); 400 for a missing or non-folder path inside it.
    """
    if not isinstance(model_path, str) or not model_path or "\x00" in model_path:
        raise RequestError("model_path must be a non-empty string")
    try:
        resolved = Path(model_path).resolve(strict=False)  # follows the symlinks that exist
    except (OSError, RuntimeError):
        resolved = None
    if resolved is None or not resolved.is_relative_to(allow_root):
        raise RequestError(f"model_path {model_path!r} is outside the allowed root {str(allow_root)!r}", 403)
    if not resolved.exists():
        raise RequestError(f"model_path {model_path!r} does not exist")
    if not resolved.is_dir():
        raise RequestError(f"model_path {model_path!r} is not a directory")
    return resolved
