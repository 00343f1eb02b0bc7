"""`rlpipe serve` app: OpenAI completions shape, parity with the in-process engine, auth,
refused reloads, malformed requests, weight reload, request batching and scheduling. Request
caps and protocol checks: test_server_protocol.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import httpx
import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.request_pipeline import ServeLimits
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.serve_generation import group_jobs, load_served_model
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder with two tiny checkpoints of different weights (steps 0 and 3)."""
    root = tmp_path_factory.mktemp("run")
    tok = build_tokenizer()
    save_checkpoint(root, 0, build_model("tiny-dense", vocab_size=len(tok), seed=0), tok)
    save_checkpoint(root, 3, build_model("tiny-dense", vocab_size=len(tok), seed=1), tok)
    return root


def ckpt(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:06d}"


@pytest.fixture()
def client(run_dir):
    with TestClient(build_app(ckpt(run_dir, 0)), base_url="http://localhost") as c:
        yield c


def complete(client, **body):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_shape(client):
    out = complete(client, prompt=PROMPTS[:2], n=2, max_tokens=6, seed=3, logprobs=0,
                   return_tokens_as_token_ids=True, ignore_eos=True)
    assert out["object"] == "text_completion" and out["policy_version"] == 0
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice in out["choices"]:
        assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == 6 and all(x <= 0 for x in lp["token_logprobs"])
        assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert isinstance(choice["text"], str)
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 24, "total_tokens": 31}
    # without logprobs the field is null, token ids still come back
    plain = complete(client, prompt=PROMPTS[0], max_tokens=3, seed=3, ignore_eos=True)
    assert plain["choices"][0]["logprobs"] is None and len(plain["choices"][0]["token_ids"]) == 3


def test_logprobs_equal_in_process_engine(client, run_dir):
    engine = TorchEngine(load_checkpoint(ckpt(run_dir, 0), restore_rng=False).model.eval())
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.7, top_k=20, seed=11)
    expected = engine.generate(PROMPTS, params)
    out = complete(client, prompt=PROMPTS, n=2, max_tokens=8, temperature=0.7, top_k=20, seed=11,
                   logprobs=0, ignore_eos=True)
    for i, group in enumerate(expected):
        for j, completion in enumerate(group):
            choice = out["choices"][i * 2 + j]
            assert choice["token_ids"] == completion.tokens
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(completion.logprobs, abs=1e-4)


def test_text_prompt_equals_token_prompt_and_stop_tokens(client):
    tok = build_tokenizer()
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    by_text = complete(client, prompt="12+7=", max_tokens=5, seed=1, logprobs=0)
    by_ids = complete(client, prompt=ids, max_tokens=5, seed=1, logprobs=0)
    assert by_text["choices"][0]["token_ids"] == by_ids["choices"][0]["token_ids"]
    # a stop token ends the completion and is kept (greedy: temperature 0)
    greedy = complete(client, prompt=ids, max_tokens=5, temperature=0)["choices"][0]["token_ids"]
    stopped = complete(client, prompt=ids, max_tokens=5, temperature=0,
                       stop_token_ids=[greedy[1]])["choices"][0]
    first = greedy.index(greedy[1])  # the stop token may already appear at position 0
    assert stopped["token_ids"] == greedy[: first + 1] and stopped["finish_reason"] == "stop"


