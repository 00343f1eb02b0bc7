"""`rlpipe serve`'s HTTP app: the torch engine behind an OpenAI/vLLM-compatible API, with weight
reload. What it generates with (the served model, its reload slot, the request batcher) is
engines/serve_generation.py; its command line is engines/serve_cli.py.

    rlpipe serve runs/demo/checkpoints/step_000010 --port 8001 [--token-file F] [--allow-root DIR]
        [--served-model-name NAME ...] [--tool-call-parser hermes] [--chat-template-kwargs JSON]
    rlpipe serve runs/demo | /models/Qwen3-0.6B | Qwen/Qwen3-0.6B    (engines/serve_sources.py)

Each request is logged in one line on stderr: client, method and path, status, tokens, seconds
(engines/access_log.py; `--no-request-log` turns it off).

Every request passes, in order: a Host allowlist (403; loopback names and the bind address by
default, against DNS rebinding), the bearer token when the server has one (401); every POST body
then goes through one pipeline (engines/request_pipeline.py `read_request`): a JSON Content-Type (415),
a body-size cap (413) and deadline (408), valid JSON no deeper than 32 levels with valid Unicode
text (400), and the route's request model, whose refusals name the field (400). Requests over a
cap (n, max_tokens, prompts, prompt + max_tokens over the context) get 400 naming the cap and its
option; no malformed input gives a 500.

    POST /v1/completions          OpenAI completions; `prompt` is text, a list of texts, token ids
                                  (list[int]) or a batch of token ids (list[list[int]]).
                                  Sampling: n, max_tokens, temperature (0 = greedy), top_p, top_k
                                  (0 or -1 = off), seed, stop (strings), stop_token_ids,
                                  ignore_eos, logprobs (0-20 top log-probs), stream (server-sent
                                  events, engines/streaming.py), stream_options.include_usage;
                                  vLLM's skip_special_tokens,
                                  include_stop_str_in_output, return_token_ids,
                                  return_tokens_as_token_ids, prompt_logprobs (0-20: each
                                  choice's `prompt_logprobs`, vLLM's shape: null, then per
                                  prompt token {"<id>": {logprob, rank, decoded_token}} for the
                                  token and the k most likely, at temperature 1; not streamed).
    POST /v1/chat/completions     OpenAI chat completions with tools and vLLM's token ids and
                                  log-probs (engines/chat_api.py)
    POST /tokenize                {"prompt": TEXT, "add_special_tokens": bool} -> {"count",
                                  "max_model_len", "tokens"} (vLLM's shape): the served tokenizer
    GET  /health                  {"status": "ok", "policy_version": k, "checkpoint": path}
    GET  /v1/models               the served names (--served-model-name; default: MODEL as
                                  given); a request's `model` must be one of them (404)
    POST /update_weights_from_disk {"model_path": DIR, "weight_version": "k"} (SGLang's shape):
                                  load a checkpoint, served as policy version k (the trainer's
                                  count; unset: the checkpoint's own) and answer
                                  {"success": true, "message": ..., "policy_version": k}

As vLLM and OpenAI do, generation stops at the model's end-of-turn / EOS tokens (`<|im_end|>`,
eos) unless `ignore_eos: true` (the HTTP engine sends it: rollouts stop on their own
stop_token_ids only, as in process). Answers (engines/openai_output.py): `text` (special tokens
skipped), `finish_reason` "stop" | "length", vLLM's `stop_reason` (the stop string, or a
stop_token_ids id that is not EOS), `usage` in every answer (a stream's with
stream_options.include_usage), and the extensions mirroring vLLM's `return_token_ids` /
`return_tokens_as_token_ids`: `choices[i].token_ids` holds the completion's token ids (a final
stop token included), and with `logprobs` set, `choices[i].logprobs` holds `tokens`,
`token_logprobs` (the log-prob of each under softmax(logits / temperature), untruncated:
engines/base.py's convention), `top_logprobs` (per position a {token: logprob} dict: the sampled
token and the `logprobs` most likely ones, from one scoring pass after sampling) and
`text_offset`, tokens as "token_id:<id>" strings when `return_tokens_as_token_ids` is true.
The response also carries `policy_version`. Choice `index` = prompt index × n + sample index, as
in OpenAI and vLLM.

Batching: requests go through a queue; a worker takes the first one, waits up to
`batch_window_ms` for more, and runs each group of requests with identical sampling
parameters as one `TorchEngine.generate` call. A request of more than `--chunk-sequences`
sequences (prompts x n) runs as several calls, one per round, in turn with every other waiting
request, so a small request or a weight reload never waits for a long request to finish. A
request with an explicit `seed` is never merged with another, so its completions equal the
in-process engine's for that seed and prompts when it fits one call (a later part k draws
with seed + k). A request unanswered after `--request-timeout-s` gets 504, and one whose client
disconnected is dropped: either way its remaining parts are never generated, and the engine call
under way stops at its next decode step once no request waits for it.

Weight reload: the checkpoint is loaded and verified (sha256) while the old weights keep serving,
then swapped in under the lock that generation holds, so a generate call sees either the old
or the new weights, never a mix; a request split in parts finishes on the weights it started
with. A path outside the allowed root (after resolving symlinks) is refused with 403 whether
it exists or not, an invalid checkpoint with 400; either way the old weights stay in service.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from rlpipe.engines.access_log import RequestLog
from rlpipe.engines.chat_api import add_chat_completions
from rlpipe.engines.openai_output import (
    Finished,
    completion_logprobs,
    finish_all,
    prompt_logprobs_entries,
    usage,
)
from rlpipe.engines.protocol import (
    CompletionRequest,
    ReloadRequest,
    TokenizeRequest,
    check_model,
    end_of_turn_ids,
    prompt_logprobs_of,
    prompt_token_ids,
    resolve_model_path,
    sample,
    top_of,
    weight_version,
)
from rlpipe.engines.request_pipeline import (
    LOOPBACK_HOSTS,
    RequestError,
    ServeLimits,
    check_host,
    check_request_limits,
    read_request,
)
from rlpipe.engines.serve_generation import (
    Batcher,
    ModelSlot,
    ServedModel,
    load_served_model,
)
from rlpipe.engines.streaming import completion_chunks, live_events, replay_events, sse
from rlpipe.models.tool_calls import ToolCallParser, get_parser
from starlette.datastructures import Headers

DEFAULT_PORT = 8000
TOKEN_ENV = "RLPIPE_API_TOKEN"


# ----------------------------------------------------------------------------- responses


def completion_choice(index: int, done: Finished, tokenizer: Any, req: CompletionRequest,
                      top: list[list[tuple[int, float]]] | None) -> dict[str, Any]:
    """One OpenAI completions choice, with vLLM's stop_reason and token-id extensions."""
    choice: dict[str, Any] = {
        "index": index,
        "text": done.text,
        "logprobs": None,
        "finish_reason": done.finish_reason,
        "stop_reason": done.stop_reason,
    }
    if req.return_token_ids:
        choice["token_ids"] = list(done.tokens)
    if req.logprobs is not None:
        choice["logprobs"] = completion_logprobs(done, tokenizer, top, req.return_tokens_as_token_ids)
    return choice


