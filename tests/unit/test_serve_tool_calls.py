"""`rlpipe serve` with tool calls: an agent served with its tool and driven by the `openai`
client, Hermes tool calls streamed and answered, parsed by the same parser the calculator
environment uses. The rest of the OpenAI/vLLM drop-in is test_serve_compat.py's."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from rlpipe.envs.base import Example
from rlpipe.envs.calculator import TOOL, CalculatorEnv, run_tool
from rlpipe.models.chat import template_ids
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.models.tool_calls import CalculatorParser, HermesParser, ToolCall
from rlpipe.training.checkpoint_io import save_checkpoint

from tests.scripted_engine import scripted_app

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "12+30="}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    return save_checkpoint(root, 0, model, tok)


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


def calculator_reply(prompt_text: str) -> str:
    """The calculator model's behaviour: call the tool, then answer with its result."""
    if "<|im_start|>tool\n" in prompt_text:
        result = prompt_text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0]
        return f"ans {result}"
    expression = prompt_text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    return f"calc {expression}"


def test_a_calculator_agent_is_served_with_its_tool(checkpoint):
    """The openai client runs the tool loop against the server: the call comes back as
    `tool_calls`, the client sends the tool's result, the answer is right; the turns the model
    saw are the ones the environment's episodes render."""
    with TestClient(scripted_app(checkpoint, calculator_reply, "calculator"), base_url="http://localhost") as c:
        api = api_for(c)
        messages = [{"role": "user", "content": "37*48"}]
        first = api.chat.completions.create(model=api.models.list().data[0].id, messages=messages, tools=[TOOL])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calc"
        assert json.loads(call.function.arguments) == {"expression": "37*48"}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": run_tool(json.loads(call.function.arguments)["expression"])}]
        second = c.post("/v1/chat/completions", json={"messages": messages, "tools": [TOOL]}).json()
        assert second["choices"][0]["message"]["content"] == "ans 1776"
        assert second["choices"][0]["finish_reason"] == "stop"
        env = CalculatorEnv()
        example = Example("calculator", "x", "37*48", 1776)
        transcript = [{"role": "user", "content": "37*48"}, {"role": "assistant", "content": "calc 37*48"},
                      {"role": "tool", "content": "1776"}, {"role": "assistant", "content": "ans 1776"}]
        tok = build_tokenizer()
        assert second["prompt_token_ids"] == template_ids(tok, transcript[:3], add_generation_prompt=True)
        assert env.reward(example, transcript).reward == 1.0
        # tool_choice "none", or no parser: the reply stays text
        plain = c.post("/v1/chat/completions", json={"messages": messages[:1], "tools": [TOOL],
                                                     "tool_choice": "none"}).json()["choices"][0]
        assert plain["message"]["content"] == "calc 37*48" and plain["finish_reason"] == "stop"


def test_hermes_tool_calls_stream_and_answer(checkpoint):
    reply = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
    with TestClient(scripted_app(checkpoint, lambda _: reply, "hermes"), base_url="http://localhost") as c:
        api = api_for(c)
        out = api.chat.completions.create(model=api.models.list().data[0].id, messages=MESSAGES, tools=[TOOL])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [
            ("calc", {"expression": "2*3"})]
        chunks = list(api.chat.completions.create(model=out.model, messages=MESSAGES, tools=[TOOL], stream=True))
        calls = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
        assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            (0, "calc", {"expression": "2*3"})]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me compute."
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parsers():
    hermes = HermesParser()
    two = ('pre <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
           '<tool_call>{"name": "b", "parameters": {"y": [2]}}</tool_call>')
    assert hermes.parse(two).content == "pre"
    assert hermes.parse(two).calls == (ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2]}))
    cut = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}'  # max_tokens before </tool_call>
    assert hermes.parse(cut).calls == (ToolCall("a", {"x": 1}),)
    for broken in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                   '<tool_call>["a"]</tool_call>', "no call at all"):
        assert hermes.parse(broken).calls == () and hermes.parse(broken).content == broken
    calc = CalculatorParser()
    assert calc.parse(" calc 12*3 ").calls == (ToolCall("calc", {"expression": "12*3"}),)
    assert calc.parse("ans 36").calls == () and calc.parse("ans 36").content == "ans 36"
    assert calc.to_text("", [ToolCall("calc", {"expression": "12*3"})]) == "calc 12*3"
    assert calc.parse(calc.to_text("", [ToolCall("calc", {"expression": "5-1"})])).calls[0].arguments == {
        "expression": "5-1"}


def test_the_calculator_env_steps_as_before():
    """The env finds calls with the shared parser: the same turns are calls as with the prefix
    rule it had, so what it trains on is unchanged."""
    env = CalculatorEnv()
    example = Example("calculator", "x", "12*34", 408)
    for text in ("calc 12*34", "  calc12*34", "calculator", "calc", "ans 408", "x calc 1", "", "CALC 1*2"):
        result = env.step(example, [], text)
        old_rule = text.strip().startswith("calc")
        assert (not result.done) == old_rule, text
        if old_rule:
            assert result.messages_to_append == [{"role": "tool", "content": run_tool(text.strip()[4:])}]