def test_token_required(run_dir):
    with TestClient(build_app(ckpt(run_dir, 0), token="s3cret"), base_url="http://localhost") as c:
        body = {"prompt": PROMPTS[0], "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 401
        assert c.get("/health").status_code == 401
        wrong = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.post("/update_weights_from_disk", json={"model_path": str(ckpt(run_dir, 3))}).status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 401
        assert c.get("/health", headers={"Authorization": "Bearer s3cret"}).json()["policy_version"] == 0


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        ([1, 2], 400, "JSON object"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [], "max_tokens": 3}, 400, "empty"),
        ({"prompt": [[]], "max_tokens": 3}, 400, "empty"),
        ({"prompt": [1, "a"], "max_tokens": 3}, 400, "prompt"),
        ({"prompt": [1, 2], "n": 0}, 400, "n must be"),
        ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens must be >= 1"),
        ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
        ({"prompt": [1, 2], "top_p": 1.5}, 400, "top_p"),
        ({"prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
        ({"prompt": [1, 100000]}, 400, "outside"),
        ({"prompt": [1, -1]}, 400, "outside"),
        ({"prompt": [1, 2], "stream": "yes"}, 400, "stream"),
        ({"prompt": [1, 2], "stop": [""]}, 400, "stop[0] must have 1 to"),
        ({"prompt": [1, 2], "stop": ["x"] * 17}, 400, "at most 16"),
        ({"prompt": [1, 2], "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
        ({"prompt": [1, 2], "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({"prompt": [1, 2], "logprobs": 99}, 400, "logprobs"),
        ({"prompt": [1, 2], "model": "gpt-9"}, 404, "gpt-9"),
    ],
)
def test_malformed_requests_get_4xx_with_a_message(client, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/v1/completions", content=content,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # still serving


def test_a_weight_version_names_the_loaded_weights_policy_version(client, run_dir):
    """The trainer's count wins over the checkpoint's own: RL's first sync loads the SFT phase's
    step-3 checkpoint as its version 0 (HttpEngine.sync checks the answer)."""
    answer = client.post("/update_weights_from_disk", json={"model_path": str(ckpt(run_dir, 3)), "weight_version": "0"})
    assert answer.status_code == 200 and answer.json()["policy_version"] == 0, answer.text
    assert client.get("/health").json()["policy_version"] == 0
    assert complete(client, prompt=PROMPTS[0], max_tokens=2)["policy_version"] == 0
    for version in ("v2", "²", "9" * 5000, "-1", "1e3", " "):  # each a 400, never a 500
        bad = client.post("/update_weights_from_disk", json={"model_path": str(ckpt(run_dir, 3)), "weight_version": version})
        assert bad.status_code == 400 and "weight_version" in bad.json()["error"]["message"], (version, bad.text)
    assert client.get("/health").json()["policy_version"] == 0  # the refused reload changed nothing


def test_update_weights_changes_outputs_and_version(client, run_dir):
    body = dict(prompt=PROMPTS[0], max_tokens=6, seed=5, logprobs=0)
    before = complete(client, **body)["choices"][0]
    answer = client.post("/update_weights_from_disk", json={"model_path": str(ckpt(run_dir, 3))})
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] is True and answer.json()["policy_version"] == 3
    assert client.get("/health").json()["policy_version"] == 3
    after = complete(client, **body)
    assert after["policy_version"] == 3
    assert after["choices"][0]["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
    # the same as an in-process engine on step 3's weights
    engine = TorchEngine(load_served_model(ckpt(run_dir, 3)).engine.model)
    expected = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=5))[0][0]
    assert after["choices"][0]["token_ids"] == expected.tokens
    assert after["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected.logprobs, abs=1e-4)


def test_refused_reloads_keep_the_old_weights(client, run_dir, tmp_path):
    body = dict(prompt=PROMPTS[1], max_tokens=5, seed=2, logprobs=0)
    before = complete(client, **body)["choices"][0]
    outside = tmp_path / "elsewhere"
    shutil.copytree(ckpt(run_dir, 3), outside)
    link = run_dir / "checkpoints" / "sneaky"
    link.symlink_to(outside, target_is_directory=True)
    corrupt = run_dir / "checkpoints" / "step_000099"
    shutil.copytree(ckpt(run_dir, 3), corrupt)
    with (corrupt / "model.safetensors").open("r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    try:
        cases = [
            (str(outside), 403, "outside the allowed root"),
            (str(link), 403, "outside the allowed root"),  # a symlink inside pointing outside
            (str(run_dir / "checkpoints" / ".." / ".." / "x"), 403, "outside the allowed root"),
            (str(corrupt), 400, "not a valid checkpoint"),
            (str(run_dir / "checkpoints" / "nope"), 400, "does not exist"),
            (42, 400, "model_path"),
        ]
        for path, status, words in cases:
            r = client.post("/update_weights_from_disk", json={"model_path": path})
            assert r.status_code == status, (path, r.text)
            assert words in r.json()["error"]["message"], r.text
        assert client.post("/update_weights_from_disk", json={"path": "x"}).status_code == 400
        # outside the root, an existing and a missing path get the same answer: nothing leaks
        answers = [client.post("/update_weights_from_disk", json={"model_path": p})
                   for p in ("/etc", "/etc/no-such-dir-xyz")]
        assert [a.status_code for a in answers] == [403, 403]
        assert [a.json()["error"]["message"].split("'")[2] for a in answers][0] == \
               answers[1].json()["error"]["message"].split("'")[2]
        assert client.get("/health").json()["policy_version"] == 0
        assert complete(client, **body)["choices"][0] == before
    finally:
        link.unlink()
        shutil.rmtree(corrupt)


def test_concurrent_requests_are_batched(run_dir):
    app = build_app(ckpt(run_dir, 0), batch_window_ms=200)
    stats = app.state.rlpipe.batcher.stats

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
            unseeded = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "logprobs": 0, "ignore_eos": True})
                        for p in PROMPTS * 2]
            seeded = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "seed": 9, "logprobs": 0,
                                                    "ignore_eos": True})
                      for p in PROMPTS]
            first = await asyncio.gather(*unseeded)
            calls_unseeded = stats.engine_calls
            second = await asyncio.gather(*seeded)
            solo = [await c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "seed": 9, "ignore_eos": True})
                    for p in PROMPTS]
            await app.state.rlpipe.batcher.stop()
            return first, calls_unseeded, second, solo

    first, calls_unseeded, second, solo = asyncio.run(main())
    assert all(r.status_code == 200 for r in first + second)
    assert all(len(r.json()["choices"][0]["token_ids"]) == 4 for r in first)
    assert calls_unseeded < len(first)  # merged into fewer engine calls
    # seeded requests run alone: each equals the same request sent by itself
    assert [r.json()["choices"][0]["token_ids"] for r in second] == \
           [r.json()["choices"][0]["token_ids"] for r in solo]


