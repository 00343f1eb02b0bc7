"""What a client can do to `rlpipe serve`: every POST route goes through one request pipeline
(JSON content type, size, depth, text, sampling and field checks: a 4xx naming the field, never a
500, however the body is malformed); a client chat template is refused unless allowed, and then
rendered off the event loop under the request deadline; an empty token is refused and a token
file others can read is warned about. Connection deadlines: tests/integration/test_serve_abuse_http.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.request_pipeline import ServeLimits
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.serve_cli import check_token_file, main, server_token

from tests.unit.test_server import ckpt, run_dir  # noqa: F401 - fixtures

MESSAGES = [{"role": "user", "content": "12+30="}]
ROUTES = {
    "/v1/completions": {"prompt": "12+7=", "max_tokens": 2},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
    "/tokenize": {"prompt": "12+7="},
}
# a template that takes seconds to render on any CPU: 60M loop steps in the chat template's sandbox
# (15M took under the 0.5 s deadline on a fast core)
SLOW_TEMPLATE = ("{% for i in range(12000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


@pytest.fixture()
def client(run_dir):  # noqa: F811
    with TestClient(build_app(ckpt(run_dir, 0)), base_url="http://localhost") as c:
        yield c


@pytest.mark.parametrize("path", [*ROUTES, "/update_weights_from_disk"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_every_post_route_needs_a_json_content_type(client, path, kind):
    headers = {"Content-Type": kind} if kind else {}
    body = json.dumps(ROUTES.get(path, {"model_path": "x"}))
    response = client.post(path, content=body.encode(), headers=headers)
    assert response.status_code == 415, response.text
    assert "Content-Type must be application/json" in response.json()["error"]["message"]


BAD_VALUES = [None, True, -1, 0, 2**70, 1e308, -1e-9, "x", "", "\ud800", [], [None], {}, {"a": 1},
              "y" * 20_000, [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs", "stop",
                        "stop_token_ids", "stream", "stream_options", "ignore_eos", "model", "echo",
                        "skip_special_tokens", "frequency_penalty", "logit_bias", "prompt_logprobs"],
    "/tokenize": ["prompt", "add_special_tokens", "model"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
                             "logprobs", "top_logprobs", "stop", "tools", "tool_choice", "chat_template_kwargs",
                             "chat_template", "stream", "stream_options", "model", "response_format"],
}


def malformed_bodies(seed: int = 0):
    """Valid bodies with one field replaced by a bad value, plus random message and part shapes."""
    rng = random.Random(seed)
    for path, fields in FIELDS.items():
        for field in fields:
            for value in BAD_VALUES:
                yield path, field, {**ROUTES[path], field: value}
    shapes = [{"role": 1}, {"content": "x"}, {"role": "user", "content": 5}, {"role": "user", "content": [1]},
              {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
              {"role": "user", "content": [{"type": "text", "text": 7}]},
              {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 3}}]},
              {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
              {"role": "assistant", "content": "", "tool_calls": "x"},
              {"role": "user\ud800", "content": "x"}, {"role": "robot", "content": "x"}, "just a string"]
    for _ in range(40):
        messages = [rng.choice(shapes) for _ in range(rng.randint(1, 3))]
        yield "/v1/chat/completions", "messages", {**ROUTES["/v1/chat/completions"], "messages": messages}
    for field, tools in [("tools", [{"type": "function"}]), ("tools", [{"type": "web", "function": {"name": "f"}}]),
                         ("tools", ["calc"]), ("tool_choice", {"type": "function", "function": {"name": "f"}})]:
        yield "/v1/chat/completions", field, {**ROUTES["/v1/chat/completions"], field: tools}


def test_malformed_bodies_get_a_4xx_naming_the_field_never_a_500(client):
    refused = answered = 0
    wrong = []
    for path, field, body in malformed_bodies():
        response = client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        if response.status_code == 200:
            answered += 1  # a bad value that is a valid one here (e.g. top_k -1, stream false)
            continue
        refused += 1
        message = response.json()["error"]["message"] if response.status_code < 500 else response.text
        if response.status_code >= 500 or field not in message:
            wrong.append((path, field, str(body[field])[:40], response.status_code, message[:120]))
    assert wrong == []
    assert refused > 500 and client.get("/health").status_code == 200
    assert answered < refused / 4


@pytest.mark.parametrize("path, raw, words", [
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt: not valid Unicode"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}', "stop[0]: not valid Unicode"),
    ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "key: not valid Unicode"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "nested deeper than 32"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', "temperature must be finite"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": -1e400}', "top_p"),
    ("/v1/completions", b'{"prompt": "x"', "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages[0].content: not valid Unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": "' + b"[" * 10 + b'"}',
     "tools"),
])
def test_malformed_json_text_is_a_400_naming_the_place(client, path, raw, words):
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_a_client_chat_template_is_refused_unless_allowed(client):
    for body in ({"messages": MESSAGES, "chat_template": "{{ 'x' }}"},
                 {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 403 and "--allow-client-chat-template" in response.text
    reserved = client.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": 0}})
    assert reserved.status_code == 400 and "chat_template_kwargs.tokenize" in reserved.text


def test_an_allowed_client_template_renders_off_the_event_loop_under_the_deadline(run_dir):  # noqa: F811
    app = build_app(ckpt(run_dir, 0), allow_client_chat_template=True, limits=ServeLimits(request_timeout_s=0.5))

    async def main_():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            fine = await c.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 1, "chat_template": "{{ messages[0]['content'] }}"})
            start = time.perf_counter()
            slow = asyncio.create_task(c.post("/v1/chat/completions",
                                              json={"messages": MESSAGES, "chat_template": SLOW_TEMPLATE}))
            await asyncio.sleep(0.05)
            health = await c.get("/health")
            health_s = time.perf_counter() - start
            answer = await slow
            answer_s = time.perf_counter() - start
            await app.state.rlpipe.batcher.stop()
            return fine, health, health_s, answer, answer_s

    fine, health, health_s, answer, answer_s = asyncio.run(main_())
    assert fine.status_code == 200 and fine.json()["prompt_token_ids"]  # the client's template was used
    assert health.status_code == 200 and health_s < 0.45  # the loop was free while the template ran
    assert answer.status_code == 504 and "request_timeout_s=0.5" in answer.text and answer_s < 1.5


def test_an_empty_token_is_refused_and_a_readable_token_file_warned_about(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLPIPE_API_TOKEN", raising=False)
    with pytest.raises(ValueError, match="--token is empty"):
        server_token("  ", "")
    monkeypatch.setenv("RLPIPE_API_TOKEN", "")
    with pytest.raises(ValueError, match="set but empty"):
        server_token(None, "")
    assert main([str(tmp_path / "no-checkpoint-needed"), "--token", ""]) == 2
    assert "--token is empty" in capsys.readouterr().err
    monkeypatch.delenv("RLPIPE_API_TOKEN")
    assert server_token(None, "") is None  # no token at all: no auth, as documented
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    os.chmod(token_file, 0o600)
    assert check_token_file(str(token_file)) is None and server_token(None, str(token_file)) == "s3cret"
    os.chmod(token_file, 0o644)
    assert "readable by other users (mode 644)" in check_token_file(str(token_file))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        server_token(None, str(empty))
