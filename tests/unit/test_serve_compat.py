"""`rlpipe serve` as an OpenAI/vLLM drop-in, driven by the `openai` client and by vLLM's request
shapes: EOS and stop strings, streaming, log-probs and top log-probs, served names, usage, and
tool calls parsed by the same parser the calculator environment uses."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from fastapi.testclient import TestClient
from rlpipe.engines.base import Completion
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.serve_generation import load_served_model
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import save_checkpoint

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "12+30="}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    return save_checkpoint(root, 0, model, tok)


@pytest.fixture()
def client(checkpoint):
    with TestClient(build_app(checkpoint, served_model_names=["tiny", "tiny-alias"]),
                    base_url="http://localhost") as c:
        yield c


def api_for(client):
    return openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=client, max_retries=0)


def post(client, path, **body):
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def events(response) -> list:
    """The JSON chunks of a server-sent-events body, checking it ends with [DONE]."""
    lines = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_eos_stops_by_default_and_ignore_eos_opts_out(client):
    tok = build_tokenizer()
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    for seed in range(20):  # a seed whose draws reach an EOS token (same seed: same draws)
        body = {"prompt": "12+7=", "max_tokens": 60, "seed": seed}
        run_on = post(client, "/v1/completions", **body, ignore_eos=True)["choices"][0]
        assert run_on["finish_reason"] == "length" and len(run_on["token_ids"]) == 60
        first_eos = next((i for i, t in enumerate(run_on["token_ids"]) if t in eos), None)
        if first_eos is not None:
            break
    assert first_eos is not None
    stopped = post(client, "/v1/completions", **body)["choices"][0]
    assert stopped["token_ids"] == run_on["token_ids"][: first_eos + 1]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] is None
    assert stopped["text"] == tok.decode(run_on["token_ids"][:first_eos], skip_special_tokens=True)


def test_stop_strings_cut_the_text_and_name_the_stop(client):
    tok = build_tokenizer()
    body = {"prompt": "ab", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = post(client, "/v1/completions", **body)["choices"][0]
    text = whole["text"]
    stop = text[5:7]
    at = text.find(stop)
    cut = post(client, "/v1/completions", **body, stop=[stop, "never-written"])["choices"][0]
    assert cut["text"] == text[:at] and cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    kept = cut["token_ids"]
    assert kept == whole["token_ids"][: len(kept)]
    assert stop in tok.decode(kept, skip_special_tokens=True)  # through the token completing it ...
    assert stop not in tok.decode(kept[:-1], skip_special_tokens=True)  # ... and no further
    with_stop = post(client, "/v1/completions", **body, stop=stop, include_stop_str_in_output=True)
    assert with_stop["choices"][0]["text"] == text[: at + len(stop)]
    chat = post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=24, temperature=0, ignore_eos=True)
    content = chat["choices"][0]["message"]["content"]
    chat_cut = post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=24, temperature=0,
                    ignore_eos=True, stop=content[4:6])["choices"][0]
    assert chat_cut["message"]["content"] == content[: content.find(content[4:6])]
    assert chat_cut["finish_reason"] == "stop"


def test_openai_client_completions_stream_equals_the_whole_answer(client):
    api = api_for(client)
    kwargs = {"model": "tiny", "prompt": "12+7=", "max_tokens": 12, "temperature": 0, "logprobs": 2,
              "extra_body": {"ignore_eos": True}}
    whole = api.completions.create(**kwargs)
    chunks = list(api.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason] == ["length"]
    streamed_lp = [lp for c in chunks if c.choices and c.choices[0].logprobs
                   for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed_lp == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert whole.usage.completion_tokens == 12 and whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.model == "tiny"


def test_openai_client_chat_stream_equals_the_whole_answer(client):
    api = api_for(client)
    kwargs = {"model": "tiny-alias", "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
              "logprobs": True, "top_logprobs": 2}
    whole = api.chat.completions.create(**kwargs)
    chunks = list(api.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # usage only with stream_options.include_usage
    streamed = [e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])
    assert whole.model == "tiny-alias" and whole.usage.completion_tokens == len(whole.choices[0].logprobs.content)


def test_top_logprobs_are_the_models_most_likely_tokens(client, checkpoint):
    """Greedy: the sampled token is the top-1 of each position, with the same log-prob, and the
    top-k equal a plain forward pass's."""
    tok = build_tokenizer()
    out = post(client, "/v1/completions", prompt="12+7=", max_tokens=6, temperature=0, logprobs=3,
               ignore_eos=True, return_tokens_as_token_ids=True)["choices"][0]
    served = load_served_model(checkpoint)
    prompt = tok("12+7=", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = served.engine.model(torch.tensor([prompt + out["token_ids"][:-1]])).logits[0, len(prompt) - 1:]
    expected = torch.log_softmax(logits.float(), -1).topk(3, dim=-1)
    for t, top in enumerate(out["logprobs"]["top_logprobs"]):
        want = {f"token_id:{i}": v for i, v in zip(expected.indices[t].tolist(), expected.values[t].tolist(),
                                                   strict=True)}
        assert top.keys() == want.keys()  # the sampled token (top-1 when greedy) and the top 3
        assert list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)
        assert next(iter(top)) == f"token_id:{out['token_ids'][t]}"
    chat = post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                top_logprobs=2)["choices"][0]
    for entry in chat["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]


def test_served_names_are_listed_and_only_they_are_accepted(client, checkpoint):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    assert post(client, "/v1/completions", prompt="1", max_tokens=1, model="tiny-alias")["model"] == "tiny-alias"
    assert post(client, "/v1/completions", prompt="1", max_tokens=1)["model"] == "tiny"
    refused = client.post("/v1/completions", json={"prompt": "1", "model": str(checkpoint)})
    assert refused.status_code == 404 and "'tiny', 'tiny-alias'" in refused.json()["error"]["message"]


def test_vllm_request_shapes_field_by_field(client):
    """The bodies vLLM's OpenAI server documents (token-id prompts, its extra parameters), and the
    fields of its answers."""
    body = {"model": "tiny", "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 4, "temperature": 0.8,
            "top_p": 0.9, "top_k": -1, "seed": 3, "logprobs": 1, "stop_token_ids": [7],
            "return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True,
            "skip_special_tokens": False, "include_stop_str_in_output": False}
    out = post(client, "/v1/completions", **body)
    assert set(out) >= {"id", "object", "created", "model", "choices", "usage"}
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice in out["choices"]:
        assert set(choice) >= {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"}
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(choice["token_ids"])
        assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        if choice["finish_reason"] == "stop":
            assert choice["token_ids"][-1] == 7 and choice["stop_reason"] == 7
    chat = post(client, "/v1/chat/completions", model="tiny", messages=MESSAGES, max_completion_tokens=3,
                seed=1, chat_template_kwargs={"enable_thinking": False}, stream_options=None)
    choice = chat["choices"][0]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert set(choice) >= {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    assert choice["message"]["role"] == "assistant" and choice["message"]["tool_calls"] == []
    assert set(chat["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


# ----------------------------------------------------------------------------- live streams


def by_choice(chunks: list[dict]) -> dict[int, dict]:
    """Streamed chunks gathered per choice index: text, token ids, log-probs, finish."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            got = out.setdefault(part["index"], {"text": "", "token_ids": [], "logprobs": [], "finish": None})
            got["text"] += part.get("text") or (part.get("delta") or {}).get("content") or ""
            got["token_ids"] += part.get("token_ids") or []
            lp = part.get("logprobs") or {}
            got["logprobs"] += lp.get("token_logprobs") or [e["logprob"] for e in lp.get("content") or []]
            if part.get("finish_reason"):
                got["finish"] = (part["finish_reason"], part.get("stop_reason"))
    return out


def test_live_streams_equal_the_whole_answers(client):
    """Token by token as sampled (no top log-probs, no tool parsing): n choices interleaved, stop
    strings held back until they cannot be one, the same tokens, text and log-probs."""
    whole = post(client, "/v1/completions", prompt=["ab", "12+7="], n=2, max_tokens=30, seed=5, logprobs=0,
                 ignore_eos=True)
    stops = [whole["choices"][1]["text"][6:8], whole["choices"][2]["text"][3:6]]
    for body in ({}, {"stop": stops}, {"ignore_eos": False, "max_tokens": 80}):
        request = {"prompt": ["ab", "12+7="], "n": 2, "max_tokens": 30, "seed": 5, "logprobs": 0,
                   "ignore_eos": True, **body}
        expected = post(client, "/v1/completions", **request)
        streamed = by_choice(events(client.post("/v1/completions", json={**request, "stream": True})))
        for choice in expected["choices"]:
            got = streamed[choice["index"]]
            assert got["text"] == choice["text"] and got["token_ids"] == choice["token_ids"]
            assert got["logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"])
            assert got["finish"] == (choice["finish_reason"], choice["stop_reason"])
        if "stop" in body:
            assert {c["finish_reason"] for c in expected["choices"][1:3]} == {"stop"}
        if body.get("ignore_eos") is False:  # a choice the model's EOS ended
            assert any(c["finish_reason"] == "stop" and c["stop_reason"] is None for c in expected["choices"])
    chat = {"messages": MESSAGES, "n": 2, "max_tokens": 12, "seed": 2, "logprobs": True, "stop": "e"}
    expected = post(client, "/v1/chat/completions", **chat)
    chunks = events(client.post("/v1/chat/completions", json={**chat, "stream": True,
                                                              "stream_options": {"include_usage": True}}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected["usage"]
    streamed = by_choice(chunks)
    for choice in expected["choices"]:
        got = streamed[choice["index"]]
        assert got["text"] == choice["message"]["content"] and got["token_ids"] == choice["token_ids"]
        assert got["logprobs"] == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]])
        assert got["finish"] == (choice["finish_reason"], choice["stop_reason"])


def test_a_live_stream_sends_tokens_while_it_samples_and_stops_its_work_when_closed(checkpoint):
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.request_pipeline import ServeLimits
    from rlpipe.engines.streaming import live_events

    app = build_app(checkpoint, limits=ServeLimits(chunk_sequences=1))
    state = app.state.rlpipe

    async def main():
        params = SamplingParams(max_new_tokens=150, seed=0)
        start = time.perf_counter()
        stream = live_events(state, [[5, 6, 7]], params)
        first = await anext(stream)
        first_s = time.perf_counter() - start
        async for event in stream:
            last = event
        whole_s = time.perf_counter() - start
        # three prompts in three parts (chunk_sequences=1): closing after the first token drops
        # the parts not yet started
        cut = live_events(state, [[5, 6, 7], [8, 9], [10]], SamplingParams(max_new_tokens=20, seed=0))
        await anext(cut)
        await cut.aclose()
        await asyncio.sleep(0.5)
        await state.batcher.stop()
        return first, first_s, last, whole_s

    first, first_s, last, whole_s = asyncio.run(main())
    assert first[:3] == ("token", 0, 0) and last[0] == "done"
    assert last[1][0][0].tokens[0] == first[3]
    assert first_s < whole_s / 4, (first_s, whole_s)  # the first token came long before the last
    assert state.batcher.stats.dropped == 1 and state.batcher.stats.engine_calls < 4


def test_nulls_mean_the_defaults(client):
    """Clients that send every field, unset ones as null, get the defaults."""
    nulls = {"max_tokens": None, "temperature": None, "top_p": None, "n": None, "stop": None, "seed": None,
             "logprobs": None, "stream": None, "user": None, "presence_penalty": None}
    out = post(client, "/v1/completions", prompt="1", **nulls)
    assert len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None
    assert len(out["choices"][0]["token_ids"]) <= 16  # max_tokens' default
    chat = post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=3,
                **{k: v for k, v in nulls.items() if k not in ("max_tokens", "logprobs")},
                tools=None, tool_choice=None, top_logprobs=None)
    assert len(chat["choices"]) == 1 and len(chat["choices"][0]["token_ids"]) <= 3
    refused = client.post("/v1/completions", json={"prompt": None})
    assert refused.status_code == 400 and "prompt" in refused.json()["error"]["message"]


def test_a_chat_without_max_tokens_gets_what_the_cap_allows(checkpoint, monkeypatch):
    from rlpipe.engines.request_pipeline import ServeLimits

    with TestClient(build_app(checkpoint, limits=ServeLimits(max_tokens=5)), base_url="http://localhost") as c:
        model = c.app.state.rlpipe.slot.current.engine.model
        monkeypatch.setattr(model.config, "max_position_embeddings", 100_000)  # a context above the cap
        out = post(c, "/v1/chat/completions", messages=MESSAGES, ignore_eos=True)["choices"][0]
        assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"


def test_a_stream_past_its_deadline_ends_with_an_error_event(checkpoint):
    from rlpipe.engines.request_pipeline import ServeLimits

    limits = ServeLimits(request_timeout_s=0.3, max_tokens=3000)
    with TestClient(build_app(checkpoint, limits=limits), base_url="http://localhost") as c:
        response = c.post("/v1/completions", json={"prompt": "1", "max_tokens": 3000, "ignore_eos": True,
                                                   "stream": True})
        chunks = events(response)
        assert response.status_code == 200 and chunks[0]["choices"][0]["index"] == 0  # tokens came first
        assert chunks[-1] == {"error": {"message": "request took longer than request_timeout_s=0.3 "
                                                   "(--request-timeout-s)", "type": "invalid_request_error",
                                        "code": 504}}


def test_a_deadline_that_passes_while_the_consumer_waits_reaches_the_stream_as_its_error():
    """The request deadline lands while the reader of the stream awaits something of its own
    (the socket send of the last chunk): the stream still ends with the 504 error, and the
    reader's own wait is not cancelled under it."""
    from types import SimpleNamespace

    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.request_pipeline import RequestError, ServeLimits
    from rlpipe.engines.streaming import live_events

    class SlowBatcher:
        async def submit(self, prompts, params, on_token):
            for k in range(1000):
                on_token(0, 0, k, 0.0)
                await asyncio.sleep(0.01)

    state = SimpleNamespace(batcher=SlowBatcher(), limits=ServeLimits(request_timeout_s=0.2))

    async def main():
        seen, outcome = 0, None
        try:
            async for _event in live_events(state, [[1]], SamplingParams(max_new_tokens=5)):
                seen += 1
                await asyncio.sleep(0.15)  # the reader's own wait, across the deadline
        except RequestError as err:
            outcome = err
        return seen, outcome

    seen, outcome = asyncio.run(main())
    assert seen >= 1 and isinstance(outcome, RequestError) and outcome.status == 504


def test_incremental_decoding_adds_up_to_the_whole_text():
    """A byte-level BPE (Qwen3's kind) and the character tokenizer: random completions with
    special tokens and characters split across tokens stream deltas that add up to the whole
    decoded text, and stop strings cut where the answer without `stream` cuts."""
    import random

    from rlpipe.engines.openai_output import finish
    from rlpipe.engines.streaming import ChoiceStream

    from tests.bpe_tokenizer import build_qwen3_like_tokenizer

    rng = random.Random(0)
    for tok in (build_qwen3_like_tokenizer(), build_tokenizer()):
        pieces = ["Let me think", " 12+30", "é", "ü", "日本", "<|im_end|>", "<tool_call>", "\n", " ", "42."]
        for trial in range(60):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
            ids = tok(text, add_special_tokens=False)["input_ids"]
            skip = trial % 2 == 0
            whole = tok.decode(ids, skip_special_tokens=skip)
            stops = tuple(rng.sample([" 12", "日", "42", "\n"], rng.randint(0, 2)))
            stream = ChoiceStream(tok, stops, (), skip, False)
            deltas = []
            for t in ids:
                deltas.append(stream.add(t, -1.0))
                if stream.done is not None:
                    break
            else:
                deltas.append(stream.close("length"))
            expected = finish(Completion(ids, [-1.0] * len(ids), "length"), tok, stops, (), skip_special_tokens=skip)
            assert "".join(deltas) == stream.done.text == expected.text, (text, stops)
            assert stream.done.tokens == expected.tokens and stream.done.stop_reason == expected.stop_reason
            if not stops:
                assert expected.text == whole
