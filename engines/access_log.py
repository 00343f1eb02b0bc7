"""`rlpipe serve`'s request log: one line per request, as vLLM's server logs them, on stderr.

    rlpipe serve: 127.0.0.1:50312 "POST /v1/chat/completions" 200 prompt_tokens=14 completion_tokens=32 0.412s
    rlpipe serve: 127.0.0.1:50318 "GET /health" 200 - 0.001s

The line is written when the response is complete (a stream's last chunk sent), with the status
sent (500 when the app failed before sending one, 499 when the client left before the status).
Every route that generates records its token counts where it computes its `usage`
(engines/openai_output.py `usage`, also for a stream that does not send a usage chunk): a request
that generated nothing shows `-`. The counts travel in a ContextVar set around each request, so
concurrent requests never mix theirs. `rlpipe serve --no-request-log` turns the lines off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

_USAGE: ContextVar[dict[str, int] | None] = ContextVar("rlpipe_request_usage", default=None)


def record_usage(prompt_tokens: int, completion_tokens: int) -> None:
    """The current request's token counts, for its log line (outside a request: nothing)."""
    counts = _USAGE.get()
    if counts is not None:
        counts.update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def request_line(scope: dict[str, Any], status: int, counts: dict[str, int], seconds: float) -> str:
    """The log line of one request."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = scope.get("path", "")
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    tokens = (f"prompt_tokens={counts['prompt_tokens']} completion_tokens={counts['completion_tokens']}"
              if counts else "-")
    return f'rlpipe serve: {who} "{scope.get("method", "")} {path}" {status} {tokens} {seconds:.3f}s'


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RequestLog:
    """ASGI middleware, outermost: one `request_line` per HTTP request, through `write`."""

    def __init__(self, app: Any, write: Callable[[str], None] = to_stderr) -> None:
        self.app = app
        self.write = write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, counts, sent = time.perf_counter(), {}, {}
        token = _USAGE.set(counts)

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except OSError:
            sent.setdefault("status", 499)  # the client went away
            raise
        except BaseException:
            sent.setdefault("status", 500)
            raise
        finally:
            _USAGE.reset(token)
            self.write(request_line(scope, sent.get("status", 499), counts, time.perf_counter() - start))
