"""The tools path of `rlpipe serve` end to end on the bundled tiny checkpoint whose chat template
renders tools (engines/tool_check.py, models/tool_template.py): the schema reaches the prompt,
a `<tool_call>` in the reply becomes OpenAI `tool_calls` (streamed and not), and the follow-up
with the call and the tool's result renders them. The built-in template is left as it was."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.tool_check import (
    QUESTION,
    WEATHER_RESULT,
    WEATHER_TOOL,
    follow_up,
    missing_from_follow_up,
    missing_from_question,
    run_check,
    tools_block,
    write_tool_checkpoint,
)
from rlpipe.models.chat import template_ids
from rlpipe.models.tokenizer import CHAT_TEMPLATE, build_tokenizer
from rlpipe.models.tool_template import TOOLS_CHAT_TEMPLATE

from tests.bpe_tokenizer import QWEN3_TEMPLATE
from tests.scripted_engine import scripted_app

PLAIN = [{"role": "system", "content": "You add."}, {"role": "user", "content": "12+30="},
         {"role": "assistant", "content": "42"}, {"role": "user", "content": "and 1+1?"}]
# CHAT_TEMPLATE's rendering of PLAIN, as it was before the tools template existed
PLAIN_TEXT = ("<|im_start|>system\nYou add.<|im_end|>\n<|im_start|>user\n12+30=<|im_end|>\n"
              "<|im_start|>assistant\n42<|im_end|>\n<|im_start|>user\nand 1+1?<|im_end|>\n<|im_start|>assistant\n")
CALL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tool_checkpoint(tmp_path_factory.mktemp("tiny-tools"))


def test_the_built_in_template_is_unchanged_and_the_tools_one_agrees_without_tools():
    plain, tools = build_tokenizer(), build_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE)
    assert plain.chat_template == CHAT_TEMPLATE
    assert plain.apply_chat_template(PLAIN, tokenize=False, add_generation_prompt=True) == PLAIN_TEXT
    # tools passed to the built-in template change nothing (the calculator agent is served so)
    assert template_ids(plain, PLAIN, True, tools=[WEATHER_TOOL]) == template_ids(plain, PLAIN, True)
    for messages in (PLAIN, PLAIN[1:], PLAIN[:3]):
        for generation in (True, False):
            assert template_ids(tools, messages, generation) == template_ids(plain, messages, generation)
        masks = [tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)["assistant_masks"]
                 for tok in (plain, tools)]
        assert masks[0] == masks[1]


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL, {"type": "function", "function": {"name": "noop"}}]])
def test_the_tools_template_renders_as_qwen3s(tools):
    """Qwen3's own template (tests/fixtures) writes the same text for tools, calls and results."""
    tok = build_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE)
    two_calls = [*QUESTION, {"role": "assistant", "content": "Both.", "tool_calls": [
        {"function": {"name": "a", "arguments": {"x": 1}}}, {"name": "b", "arguments": '{"y": [2]}'}]},
        {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done"}, {"role": "user", "content": "again"}]
    for messages in (QUESTION, QUESTION[1:], follow_up(), two_calls):
        ours = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours == tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                               chat_template=QWEN3_TEMPLATE)
    assert ("<tools>" in ours) == bool(tools) and (not tools or tools_block(tools) in ours)


def test_the_served_prompt_carries_the_tools(checkpoint):
    """The real model: the schema sits in the prompt the server rendered, and counts in usage."""
    with TestClient(build_app(checkpoint, tool_call_parser="hermes"), base_url="http://localhost") as c:
        body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0}
        with_tools = c.post("/v1/chat/completions", json={**body, "tools": [WEATHER_TOOL]}).json()
        without = c.post("/v1/chat/completions", json=body).json()
    tok = build_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE)
    text = tok.decode(with_tools["prompt_token_ids"], skip_special_tokens=False)
    assert missing_from_question(text) is None and missing_from_question(
        tok.decode(without["prompt_token_ids"], skip_special_tokens=False)) is not None
    assert with_tools["prompt_token_ids"] == template_ids(tok, QUESTION, True, tools=[WEATHER_TOOL])
    assert with_tools["usage"]["prompt_tokens"] == len(with_tools["prompt_token_ids"]) > len(without["prompt_token_ids"])


def weather_model(prompt_text: str) -> str:
    """A model that calls get_weather when its schema is in the prompt, then reads the result."""
    if "<tool_response>" in prompt_text:
        return "It is " + prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0] + "."
    return "Let me look.\n" + CALL_REPLY if tools_block([WEATHER_TOOL]) in prompt_text else "I cannot look."


def sse_chunks(response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tool_calls_are_parsed_streamed_and_not_and_the_follow_up_renders_them(checkpoint):
    with TestClient(scripted_app(checkpoint, weather_model, "hermes"), base_url="http://localhost") as c:
        body = {"messages": QUESTION, "tools": [WEATHER_TOOL]}
        first = c.post("/v1/chat/completions", json=body).json()
        (choice,) = first["choices"]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me look."
        assert [(t["type"], t["function"]["name"], json.loads(t["function"]["arguments"]))
                for t in message["tool_calls"]] == [("function", "get_weather", {"city": "Paris"})]
        chunks = sse_chunks(c.post("/v1/chat/completions", json={**body, "stream": True}))
        calls = [t for ch in chunks for t in ch["choices"][0]["delta"].get("tool_calls") or []]
        assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
            (0, "get_weather", {"city": "Paris"})]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == "Let me look."
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the client runs the tool and sends the call back with its result
        messages = [*QUESTION, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                         "content": WEATHER_RESULT}]
        second = c.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL]}).json()
        without_tools = c.post("/v1/chat/completions", json={"messages": QUESTION}).json()
    tok = build_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE)
    text = tok.decode(second["prompt_token_ids"], skip_special_tokens=False)
    assert missing_from_follow_up(text) is None
    assert text.endswith("<|im_start|>assistant\nLet me look.\n" + CALL_REPLY + "<|im_end|>\n<|im_start|>user\n"
                         f"<tool_response>\n{WEATHER_RESULT}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert second["choices"][0]["message"] == {"role": "assistant", "content": f"It is {WEATHER_RESULT}.",
                                               "tool_calls": []}
    assert second["choices"][0]["finish_reason"] == "stop"
    assert without_tools["choices"][0]["message"]["content"] == "I cannot look."


def test_the_check_command_writes_serves_and_shows_the_rendering(tmp_path):
    lines: list[str] = []
    assert run_check(tmp_path / "tiny-tools", out=lines.append) == 0
    text = "\n".join(lines)
    assert (tmp_path / "tiny-tools" / "checkpoints" / "step_000000" / "metadata.json").is_file()
    assert tools_block([WEATHER_TOOL]).replace("\n", "\n    ") in text
    assert "</tool_call><|im_end|>" in text and "<tool_response>" in text and text.endswith("are rendered")
    assert missing_from_question("<|im_start|>system\nno tools<|im_end|>").startswith("the get_weather schema")
    assert missing_from_follow_up(text.split("2. ")[0]) == "the assistant's <tool_call> block"
