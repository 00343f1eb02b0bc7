"""tests/ports.py: a server whose port was taken between the pick and its bind is started again on
a fresh port (bounded, every refused port named); a server failing for another reason is not; a
held closed port refuses connections and cannot be taken."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from rlpipe.core.ports import free_port

import tests.ports as ports
from tests.ports import PortTaken, closed_port, says_port_taken, start_on_free_port
from tests.prefect_server import stop_group, wait_healthy

# a real HTTP server on the port it is given: answers 200 everywhere, or dies binding a taken port
SERVER = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def starter(tmp_path: Path, tried: list[int], code: str = SERVER):
    def start(port: int) -> subprocess.Popen:
        tried.append(port)
        log = tmp_path / f"server-{port}.log"
        server = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=log.open("w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server, log, start_s=60, name="test server")
        except BaseException:
            stop_group(server)
            raise
        return server
    return start


@pytest.fixture
def taken():
    """A loopback port another socket holds (bound, so no server can bind it)."""
    with closed_port() as port:
        yield port


def test_a_port_taken_before_the_server_binds_is_replaced_by_a_fresh_one(tmp_path, monkeypatch, taken):
    picks = iter([taken])
    monkeypatch.setattr(ports, "free_port", lambda: next(picks, None) or free_port())
    tried: list[int] = []
    port, server = start_on_free_port(starter(tmp_path, tried))
    try:
        assert tried == [taken, port] and port != taken
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).text == "ok"
        assert says_port_taken((tmp_path / f"server-{taken}.log").read_text())
    finally:
        stop_group(server)


def test_tries_are_bounded_and_each_taken_port_is_named(tmp_path, monkeypatch, taken):
    monkeypatch.setattr(ports, "free_port", lambda: taken)
    tried: list[int] = []
    with pytest.raises(AssertionError, match="no server started in 2 tries") as failure:
        start_on_free_port(starter(tmp_path, tried), tries=2)
    assert tried == [taken, taken]
    assert str(failure.value).count(f"port {taken}:") == 2
    assert "already in use" in str(failure.value).lower()


def test_a_server_failing_for_another_reason_is_not_started_again(tmp_path):
    tried: list[int] = []
    with pytest.raises(AssertionError, match="test server exited") as failure:
        start_on_free_port(starter(tmp_path, tried, code="raise SystemExit('no model here')"))
    assert not isinstance(failure.value, PortTaken)
    assert len(tried) == 1


def test_a_held_closed_port_refuses_connections_and_cannot_be_taken():
    with closed_port() as port:
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))