def _error(status: int, message: str) -> JSONResponse:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


class Guard:
    """ASGI middleware run before any route: the Host allowlist, then the bearer token."""

    def __init__(self, app: Any, token: str | None, allowed_hosts: tuple[str, ...] | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            try:
                check_host(headers, self.allowed_hosts)
                given = headers.get("authorization", "").encode()
                if self.expected is not None and not hmac.compare_digest(given, self.expected):
                    raise RequestError("missing or wrong bearer token (Authorization: Bearer <token>)", 401)
            except RequestError as err:
                await _error(err.status, str(err))(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------- the app


@dataclass
class ServerState:
    """Everything a request handler needs (kept on `app.state.rlpipe`)."""

    slot: ModelSlot
    batcher: Batcher
    served_names: tuple[str, ...]
    allow_root: Path
    device: str
    limits: ServeLimits = field(default_factory=ServeLimits)
    tool_parser: ToolCallParser | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    allow_client_chat_template: bool = False
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    load: Callable[[Path, str], ServedModel] = load_served_model


def build_app(
    checkpoint: str | Path | ServedModel,
    *,
    token: str | None = None,
    allow_root: str | Path | None = None,
    batch_window_ms: float = 5.0,
    max_batch_prompts: int = 256,
    device: str = "auto",
    limits: ServeLimits | None = None,
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS,
    served_model_names: list[str] | tuple[str, ...] | None = None,
    tool_call_parser: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    allow_client_chat_template: bool = False,
    request_log: Callable[[str], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving `checkpoint` (a checkpoint, a run folder, a Hugging Face model folder
    or hub id: engines/serve_sources.py; or an already loaded ServedModel).

    token: if set, every request needs `Authorization: Bearer <token>`.
    allow_root: folder that /update_weights_from_disk may load from (default: the folder
    holding `checkpoint`, i.e. `<run_dir>/checkpoints`).
    limits: request caps (engines.request_pipeline.ServeLimits). allowed_hosts: Host header names
    accepted (None = any); loopback names by default, against DNS rebinding.
    served_model_names: the names `model` may take and /v1/models lists (default: the
    checkpoint path as given). tool_call_parser: the name of a models/tool_calls.py parser that
    turns tool calls in chat replies into `tool_calls` (None: never parsed).
    chat_template_kwargs: passed to every chat rendering, under a request's own.
    allow_client_chat_template: accept a request's `chat_template` (rendered in a thread).
    request_log: where each request's log line goes (engines/access_log.py; None: nowhere).
    """
    limits = limits or ServeLimits()
    names = tuple(served_model_names or ())
    if any(not isinstance(n, str) or not n.strip() for n in names):
        raise ValueError(f"served model names must be non-empty strings, got {list(names)}")
    parser = get_parser(tool_call_parser) if tool_call_parser else None
    served = (
        checkpoint if isinstance(checkpoint, ServedModel) else load_served_model(checkpoint, device)
    )
    root = Path(allow_root) if allow_root is not None else served.path.resolve().parent
    if not root.is_dir():
        raise ValueError(f"allow_root {str(root)!r} is not a directory")
    slot = ModelSlot(served)
    state = ServerState(
        slot=slot,
        batcher=Batcher(slot, batch_window_ms / 1000.0, max_batch_prompts, limits.chunk_sequences),
        served_names=names or (str(checkpoint if not isinstance(checkpoint, ServedModel) else served.path),),
        allow_root=root.resolve(),
        device=device,
        limits=limits,
        tool_parser=parser,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        allow_client_chat_template=allow_client_chat_template,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await state.batcher.stop()

    app = FastAPI(title="rlpipe serve", lifespan=lifespan)
    app.state.rlpipe = state
    app.add_middleware(Guard, token=token, allowed_hosts=allowed_hosts)
    if request_log is not None:  # outermost: refused requests are logged too
        app.add_middleware(RequestLog, write=request_log)

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, exc: RequestError):
        return _error(exc.status, str(exc))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        current = state.slot.current
        return {
            "status": "ok",
            "policy_version": current.policy_version,
            "checkpoint": str(current.path),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        current = state.slot.current
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rlpipe",
                    "root": str(current.path),
                    "max_model_len": current.max_model_len,
                    "policy_version": current.policy_version,
                }
                for name in state.served_names
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, state.limits, CompletionRequest)
        current = state.slot.current
        try:
            params = req.sampling_params(end_of_turn_ids(current.tokenizer))
        except ValueError as err:
            raise RequestError(str(err)) from err
        model = check_model(req.model, state)
        prompts = prompt_token_ids(req.prompt, current.tokenizer, current.vocab_size)
        check_request_limits(prompts, params, state.limits, current.max_model_len)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model}
        n_prompt = sum(len(p) for p in prompts)
        if req.stream and not req.logprobs:  # live: each token's chunk as it is sampled
            chunks = completion_chunks(live_events(state, prompts, params), head, current.tokenizer, req,
                                       params.n, n_prompt)
            return StreamingResponse(sse(chunks), media_type="text/event-stream")
        groups, served = await sample(request, state, prompts, params)
        tok, eos = served.tokenizer, end_of_turn_ids(served.tokenizer)
        finished = await asyncio.to_thread(finish_all, [c for group in groups for c in group], tok, req.stop_strings,
                                           eos, skip_special_tokens=req.skip_special_tokens,
                                           include_stop=req.include_stop_str_in_output)
        tops = None
        if req.logprobs:  # k >= 1: one scoring pass; logprobs=0 needs only the sampled token's
            sequences = [(prompts[i // params.n], done.tokens) for i, done in enumerate(finished)]
            tops = await top_of(request, state, served, sequences, req.logprobs, params)
        if req.stream:  # top log-probs need the whole completion: its replay, in the same chunks
            chunks = completion_chunks(replay_events(groups, served), head, tok, req, params.n, n_prompt, tops)
            return StreamingResponse(sse(chunks), media_type="text/event-stream")
        choices = [completion_choice(i, done, tok, req, tops[i] if tops else None)
                   for i, done in enumerate(finished)]
        if req.prompt_logprobs is not None:  # the same list on each of a prompt's n choices, as vLLM
            scored = await prompt_logprobs_of(request, state, served, prompts, req.prompt_logprobs)
            entries = [prompt_logprobs_entries(p, s, tok) for p, s in zip(prompts, scored, strict=True)]
            for i, choice in enumerate(choices):
                choice["prompt_logprobs"] = entries[i // params.n]
        answer_usage = usage(n_prompt, sum(len(done.tokens) for done in finished))
        return {**head, "choices": choices, "usage": answer_usage, "policy_version": served.policy_version}

    add_chat_completions(app, state)  # POST /v1/chat/completions

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await read_request(request, state.limits, TokenizeRequest)
        check_model(req.model, state)
        current = state.slot.current
        ids = current.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"count": len(ids), "max_model_len": current.max_model_len, "tokens": list(ids)}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await read_request(request, state.limits, ReloadRequest)
        path = resolve_model_path(body.model_path, state.allow_root)
        async with state.reload_lock:  # one reload at a time; generation goes on meanwhile
            start = time.perf_counter()
            version = weight_version(body.weight_version)
            try:
                new = await asyncio.to_thread(state.load, path, state.device)
            except ValueError as err:
                raise RequestError(
                    f"model_path {body.model_path!r} is not a valid checkpoint: {err}"
                ) from err
            if version is not None:  # the trainer's count for these weights wins over the folder's
                new.engine.sync(None, version)
                new.policy_version = version
            await asyncio.to_thread(state.slot.swap, new)
        return {
            "success": True,
            "message": f"loaded {str(path)!r} (policy_version {new.policy_version}) in "
            f"{time.perf_counter() - start:.2f}s",
            "policy_version": new.policy_version,
            "num_paused_requests": 0,
        }

    return app
