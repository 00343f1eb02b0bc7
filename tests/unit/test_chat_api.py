"""`rlpipe serve` speaks /v1/chat/completions in OpenAI's shape with vLLM's token ids and
log-probs, equal to the in-process engine's; an OpenAI client drives it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.chat import template_ids
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint

MESSAGES = [{"role": "system", "content": "You add."}, {"role": "user", "content": "12+30="}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0,
                        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return save_checkpoint(root, 0, model, tok)


@pytest.fixture()
def client(checkpoint):
    with TestClient(build_app(checkpoint), base_url="http://localhost") as c:
        yield c


def test_chat_shape_token_ids_and_logprobs_match_the_engine(client, checkpoint):
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 8, "temperature": 0.8, "seed": 5,
            "logprobs": True, "return_tokens_as_token_ids": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    tok = build_tokenizer()
    prompt = template_ids(tok, MESSAGES, add_generation_prompt=True)
    assert out["object"] == "chat.completion" and out["prompt_token_ids"] == prompt
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = TorchEngine(load_checkpoint(checkpoint, restore_rng=False).model.eval())
    expected = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=8, temperature=0.8, seed=5,
                                                       stop_token_ids=(end, tok.eos_token_id)))[0]
    for j, (choice, want) in enumerate(zip(out["choices"], expected, strict=True)):
        assert choice["index"] == j and choice["token_ids"] == want.tokens
        assert choice["finish_reason"] == want.finish_reason
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == tok.decode(want.tokens, skip_special_tokens=True)
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in want.tokens]
        assert [c["logprob"] for c in content] == pytest.approx(want.logprobs, abs=1e-5)
    n_completion = sum(len(c["token_ids"]) for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n_completion,
                            "total_tokens": len(prompt) + n_completion}


def test_chat_content_parts_greedy_and_refusals(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "30="}]}]
    a = client.post("/v1/chat/completions", json={"messages": parts, "temperature": 0, "max_tokens": 5}).json()
    b = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "12+30="}],
                                                  "temperature": 0, "max_tokens": 5}).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"] and a["choices"][0]["logprobs"] is None
    for bad, message in [({"messages": []}, "messages is empty"),
                         ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice 'required'"),
                         ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs needs logprobs"),
                         ({"messages": MESSAGES, "response_format": {}}, "response_format"),
                         ({"messages": [{"role": "robot", "content": "x"}]}, "unknown chat role"),
                         ({"messages": MESSAGES, "model": "other"}, "does not exist"),
                         # the same sampling checks as /v1/completions (engines.protocol.sampling_params)
                         ({"messages": MESSAGES, "temperature": 1e-6}, "smaller ones overflow"),
                         ({"messages": MESSAGES, "seed": 2**64}, "seed must be in"),
                         ({"messages": MESSAGES, "echo": True}, "echo")]:
        response = client.post("/v1/chat/completions", json=bad)
        assert response.status_code in (400, 404) and message in response.text, (bad, response.text)


def test_openai_client_drives_the_server(client):
    openai = pytest.importorskip("openai")  # installed with the `verifiers` extra
    api = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=client)
    out = api.chat.completions.create(model=api.models.list().data[0].id, messages=MESSAGES, max_tokens=4,
                                      temperature=0, logprobs=True, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant" and len(choice.logprobs.content) == len(choice.token_ids)
    assert out.prompt_token_ids == template_ids(build_tokenizer(), MESSAGES, add_generation_prompt=True)
