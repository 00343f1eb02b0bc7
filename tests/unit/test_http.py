"""HttpEngine: parity with the in-process engine through `rlpipe serve`'s app, sync, auth,
retries and clear errors, and the vLLM / SGLang request shapes."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.engines.config import EngineConfig
from rlpipe.engines.http import (
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
    HttpEngine,
    HttpOptions,
    engines_from_config,
    parse_engine_url,
    read_token,
)
from rlpipe.engines.protocol import end_of_turn_ids
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint

from tests.ports import closed_port

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    tok = build_tokenizer()
    save_checkpoint(root, 0, build_model("tiny-dense", vocab_size=len(tok), seed=0), tok)
    save_checkpoint(root, 2, build_model("tiny-dense", vocab_size=len(tok), seed=1), tok)
    return root


def ckpt(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:06d}"


def served_engine(run_dir, token=None, api_token=None):
    client = TestClient(build_app(ckpt(run_dir, 0), token=token), base_url="http://localhost")
    return HttpEngine("http://localhost", HttpOptions(retries=0, api_token=api_token), client=client), client


def test_generate_and_sync_through_the_server(run_dir):
    engine, client = served_engine(run_dir)
    with client:
        assert isinstance(engine, Engine)
        params = SamplingParams(n=2, max_new_tokens=6, seed=4, temperature=0.9)
        out = engine.generate(PROMPTS, params)
        local = TorchEngine(load_checkpoint(ckpt(run_dir, 0), restore_rng=False).model.eval())
        expected = local.generate(PROMPTS, params)
        for got_group, exp_group in zip(out, expected, strict=True):
            for got, exp in zip(got_group, exp_group, strict=True):
                assert got.tokens == exp.tokens and got.finish_reason == exp.finish_reason
                assert got.logprobs == pytest.approx(exp.logprobs, abs=1e-4)
        engine.sync(str(ckpt(run_dir, 2)), 2)
        assert engine.policy_version == 2
        after = engine.generate(PROMPTS, params)
        assert [c.logprobs for c in after[0]] != [c.logprobs for c in out[0]]
        engine.sync(str(ckpt(run_dir, 2)), 5)  # the trainer's count, not the checkpoint's own 2
        engine.generate(PROMPTS[:1], params)  # the server answers as version 5 (generate reads it back)
        assert engine.policy_version == 5
        with pytest.raises(EngineResponseError, match="HTTP 403.*outside the allowed root"):
            engine.sync("/", 3)
        with pytest.raises(ValueError, match="checkpoint path"):
            engine.sync(None, 3)
        assert engine.generate([], params) == []


def test_rollouts_through_the_server_run_past_eos_as_in_process(run_dir):
    """The server stops at EOS for OpenAI clients; the HTTP engine opts out (ignore_eos), so a
    rollout holds the same tokens and log-probs as the in-process engine's, EOS tokens inside."""
    engine, client = served_engine(run_dir)
    tok = build_tokenizer()
    local = TorchEngine(load_checkpoint(ckpt(run_dir, 0), restore_rng=False).model.eval())
    with client:
        params = SamplingParams(n=8, max_new_tokens=64, seed=7)
        expected = local.generate(PROMPTS, params)
        eos = set(end_of_turn_ids(tok))  # where the server stops an OpenAI client's completion
        assert any(eos & set(c.tokens[:-1]) for group in expected for c in group)  # EOS mid-way
        out = engine.generate(PROMPTS, params)
        for got_group, exp_group in zip(out, expected, strict=True):
            for got, exp in zip(got_group, exp_group, strict=True):
                assert got.tokens == exp.tokens and got.finish_reason == exp.finish_reason == "length"
                assert got.logprobs == pytest.approx(exp.logprobs, abs=1e-4)