def test_group_jobs_merges_only_unseeded_equal_params():
    class J:
        def __init__(self, params):
            self.params = params

    a, b = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=8)
    s = SamplingParams(max_new_tokens=4, seed=1)
    jobs = [J(a), J(b), J(a), J(s), J(s)]
    groups = group_jobs(jobs)  # type: ignore[arg-type]
    assert [[jobs.index(j) for j in g] for g in groups] == [[0, 2], [1], [3], [4]]


def test_models_endpoint(client, run_dir):
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == str(ckpt(run_dir, 0)) and data[0]["policy_version"] == 0
    assert complete(client, prompt=PROMPTS[0], max_tokens=1, model=data[0]["id"])["choices"]


def test_a_long_request_does_not_starve_a_small_one_or_a_weight_update(run_dir):
    # 32 prompts x n=4 in parts of 8 sequences: 16 engine calls. A small request and a reload
    # sent just after it are answered while it is still running, and it finishes on the
    # weights it started with (one policy_version per response).
    app = build_app(ckpt(run_dir, 0), batch_window_ms=0, limits=ServeLimits(chunk_sequences=8))
    stats = app.state.rlpipe.batcher.stats
    done: list[str] = []

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=120) as c:
            async def call(name, path, body):
                response = await c.post(path, json=body)
                done.append(name)
                return response, stats.engine_calls

            long = asyncio.create_task(call("long", "/v1/completions",
                                            {"prompt": [PROMPTS[0]] * 32, "n": 4, "max_tokens": 8}))
            while stats.engine_calls < 1:
                await asyncio.sleep(0.005)
            small = await call("small", "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2})
            reload = await call("reload", "/update_weights_from_disk", {"model_path": str(ckpt(run_dir, 3))})
            after = await call("after", "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2})
            result = await long
            await app.state.rlpipe.batcher.stop()
            return result, small, reload, after

    (long, long_calls), (small, small_calls), (reload, _), (after, _) = asyncio.run(main())
    assert [r.status_code for r in (long, small, reload, after)] == [200] * 4
    assert done.index("small") < done.index("long") and done.index("reload") < done.index("long")
    assert small_calls < long_calls
    assert len(long.json()["choices"]) == 128 and long.json()["policy_version"] == 0
    assert small.json()["policy_version"] == 0 and after.json()["policy_version"] == 3


class GatedEngine:
    """The app's engine calls counted by max_tokens, the first of the long request's (max_tokens
    16) held until the test releases it: that request is in flight, not finished, for as long as
    the test needs, however slow the machine."""

    def __init__(self, app) -> None:
        self.slot = app.state.rlpipe.slot
        self.real = self.slot.generate
        self.calls: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.slot.generate = self

    def __call__(self, prompts, params, *rest):
        self.calls.append(params.max_new_tokens)
        if self.calls.count(16) == 1 and params.max_new_tokens == 16:
            self.entered.set()
            assert self.release.wait(120), "the test never released the held engine call"
        return self.real(prompts, params, *rest)


def test_a_request_past_its_deadline_gets_504_and_its_remaining_parts_are_dropped(run_dir):
    app = build_app(ckpt(run_dir, 0), batch_window_ms=0,
                    limits=ServeLimits(chunk_sequences=2, request_timeout_s=1))
    stats = app.state.rlpipe.batcher.stats
    engine = GatedEngine(app)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=120) as c:
            # 100 parts of 2 sequences; its first part held: the deadline passes mid-request
            slow = await c.post("/v1/completions", json={"prompt": [PROMPTS[0]] * 200, "max_tokens": 16})
            held = engine.entered.is_set()
            engine.release.set()
            quick = await c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1})
            await app.state.rlpipe.batcher.stop()
            return slow, held, quick

    slow, held, quick = asyncio.run(main())
    assert held
    assert slow.status_code == 504 and "request_timeout_s=1 (--request-timeout-s)" in slow.json()["error"]["message"]
    assert quick.status_code == 200
    assert engine.calls.count(16) == 1 and engine.calls.count(1) == 1  # none of its 99 other parts
    assert stats.dropped == 1


def test_a_client_that_goes_away_stops_its_request(run_dir):
    # a real uvicorn on a loopback port (in a thread): a client timing out closes its connection,
    # and the server stops generating for it instead of computing all 100 parts for nobody
    import time

    from tests.serve_sockets import serving

    app = build_app(ckpt(run_dir, 0), batch_window_ms=0, limits=ServeLimits(chunk_sequences=2))
    stats = app.state.rlpipe.batcher.stats
    engine = GatedEngine(app)
    with serving(app) as (host, port):
        deadline = time.monotonic() + 60
        url = f"http://{host}:{port}/v1/completions"
        # its first part held: the client's timeout passes mid-request, and it hangs up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={"prompt": [PROMPTS[0]] * 200, "max_tokens": 16}, timeout=1)
        assert engine.entered.is_set()
        engine.release.set()
        while stats.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stats.dropped == 1
        held = engine.calls.count(16)
        assert httpx.post(url, json={"prompt": PROMPTS[0], "max_tokens": 1}, timeout=60).status_code == 200
        # dropped: nothing more generated for it, far from its 100 parts
        assert engine.calls.count(16) == held and held < 50, engine.calls
