"""`rlpipe serve`'s command line: options, token, Host allowlist and limits → engines.server's app.

    rlpipe serve CHECKPOINT [--port N] [--token-file F] [--allow-host NAME] [--max-n N] ...

The first stdout line names the address (`listening on http://HOST:PORT`), so scripts and tests
can pass --port 0 and read the port back.
"""

from __future__ import annotations

import argparse
import socket
import sys

import torch
from rlpipe.engines.http import read_token
from rlpipe.engines.protocol import LOOPBACK_HOSTS, ServeLimits
from rlpipe.engines.server import DEFAULT_PORT, TOKEN_ENV, build_app

LIMIT_HELP = {
    "max_n": "completions per prompt at most",
    "max_tokens": "max_tokens of a request at most (prompt + max_tokens must also fit the context)",
    "max_prompts": "prompts in one request at most",
    "max_body_bytes": "request body size at most",
    "chunk_sequences": "a request is generated in engine calls of at most this many sequences, so "
    "other requests and weight updates take turns with a long one",
    "request_timeout_s": "seconds before an unanswered request gets 504 and its work is dropped",
}


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
    parser.add_argument("checkpoint", help="checkpoint folder (<run_dir>/checkpoints/step_N)")
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
    defaults = ServeLimits()
    for name, kind in (("max_n", int), ("max_tokens", int), ("max_prompts", int), ("max_body_bytes", int),
                       ("chunk_sequences", int), ("request_timeout_s", float)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name),
                            help=f"{LIMIT_HELP[name]} (default {getattr(defaults, name)})")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available) | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rlpipe serve`; returns the exit status."""
    import uvicorn

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        token = read_token(args.token_file, TOKEN_ENV) if args.token is None or args.token_file else args.token
        limits = ServeLimits(**{name: getattr(args, name) for name in LIMIT_HELP})
    except ValueError as err:
        print(f"rlpipe serve: {err}", file=sys.stderr)
        return 2
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
            args.checkpoint,
            token=token,
            allow_root=args.allow_root,
            batch_window_ms=args.batch_window_ms,
            max_batch_prompts=args.max_batch_prompts,
            device=args.device,
            limits=limits,
            allowed_hosts=allowed_hosts(args.allow_host, args.host),
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
