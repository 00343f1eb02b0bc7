"""`rlpipe serve`'s connections, on a real uvicorn in a thread with the command's protocol
(engines/serve_cli.py `header_deadline_protocol`): a request whose headers arrived in time is
answered however long it takes, including when headers and body come in one write (as curl and
`requests` send them) and on a kept-alive connection; an idle connection is still closed at the
header deadline; a request whose client has gone stops its engine call between two decode steps.
Engine-level cancellation: tests/unit/test_engine.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from rlpipe.engines.decode_loop import GenerationCancelled
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.serve_cli import header_deadline_protocol

from tests.serve_sockets import closed_within, read_answer, serving
from tests.unit.test_server import ckpt, run_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow  # a server in a thread and requests of a few seconds

HEADER_TIMEOUT_S = 1.0


class SlowEngine:
    """The slot's generate, taking `seconds` in decode steps of 20 ms and honouring `cancelled`
    as the torch engine does; it records how each call ended."""

    def __init__(self, app, seconds: float) -> None:
        self.slot = app.state.rlpipe.slot
        self.real, self.seconds = self.slot.generate, seconds
        self.started, self.ended = threading.Event(), threading.Event()
        self.outcomes: list[str] = []
        self.slot.generate = self

    def __call__(self, prompts, params, pinned=None, on_token=None, cancelled=None):
        self.started.set()
        try:
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                if cancelled is not None and cancelled():
                    self.outcomes.append("cancelled")
                    raise GenerationCancelled("cancelled")
                time.sleep(0.02)
            self.outcomes.append("finished")
            return self.real(prompts, params, pinned, on_token, cancelled)
        finally:
            self.ended.set()


def one_write(route: str, body: dict) -> bytes:
    """A keep-alive POST whose headers and body are one buffer, sent by one sendall."""
    data = json.dumps(body).encode()
    return (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def deadline_server(app):
    """`app` with the serve command's header deadline (uvicorn's own idle keep-alive timer set
    far away, so any close seen here is the header deadline's)."""
    return serving(app, http=header_deadline_protocol(HEADER_TIMEOUT_S), timeout_keep_alive=60)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}),
])
def test_a_request_sent_in_one_write_is_answered_past_the_header_deadline(run_dir, route, body):  # noqa: F811
    app = build_app(ckpt(run_dir, 0), batch_window_ms=0)
    SlowEngine(app, seconds=2.5 * HEADER_TIMEOUT_S)
    with deadline_server(app) as address, socket.create_connection(address) as sock:
        for _ in range(2):  # the second on the same kept-alive connection
            start = time.perf_counter()
            sock.sendall(one_write(route, body))
            answer = read_answer(sock, 30)
            took = time.perf_counter() - start
            assert answer.startswith(b"HTTP/1.1 200"), (took, answer[:200])
            assert took > 2 * HEADER_TIMEOUT_S
        # idle after its answer: the header deadline holds again
        idle = closed_within(sock, 10)
        assert idle is not None and idle < 3 * HEADER_TIMEOUT_S, idle


def test_a_client_gone_mid_generation_stops_the_engine_call(run_dir):  # noqa: F811
    app = build_app(ckpt(run_dir, 0), batch_window_ms=0)
    engine = SlowEngine(app, seconds=60)
    with deadline_server(app) as address:
        sock = socket.create_connection(address)
        sock.sendall(one_write("/v1/completions", {"prompt": "1+1=", "max_tokens": 2}))
        assert engine.started.wait(30)
        gone_at = time.monotonic()
        sock.close()
        assert engine.ended.wait(30)
        stopped_after = time.monotonic() - gone_at
    assert engine.outcomes == ["cancelled"]
    assert stopped_after < 5, stopped_after
