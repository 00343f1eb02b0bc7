"""`rlpipe serve`'s command line: options, token, Host allowlist and limits → engines.serve_app's app.

    rlpipe serve MODEL [--port N] [--token-file F] [--allow-host NAME] [--max-n N] ...
        [--served-model-name NAME ...] [--tool-call-parser hermes|calculator]
        [--chat-template-kwargs JSON] [--allow-client-chat-template] [--no-request-log]

MODEL: a checkpoint folder, a run folder (its newest checkpoint), a Hugging Face model folder or a
hub id (engines/serve_sources.py). One line per request on stderr (engines/access_log.py).

Connections: request headers must be complete within --header-timeout-s of a connection opening
(or of its previous response), and once they are in, the request is never cut by that deadline
however long its answer takes; bodies within --body-timeout-s (408), a request's headers within
16 KiB (h11 answers 400 past it), and an idle keep-alive connection is closed after 5 s. An empty token (--token "", a blank
$RLPIPE_API_TOKEN) is refused rather than turning authentication off; a token file that other
users can read gets a warning.

The first stdout line names the address (`listening on http://HOST:PORT`), so scripts and tests
can pass --port 0 and read the port back.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import h11
import torch
from rlpipe.engines.access_log import to_stderr
from rlpipe.engines.http import read_token
from rlpipe.engines.request_pipeline import LOOPBACK_HOSTS, ServeLimits
from rlpipe.engines.serve_app import DEFAULT_PORT, TOKEN_ENV, build_app
from rlpipe.engines.serve_sources import served_source
from rlpipe.models.tool_calls import PARSERS

MAX_HEADER_BYTES = 16 * 1024  # h11's default, set explicitly: a request's header block at most

LIMIT_HELP = {
    "max_n": "completions per prompt at most",
    "max_tokens": "max_tokens of a request at most (prompt + max_tokens must also fit the context)",
    "max_prompts": "prompts in one request at most",
    "max_body_bytes": "request body size at most",
    "chunk_sequences": "a request is generated in engine calls of at most this many sequences, so "
    "other requests and weight updates take turns with a long one",
    "request_timeout_s": "seconds before an unanswered request gets 504 and its work is dropped",
    "body_timeout_s": "seconds a request body may take to arrive before 408",
    "header_timeout_s": "seconds a connection may take to send complete request headers before it is closed",
}


def header_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    `timeout_s` after it opened or after its previous response (uvicorn's own keep-alive timer
    restarts on every byte, so a client sending a header a byte at a time would hold it).

    The deadline is for headers only: once a request's headers are in (its request cycle is open),
    the timer is off until its response is complete, however long the answer takes. A client that
    sends headers and body in one write (curl, `requests`) leaves h11's state at DONE right away,
    so the open cycle, not h11's state, is what says a request is in flight."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: Any = None

        def _in_flight(self) -> bool:
            """A request whose headers arrived and whose response is not complete."""
            return self.cycle is not None and not self.cycle.response_complete

        def _waiting_for_headers(self) -> bool:
            return not self._in_flight() and self.conn.their_state in (h11.IDLE, h11.DONE)

        def _arm(self) -> None:
            self._disarm()
            if self._waiting_for_headers():
                self._header_timer = self.loop.call_later(timeout_s, self._headers_overdue)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already received
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:  # type: ignore[override]
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


def check_token_file(path: str) -> str | None:
    """A warning when the token file can be read by its group or others, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # read_token names the problem
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        return (f"warning: the token file {path!r} is readable by other users (mode {stat.S_IMODE(mode):o}); "
                f"chmod 600 {path}")
    return None


def server_token(token: str | None, token_file: str) -> str | None:
    """The bearer token: --token-file, else --token, else ${TOKEN_ENV}; ValueError for an empty
    one (an empty token would silently turn authentication off)."""
    if token_file:
        return read_token(token_file, TOKEN_ENV)
    if token is not None:
        if not token.strip():
            raise ValueError("--token is empty; give a token, or leave --token out to serve without one")
        return token.strip()
    if TOKEN_ENV in os.environ and not os.environ[TOKEN_ENV].strip():
        raise ValueError(f"${TOKEN_ENV} is set but empty; unset it to serve without a token")
    return read_token("", TOKEN_ENV)


