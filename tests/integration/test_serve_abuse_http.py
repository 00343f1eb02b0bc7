"""A real `rlpipe serve` process against clients that never finish a request: headers sent a byte
at a time or never completed are cut off after --header-timeout-s, a body never completed gets
408 after --body-timeout-s, and the server answers others meanwhile. Also the command line's
token checks (an empty token exits 2, a token file others can read is warned about, a request
without the file's token gets 401) and its caps (--max-n, --max-tokens, --max-prompts,
--max-body-bytes: one past each is refused naming the flag, a request within them answered).

All traffic stays on 127.0.0.1; every wait is bounded; the server is killed in a finally."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rlpipe.engines.serve_process import ROOT, serve_url, start_serve, stop_processes
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import save_checkpoint

from tests import warm_cli
from tests.serve_sockets import closed_within, read_answer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = build_tokenizer()
    return save_checkpoint(tmp_path_factory.mktemp("run"), 0, build_model("tiny-dense", vocab_size=len(tok), seed=0),
                           tok)


def wait_ready(url: str, limit_s: float = 60.0) -> None:
    """Until /health answers (the socket is bound before the server listens on it)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_half_sent_requests_are_cut_off(checkpoint):
    proc = start_serve(checkpoint, "--header-timeout-s", "1", "--body-timeout-s", "1", popen=warm_cli.Popen)
    try:
        url = serve_url(proc)
        wait_ready(url)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        address = (host, int(port))
        # headers never finished
        stuck = socket.create_connection(address)
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        # headers trickling in a byte every 0.2 s (each byte would restart a keep-alive timer)
        trickle = socket.create_connection(address)
        start = time.perf_counter()
        closed_at = None
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200:
            try:
                trickle.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.perf_counter() - start
                break
            time.sleep(0.2)
            if time.perf_counter() - start > 8:
                break
        # a body never finished
        body = socket.create_connection(address)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = read_answer(body, 10)
        # meanwhile (and afterwards) the server answers everyone else
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert closed_within(stuck, 10) is not None
        assert closed_at is not None and closed_at < 5, closed_at
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_s=1" in answer
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
        for sock in (stuck, trickle, body):
            sock.close()
    finally:
        stop_processes([proc])


def test_token_and_cap_flags_of_the_command_line(checkpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RLPIPE_API_TOKEN"}
    command = [sys.executable, "-m", "rlpipe.flows.cli", "serve", str(checkpoint), "--port", "0", "--threads", "1"]
    empty = warm_cli.run([*command, "--token", ""], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "--token is empty" in empty.stderr
    # the same command line without the CLI's other imports (faster)
    serve = [sys.executable, "-m", "rlpipe.engines.serve_cli", *command[4:]]
    blank = warm_cli.run(serve, cwd=ROOT, env={**env, "RLPIPE_API_TOKEN": " "}, capture_output=True, text=True,
                         timeout=120)
    assert blank.returncode == 2 and "RLPIPE_API_TOKEN is set but empty" in blank.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    token_file.chmod(0o644)
    caps = ["--max-n", "2", "--max-tokens", "3", "--max-prompts", "2", "--max-body-bytes", "1500"]
    proc = warm_cli.Popen([*command, "--token-file", str(token_file), *caps], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = serve_url(proc)
        wait_ready(url)
        auth = {"Authorization": "Bearer s3cret"}
        within = {"prompt": [[5, 6], [7]], "n": 2, "max_tokens": 3}
        assert httpx.get(f"{url}/health", timeout=5).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=within, timeout=30).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=within, headers={"Authorization": "Bearer wrong"},
                          timeout=30).status_code == 401
        assert httpx.get(f"{url}/health", headers=auth, timeout=5).status_code == 200
        answer = httpx.post(f"{url}/v1/completions", json=within, headers=auth, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 4, answer.text
        # each cap as set on the command line, one past it refused with its flag named
        for body, status, words in (({**within, "n": 3}, 400, "max_n=2 (--max-n)"),
                                    ({**within, "max_tokens": 4}, 400, "max_tokens=3 (--max-tokens)"),
                                    ({**within, "prompt": [[5]] * 3}, 400, "max_prompts=2 (--max-prompts)"),
                                    ({**within, "prompt": [[5] * 1000]}, 413, "max_body_bytes=1500 (--max-body-bytes)")):
            refused = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
            assert refused.status_code == status and words in refused.json()["error"]["message"], refused.text
    finally:
        stop_processes([proc])
        warning = proc.stderr.read()
        proc.stderr.close()
    assert "readable by other users (mode 644)" in warning
