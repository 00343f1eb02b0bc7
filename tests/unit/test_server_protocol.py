"""`rlpipe serve`'s request checks (engines/request_pipeline.py, engines/protocol.py) through the app: caps named in their
4xx, malformed bodies never a 500, JSON-only reloads, allowed Host names."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.request_pipeline import ServeLimits
from rlpipe.engines.serve_app import build_app

from tests.unit.test_server import ckpt, client, run_dir  # noqa: F401 - fixtures


@pytest.fixture()
def capped(run_dir):  # noqa: F811
    limits = ServeLimits(max_n=4, max_tokens=8, max_prompts=3, max_body_bytes=2000)
    with TestClient(build_app(ckpt(run_dir, 0), limits=limits), base_url="http://localhost") as c:
        yield c


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": [1, 2], "n": 5}, 400, "max_n=4 (--max-n)"),
        ({"prompt": [1, 2], "max_tokens": 9}, 400, "max_tokens=8 (--max-tokens)"),
        ({"prompt": [[1]] * 4}, 400, "max_prompts=3 (--max-prompts)"),
        ({"prompt": [1] * 1500}, 413, "max_body_bytes=2000 (--max-body-bytes)"),
        ({"prompt": [1] * 300, "max_tokens": 8}, 400, "over the model's context"),
        ({"prompt": [1, 2], "seed": 2**64}, 400, "seed must be in [0, 2**64)"),
        ({"prompt": [1, 2], "seed": -1}, 400, "seed must be in"),
        ({"prompt": [1, 2], "temperature": 1e-30}, 400, "temperature must be 0 (greedy) or >="),
    ],
)
def test_requests_over_a_cap_get_a_4xx_naming_it(capped, body, status, words, monkeypatch):
    if "context" in words:  # a 300-token prompt fits the body cap only on a small-context model
        model = capped.app.state.rlpipe.slot.current.engine.model
        monkeypatch.setattr(model.config, "max_position_embeddings", 256)
    response = capped.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


ROUTE_BODIES = {  # the same short prompt on both generating routes
    "/v1/completions": {"prompt": "12+7="},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "12+7="}]},
}


@pytest.mark.parametrize("route", sorted(ROUTE_BODIES))
@pytest.mark.parametrize("extra, words", [
    ({"max_tokens": 4097}, "max_tokens=4096 (--max-tokens)"),
    ({"max_tokens": 10_000_000}, "max_tokens=4096 (--max-tokens)"),
    ({"max_tokens": 4096}, "over the model's context of 4096"),
    ({"n": 1000}, "(--max-n)"),
])
def test_every_route_refuses_what_the_caps_refuse(client, route, extra, words):  # noqa: F811
    # the default --max-tokens equals the tiny model's context (4096), as in a default `rlpipe serve`
    response = client.post(route, json={**ROUTE_BODIES[route], **extra})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_a_chat_request_without_max_tokens_gets_what_the_context_leaves(client, monkeypatch):  # noqa: F811
    model = client.app.state.rlpipe.slot.current.engine.model
    monkeypatch.setattr(model.config, "max_position_embeddings", 40)
    body = {**ROUTE_BODIES["/v1/chat/completions"], "ignore_eos": True}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == 40, answer["usage"]


@pytest.mark.parametrize(
    "content, headers, status, words",
    [
        (b'{"prompt": [1, 2]}', {"Content-Type": "text/plain"}, 415, "application/json"),
        (b'{"prompt": [1, 2]}', {"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
        (b"[" * 100_000 + b"]" * 100_000, {"Content-Type": "application/json"}, 400, "nested too deeply"),
        (b'{"prompt": [1, 2], "temperature": NaN}', {"Content-Type": "application/json"}, 400, "NaN"),
        (b'{"prompt": [1, 2], "top_p": Infinity}', {"Content-Type": "application/json"}, 400, "Infinity"),
        (b"\xff\xfe", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    ],
)
def test_malformed_bodies_are_4xx_never_500(client, content, headers, status, words):  # noqa: F811
    response = client.post("/v1/completions", content=content, headers=headers)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_reload_needs_a_json_body_too(client, run_dir):  # noqa: F811
    # a cross-site form post cannot set Content-Type: application/json
    r = client.post("/update_weights_from_disk", content=f'{{"model_path": "{ckpt(run_dir, 3)}"}}',
                    headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and client.get("/health").json()["policy_version"] == 0


def test_only_allowed_host_names_are_served(run_dir):  # noqa: F811
    app = build_app(ckpt(run_dir, 0))
    with TestClient(app, base_url="http://evil.example:8000") as c:  # what DNS rebinding sends
        r = c.post("/update_weights_from_disk", json={"model_path": str(ckpt(run_dir, 3))})
        assert r.status_code == 403 and "Host 'evil.example:8000' is not allowed" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 403
    for base in ("http://127.0.0.1:1234", "http://[::1]:8000", "http://LOCALHOST"):
        with TestClient(app, base_url=base) as c:
            assert c.get("/health").status_code == 200, base
    with TestClient(build_app(ckpt(run_dir, 0), allowed_hosts=None), base_url="http://anything") as c:
        assert c.get("/health").status_code == 200


def test_allowed_hosts_from_the_command_line():
    from rlpipe.engines.serve_cli import allowed_hosts

    assert allowed_hosts(None, "127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts(None, "10.0.0.5") == ("localhost", "127.0.0.1", "::1", "10.0.0.5")
    assert allowed_hosts(None, "0.0.0.0") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts(["gpu1.lan"], "0.0.0.0") == ("gpu1.lan",)
    assert allowed_hosts(["*"], "0.0.0.0") is None


def test_a_served_checkpoint_renders_chats_with_its_runs_template_kwargs(tmp_path):
    """`rlpipe serve RUN/checkpoints/step_N` defaults --chat-template-kwargs to the run's
    model.chat_template_kwargs; a checkpoint outside a run folder, or a run without them, gets {}."""
    import json

    from rlpipe.engines.serve_cli import run_template_kwargs

    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    assert run_template_kwargs(str(checkpoint)) == {}
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": {"chat_template_kwargs": None}}))
    assert run_template_kwargs(str(checkpoint)) == {}
    (tmp_path / "run" / "config.json").write_text(
        json.dumps({"model": {"chat_template_kwargs": {"enable_thinking": False}}}))
    assert run_template_kwargs(str(checkpoint)) == {"enable_thinking": False}
    (tmp_path / "run" / "config.json").write_text("{not json")
    assert run_template_kwargs(str(checkpoint)) == {}