def template_kwargs(text: str) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object; ValueError naming the flag otherwise."""
    try:
        value = json.loads(text) if text else {}
    except ValueError as err:
        raise ValueError(f"--chat-template-kwargs is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    return value


def run_template_kwargs(checkpoint: str) -> dict[str, Any]:
    """The `model.chat_template_kwargs` of the run a checkpoint was saved by (its
    `RUN/checkpoints/step_N` folder's RUN/config.json), so a served model renders chats as it was
    trained to; {} for a checkpoint outside a run folder or a run without them."""
    config = Path(checkpoint).expanduser().parent.parent / "config.json"
    try:
        kwargs = json.loads(config.read_text()).get("model", {}).get("chat_template_kwargs")
    except (OSError, ValueError, AttributeError):
        return {}
    return dict(kwargs) if isinstance(kwargs, dict) else {}


def allowed_hosts(names: list[str] | None, bind_host: str) -> tuple[str, ...] | None:
    """The Host allowlist: the names given ('*' = any), else loopback and the bind address."""
    if names:
        return None if "*" in names else tuple(n.lower() for n in names)
    extra = () if bind_host in ("0.0.0.0", "::", "") else (bind_host.lower(),)
    return tuple(dict.fromkeys(LOOPBACK_HOSTS + extra))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlpipe serve",
        description="Serve a checkpoint with the torch engine behind an OpenAI-style HTTP API.",
    )
    parser.add_argument("checkpoint", metavar="MODEL",
                        help="a checkpoint folder (<run_dir>/checkpoints/step_N), a run folder (its newest "
                        "checkpoint; a pipeline's RL phase first), a registered version models:/NAME@ALIAS or "
                        "models:/NAME/VERSION, a Hugging Face model folder, or a hub id ORG/NAME[@REVISION]")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0 = a free port, printed at start)",
    )
    parser.add_argument(
        "--token-file",
        default="",
        help=f"file whose first line is the bearer token every request must carry "
        f"(default: ${TOKEN_ENV} if set; a file keeps it out of `ps` and shell history)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="bearer token on the command line (visible to other users in `ps`: prefer --token-file)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host header name to accept (repeatable; default: localhost, 127.0.0.1, ::1 and "
        "the bind address; '*' = any). Guards against DNS rebinding from web pages.",
    )
    parser.add_argument(
        "--allow-root",
        default=None,
        help="folder /update_weights_from_disk may load from "
        "(default: the folder holding the served checkpoint or model)",
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
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the names clients call the model by, listed by /v1/models (default: "
                        "MODEL as given)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="parse tool calls of chat replies into `tool_calls` with this format "
                        "(models/tool_calls.py; default: never)")
    parser.add_argument("--chat-template-kwargs", default="", metavar="JSON",
                        help="a JSON object passed to every chat template rendering, under a "
                        "request's own chat_template_kwargs (e.g. '{\"enable_thinking\": false}'; default: the "
                        "model.chat_template_kwargs of the run that saved the served checkpoint)")
    parser.add_argument("--allow-client-chat-template", action="store_true",
                        help="accept a request's own chat template (refused by default: it is code "
                        "the server runs)")
    defaults = ServeLimits()
    for name, kind in (("max_n", int), ("max_tokens", int), ("max_prompts", int), ("max_body_bytes", int),
                       ("chunk_sequences", int), ("request_timeout_s", float), ("body_timeout_s", float),
                       ("header_timeout_s", float)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name),
                            help=f"{LIMIT_HELP[name]} (default {getattr(defaults, name)})")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available) | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--runs-root", default="runs",
                        help="the runs root whose MLflow registry (mlflow.db) a models:/ MODEL is read from, "
                        "unless $MLFLOW_TRACKING_URI is set (default: runs)")
    parser.add_argument("--no-request-log", action="store_true",
                        help="no log line per request (default: one on stderr with the client, method, path, "
                        "status, tokens and seconds)")
    return parser.parse_args(argv)


LISTEN_BACKLOG = 2048  # uvicorn's own default
SOURCE_NOTES = {"checkpoint": "", "run": ": the run folder's newest checkpoint", "model": ": a Hugging Face model",
                "hub": ": the hub model's cached snapshot", "registry": ": the registered version's files"}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rlpipe serve`; returns the exit status."""
    import uvicorn

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        token = server_token(args.token, args.token_file)
        limits = ServeLimits(**{name: getattr(args, name) for name in LIMIT_HELP})
        source = served_source(args.checkpoint, args.runs_root)
        kwargs = (template_kwargs(args.chat_template_kwargs) if args.chat_template_kwargs
                  else run_template_kwargs(source.path) if source.is_checkpoint else {})
    except ValueError as err:
        print(f"rlpipe serve: {err}", file=sys.stderr)
        return 2
    warning = check_token_file(args.token_file) if args.token_file else None
    if warning:
        print(f"rlpipe serve: {warning}", file=sys.stderr)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.host not in LOOPBACK_HOSTS and not token:
        print(
            f"rlpipe serve: warning: listening on {args.host} without a token; anyone who can "
            "reach it can sample and load checkpoints",
            file=sys.stderr,
        )
    try:
        app = build_app(
            source.path,
            token=token,
            allow_root=args.allow_root,
            batch_window_ms=args.batch_window_ms,
            max_batch_prompts=args.max_batch_prompts,
            device=args.device,
            limits=limits,
            allowed_hosts=allowed_hosts(args.allow_host, args.host),
            served_model_names=args.served_model_name or [args.checkpoint],
            tool_call_parser=args.tool_call_parser,
            chat_template_kwargs=kwargs,
            allow_client_chat_template=args.allow_client_chat_template,
            request_log=None if args.no_request_log else to_stderr,
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
    # Listening before the ready line: a client that connects as soon as it reads the line is
    # accepted (the kernel queues it until uvicorn's loop takes it), never refused.
    sock.listen(LISTEN_BACKLOG)
    # The first stdout line names the address (tests and scripts read it when --port 0).
    print(
        f"rlpipe serve: listening on http://{host}:{port} (policy_version "
        f"{served.policy_version}, {served.path}{SOURCE_NOTES[source.kind]})",
        flush=True,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            http=header_deadline_protocol(limits.header_timeout_s),
                            timeout_keep_alive=5, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
