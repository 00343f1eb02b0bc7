"""`rlpipe serve`: the torch engine behind an OpenAI-compatible HTTP API, with weight reload.

    rlpipe serve runs/demo/checkpoints/step_000010 --port 8001 [--token T] [--allow-root DIR]

Endpoints (all need `Authorization: Bearer <token>` when the server has a token; 401 otherwise):

    POST /v1/completions          OpenAI completions; `prompt` is text, a list of texts, token ids
                                  (list[int]) or a batch of token ids (list[list[int]]).
                                  Sampling: n, max_tokens, temperature (0 = greedy), top_p, top_k
                                  (0 or -1 = off), seed, stop_token_ids, logprobs.
    POST /v1/chat/completions     OpenAI chat completions with vLLM's token ids and log-probs
                                  (engines/chat_api.py)
    GET  /health                  {"status": "ok", "policy_version": k, "checkpoint": path}
    GET  /v1/models               the served model (id = the first checkpoint's path)
    POST /update_weights_from_disk {"model_path": DIR} (SGLang's shape): load a checkpoint and
                                  answer {"success": true, "message": ..., "policy_version": k}

Response extensions (mirroring vLLM's `return_token_ids` / `return_tokens_as_token_ids`):
`choices[i].token_ids` holds the completion's token ids (a final stop token included), and with
`logprobs` set, `choices[i].logprobs.token_logprobs` holds the log-prob of each of them under
softmax(logits / temperature), untruncated (engines/base.py's convention), with
`logprobs.tokens` as "token_id:<id>" strings when `return_tokens_as_token_ids` is true.
`top_logprobs` is always null (not computed). The response also carries `policy_version`.
Choice `index` = prompt index × n + sample index, as in OpenAI and vLLM.

Batching: requests go through a queue; a worker takes the first one, waits up to
`batch_window_ms` for more, and runs each group of requests with identical sampling
parameters as one `TorchEngine.generate` call. A request with an explicit `seed` is never merged
with another, so its completions equal the in-process engine's for that seed and prompts
(sampling draws depend on the batch a prompt is decoded in).

Weight reload: the checkpoint is loaded and verified (sha256) while the old weights keep serving,
then swapped in under the lock that generation holds, so a generate call sees either the old
or the new weights, never a mix. A path outside the allowed root (after resolving symlinks) is
refused with 403, an invalid checkpoint with 400; either way the old weights stay in service.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from engines.base import Completion, SamplingParams
from engines.serving import (
    Batcher,
    ModelSlot,
    ServedModel,
    group_jobs,  # noqa: F401 - re-exported: callers and tests import it from here
    load_served_model,
)

DEFAULT_PORT = 8000
TOKEN_ENV = "RLPIPE_API_TOKEN"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


# ----------------------------------------------------------------------------- requests


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class CompletionRequest(BaseModel):
    """The accepted fields of POST /v1/completions (unknown fields are refused by name)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    n: int = 1
    max_tokens: int = 16
    temperature: float | int = 1.0
    top_p: float | int = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = True
    ignore_eos: bool = True
    stream: bool = False
    echo: bool = False
    stop: str | list[str] | None = None
    user: str | None = None

    @field_validator("stream", "echo")
    @classmethod
    def _not_supported(cls, value: bool, info) -> bool:
        if value:
            raise ValueError(f"{info.field_name}=true is not supported by rlpipe serve")
        return value

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, value):
        if value:
            raise ValueError("stop strings are not supported; pass stop_token_ids")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {value}")
        return value

    def sampling_params(self) -> SamplingParams:
        """Our SamplingParams (ValueError names the bad field)."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        greedy = self.temperature == 0
        return SamplingParams(
            n=self.n,
            temperature=1.0 if greedy else float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            max_new_tokens=self.max_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.seed,
            greedy=greedy,
        )


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


def completion_choice(
    index: int, completion: Completion, tokenizer: Any, logprobs: int | None, as_token_ids: bool
) -> dict[str, Any]:
    """One OpenAI choice, with the token-id and log-prob extensions (see module docstring)."""
    choice: dict[str, Any] = {
        "index": index,
        "text": tokenizer.decode(completion.tokens, skip_special_tokens=True),
        "finish_reason": completion.finish_reason,
        "token_ids": list(completion.tokens),
        "logprobs": None,
    }
    if logprobs is not None:
        pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in completion.tokens]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        choice["logprobs"] = {
            "tokens": [f"token_id:{t}" for t in completion.tokens] if as_token_ids else pieces,
            "token_logprobs": [float(x) for x in completion.logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return choice


def resolve_model_path(model_path: Any, allow_root: Path) -> Path:
    """The resolved checkpoint folder, if inside `allow_root` (symlinks resolved first).

    RequestError 400 for a missing or non-folder path, 403 for one outside the root.
    """
    if not isinstance(model_path, str) or not model_path:
        raise RequestError("model_path must be a non-empty string")
    try:
        resolved = Path(model_path).resolve(strict=True)
    except (OSError, RuntimeError) as err:
        raise RequestError(f"model_path {model_path!r} does not exist: {err}") from err
    if not resolved.is_relative_to(allow_root):
        raise RequestError(
            f"model_path {model_path!r} resolves outside the allowed root {str(allow_root)!r}", 403
        )
    if not resolved.is_dir():
        raise RequestError(f"model_path {model_path!r} is not a directory")
    return resolved


def _error(status: int, message: str) -> JSONResponse:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        where = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"request body is not valid JSON: {err}") from err


# ----------------------------------------------------------------------------- the app


@dataclass
class ServerState:
    """Everything a request handler needs (kept on `app.state.rlpipe`)."""

    slot: ModelSlot
    batcher: Batcher
    model_name: str
    allow_root: Path
    device: str
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
) -> FastAPI:
    """The FastAPI app serving `checkpoint` (a folder, or an already loaded ServedModel).

    token: if set, every request needs `Authorization: Bearer <token>`.
    allow_root: folder that /update_weights_from_disk may load from (default: the folder
    holding `checkpoint`, i.e. `<run_dir>/checkpoints`).
    """
    served = (
        checkpoint if isinstance(checkpoint, ServedModel) else load_served_model(checkpoint, device)
    )
    root = Path(allow_root) if allow_root is not None else served.path.resolve().parent
    if not root.is_dir():
        raise ValueError(f"allow_root {str(root)!r} is not a directory")
    slot = ModelSlot(served)
    state = ServerState(
        slot=slot,
        batcher=Batcher(slot, batch_window_ms / 1000.0, max_batch_prompts),
        model_name=str(served.path),
        allow_root=root.resolve(),
        device=device,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await state.batcher.stop()

    app = FastAPI(title="rlpipe serve", lifespan=lifespan)
    app.state.rlpipe = state
    expected = f"Bearer {token}".encode() if token else None

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        return await call_next(request)

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
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rlpipe",
                    "root": str(current.path),
                    "max_model_len": _max_len(current),
                    "policy_version": current.policy_version,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        try:
            req = CompletionRequest.model_validate(body)
            params = req.sampling_params()
        except ValidationError as err:
            raise RequestError(_validation_message(err)) from err
        except ValueError as err:
            raise RequestError(str(err)) from err
        if req.model is not None and req.model != state.model_name:
            raise RequestError(
                f"the model {req.model!r} does not exist; serving {state.model_name!r}", 404
            )
        current = state.slot.current
        prompts = prompt_token_ids(req.prompt, current.tokenizer, current.vocab_size)
        try:
            groups, served = await state.batcher.submit(prompts, params)
        except ValueError as err:  # the engine refused the prompts (e.g. a reload changed vocab)
            raise RequestError(str(err)) from err
        choices = [
            completion_choice(
                i * params.n + j, c, served.tokenizer, req.logprobs, req.return_tokens_as_token_ids
            )
            for i, group in enumerate(groups)
            for j, c in enumerate(group)
        ]
        n_prompt = sum(len(p) for p in prompts)
        n_completion = sum(len(c["token_ids"]) for c in choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion,
            },
            "policy_version": served.policy_version,
        }

    from engines.chat_api import add_chat_completions  # here: chat_api imports this module

    add_chat_completions(app, state)  # POST /v1/chat/completions

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        if not isinstance(body, dict) or "model_path" not in body:
            raise RequestError('body must be a JSON object with "model_path"')
        path = resolve_model_path(body["model_path"], state.allow_root)
        async with state.reload_lock:  # one reload at a time; generation goes on meanwhile
            start = time.perf_counter()
            try:
                new = await asyncio.to_thread(state.load, path, state.device)
            except ValueError as err:
                raise RequestError(
                    f"model_path {body['model_path']!r} is not a valid checkpoint: {err}"
                ) from err
            await asyncio.to_thread(state.slot.swap, new)
        return {
            "success": True,
            "message": f"loaded {str(path)!r} (policy_version {new.policy_version}) in "
            f"{time.perf_counter() - start:.2f}s",
            "policy_version": new.policy_version,
            "num_paused_requests": 0,
        }

    return app


def _max_len(served: ServedModel) -> int | None:
    value = getattr(served.engine.model.config, "max_position_embeddings", None)
    return int(value) if value is not None else None


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlpipe serve",
        description="Serve a checkpoint with the torch engine behind an OpenAI-style HTTP API.",
    )
    parser.add_argument("checkpoint", help="checkpoint folder (<run_dir>/checkpoints/step_N)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0 = a free port, printed at start)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"bearer token every request must carry (default: ${TOKEN_ENV} if set)",
    )
    parser.add_argument(
        "--allow-root",
        default=None,
        help="folder /update_weights_from_disk may load from "
        "(default: the folder holding CHECKPOINT)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long the batcher waits for more requests to merge (default 5)",
    )
    parser.add_argument(
        "--max-batch-prompts",
        type=int,
        default=256,
        help="sequences (prompts x n) merged into one engine call at most",
    )
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available) | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rlpipe serve`; returns the exit status."""
    import uvicorn

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.host not in _LOOPBACK and not token:
        print(
            f"rlpipe serve: warning: listening on {args.host} without a token; anyone who can "
            "reach it can sample and load checkpoints",
            file=sys.stderr,
        )
    try:
        app = build_app(
            args.checkpoint,
            token=token,
            allow_root=args.allow_root,
            batch_window_ms=args.batch_window_ms,
            max_batch_prompts=args.max_batch_prompts,
            device=args.device,
        )
    except ValueError as err:
        print(f"rlpipe serve: {err}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        print(f"rlpipe serve: cannot bind {args.host}:{args.port}: {err}", file=sys.stderr)
        sock.close()
        return 2
    port = sock.getsockname()[1]
    served = app.state.rlpipe.slot.current
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    # The first stdout line names the address (tests and scripts read it when --port 0).
    print(
        f"rlpipe serve: listening on http://{host}:{port} (policy_version "
        f"{served.policy_version}, {served.path})",
        flush=True,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