def test_token_is_sent(run_dir):
    engine, client = served_engine(run_dir, token="t0k", api_token="t0k")
    anonymous = HttpEngine("http://localhost", HttpOptions(retries=0), client=client)
    with client:
        assert engine.health()["status"] == "ok"
        with pytest.raises(EngineResponseError, match="HTTP 401"):
            anonymous.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def test_connection_errors_are_retried_then_named():
    calls = []

    def refuse(request):
        calls.append(request.url)
        raise httpx.ConnectError("connection refused", request=request)

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    engine = HttpEngine("http://127.0.0.1:9", HttpOptions(retries=2, backoff_s=0.01), client=client)
    with pytest.raises(EngineUnavailableError, match=r"http://127\.0\.0\.1:9/v1/completions.*3 attempt"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert len(calls) == 3


def test_unavailable_then_ok_and_read_timeout_not_retried():
    calls = []

    def flaky(request):
        calls.append(1)
        if len(calls) == 1:
            return httpx.Response(503, text="starting")
        return httpx.Response(200, json={"status": "ok"})

    engine = HttpEngine("http://h:1", HttpOptions(retries=1, backoff_s=0.0),
                        client=httpx.Client(transport=httpx.MockTransport(flaky)))
    assert engine.health() == {"status": "ok"} and len(calls) == 2

    slow_calls = []

    def slow(request):
        slow_calls.append(1)
        raise httpx.ReadTimeout("timed out", request=request)

    engine = HttpEngine("http://h:1", HttpOptions(retries=3, timeout_s=0.5),
                        client=httpx.Client(transport=httpx.MockTransport(slow)))
    with pytest.raises(EngineTimeoutError, match="timeout_s=0.5"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert len(slow_calls) == 1


def test_closed_loopback_port_fails_clearly():
    with closed_port() as port:  # held by this test, nothing listens there
        engine = HttpEngine(f"http://127.0.0.1:{port}", HttpOptions(retries=1, backoff_s=0.01, timeout_s=5))
        with pytest.raises(EngineUnavailableError, match=f"127.0.0.1:{port}"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def recorder(answers):
    """A MockTransport answering by path, recording (path, json body)."""
    seen = []

    def handle(request):
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body))
        answer = answers[request.url.path]
        return answer(body) if callable(answer) else httpx.Response(200, json=answer)

    return seen, httpx.Client(transport=httpx.MockTransport(handle))


def vllm_completions(body):
    """A vLLM /v1/completions answer: choice i of the request gets tokens [40 + i, 41 + i]."""
    choices = []
    for i in range(len(body["prompt"]) * body["n"]):
        ids = [40 + i, 41 + i]
        # no token_ids field: ids come from "token_id:<id>" strings (return_tokens_as_token_ids)
        choices.append({"index": i, "text": "xy", "finish_reason": "length" if i else "stop",
                        "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                     "token_logprobs": [-0.5, -1.5], "top_logprobs": None}})
    return httpx.Response(200, json={"choices": choices[::-1]})  # any order


def test_vllm_request_shape_and_reload():
    seen, client = recorder({
        "/v1/models": {"data": [{"id": "/ckpt/step_0"}]},
        "/v1/completions": vllm_completions,
        "/collective_rpc": {"results": [None]},
        "/reset_prefix_cache": {},
    })
    engine = HttpEngine("vllm+http://gpu:8000", HttpOptions(api_token="k"), client=client)
    assert engine.flavor == "vllm" and engine.url == "http://gpu:8000"
    params = SamplingParams(n=2, max_new_tokens=2, greedy=True, stop_token_ids=(2,))
    out = engine.generate(PROMPTS, params)
    assert [[c.tokens for c in g] for g in out] == [[[40, 41], [41, 42]], [[42, 43], [43, 44]]]
    assert out[0][0].finish_reason == "stop" and out[0][0].logprobs == [-0.5, -1.5]
    body = seen[1][1]
    assert body["model"] == "/ckpt/step_0" and body["prompt"] == PROMPTS
    assert body["temperature"] == 0.0 and body["top_k"] == -1 and body["stop_token_ids"] == [2]
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"] and body["ignore_eos"]
    assert body["logprobs"] == 1 and "seed" not in body and body["max_tokens"] == 2
    engine.sync("/ckpt/step_7", 7)
    assert seen[2:] == [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step_7"}}),
        ("/reset_prefix_cache", None),
    ]
    assert engine.policy_version == 7


def test_vllm_seeded_batch_gives_each_prompt_its_own_seeds():
    # vLLM seeds a request's n samples seed, seed+1, ...: one batched request would give sample j
    # of every prompt the same noise, so each prompt is its own request, n seeds further on
    seen, client = recorder({"/v1/completions": vllm_completions})
    engine = HttpEngine("vllm+http://gpu:8000", HttpOptions(model="m"), client=client)
    prompts = [[1, 2], [3], [4, 5, 6]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=2, seed=10))
    bodies = sorted((body for _, body in seen), key=lambda body: body["seed"])
    assert [(b["prompt"], b["seed"], b["n"]) for b in bodies] == [
        ([[1, 2]], 10, 2), ([[3]], 12, 2), ([[4, 5, 6]], 14, 2)]
    assert [[c.tokens for c in g] for g in out] == [[[40, 41], [41, 42]]] * 3


def test_vllm_before_weights_path_gets_the_older_reload_pair():
    calls = []

    def rpc(body):
        calls.append(body)
        if "kwargs" in body:  # vLLM < 0.19: reload_weights takes no weights_path
            return httpx.Response(500, json={"error": {"message": "Worker failed with error "
                "'reload_weights() got an unexpected keyword argument 'weights_path''"}})
        return httpx.Response(200, json={"results": [None]})

    _, client = recorder({"/collective_rpc": rpc, "/reset_prefix_cache": {}})
    engine = HttpEngine("vllm+http://gpu:8000", HttpOptions(model="m"), client=client)
    engine.sync("/c/step_1", 1)
    engine.sync("/c/step_2", 2)  # learnt: no second try of the newer call
    assert calls == [
        {"method": "reload_weights", "kwargs": {"weights_path": "/c/step_1"}},
        {"method": "update_config", "args": [{"model_config": {"model": "/c/step_1"}}]},
        {"method": "reload_weights"},
        {"method": "update_config", "args": [{"model_config": {"model": "/c/step_2"}}]},
        {"method": "reload_weights"},
    ]
    assert engine.policy_version == 2


def test_sglang_request_shape_and_reload():
    def generate(body):
        items = [{"text": "a", "meta_info": {"output_token_logprobs": [[-0.1, 30 + k, None], [-0.2, 31, None]],
                                             "finish_reason": {"type": "length", "length": 2}}}
                 for k, _ in enumerate(body["input_ids"])]
        return httpx.Response(200, json=items)

    seen, client = recorder({
        "/generate": generate,
        "/update_weights_from_disk": lambda body: httpx.Response(
            200, json={"success": body["model_path"] == "/c/step_3", "message": "no such file"}),
    })
    engine = HttpEngine("http://gpu:30000", HttpOptions(flavor="sglang"), client=client)
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2, top_k=5))
    assert [[c.tokens[0] for c in g] for g in out] == [[30, 31], [32, 33]]
    body = seen[0][1]
    assert body["input_ids"] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    assert body["return_logprob"] is True and body["sampling_params"]["top_k"] == 5
    engine.sync("/c/step_3", 3)
    assert seen[1] == ("/update_weights_from_disk", {"model_path": "/c/step_3", "weight_version": "3"})
    with pytest.raises(EngineResponseError, match="no such file"):
        engine.sync("/c/step_4", 4)
    assert engine.policy_version == 3


def test_malformed_answers_raise_engine_response_error():
    _, client = recorder({"/v1/completions": {"choices": [{"index": 0, "finish_reason": "abort",
                                                           "token_ids": [1], "logprobs": {"token_logprobs": [0.0]}}]}})
    engine = HttpEngine("http://h:1", client=client)
    with pytest.raises(EngineResponseError, match="finish_reason 'abort'"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))
    with pytest.raises(EngineResponseError, match="expected 2 choices"):
        engine.generate([[1], [2]], SamplingParams(max_new_tokens=1))


def test_engines_from_config_and_urls(monkeypatch):
    monkeypatch.setenv("RLPIPE_API_TOKEN", "tok")
    config = EngineConfig(type="http", urls=["http://127.0.0.1:8001/", "sglang+http://127.0.0.1:8002"],
                          timeout_s=5, retries=1)
    engines = engines_from_config(config)
    assert [e.name for e in engines] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert [e.flavor for e in engines] == ["rlpipe", "sglang"]
    assert engines[0].timeout_s == 5 and engines[0].retries == 1
    assert engines[0]._headers == {"Authorization": "Bearer tok"}
    for bad in ("127.0.0.1:8000", "ftp://h", "tgi+http://h:1", "http://"):
        with pytest.raises(ValueError, match="engine url"):
            parse_engine_url(bad)
    with pytest.raises(ValueError, match="contradicts"):
        HttpEngine("vllm+http://h:1", HttpOptions(flavor="sglang"))
    with pytest.raises(ValueError, match="no server"):
        engines_from_config(EngineConfig(urls=[]))


def test_token_comes_from_a_file_before_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "from-env")
    assert read_token("", "MY_TOKEN") == "from-env"
    assert read_token("", "UNSET_TOKEN_VAR") is None
    (tmp_path / "tok").write_text("from-file\n")
    assert read_token(str(tmp_path / "tok"), "MY_TOKEN") == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read the token file"):
        read_token(str(tmp_path / "missing"))
