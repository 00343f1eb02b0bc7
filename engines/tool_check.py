"""The tools path of `rlpipe serve`, seen end to end on a tiny checkpoint written here (no hub).

    python -m rlpipe.engines.tool_check tiny-tools

writes `tiny-tools/checkpoints/step_000000`: the `tiny-dense` preset with random weights (seed
0) and rlpipe's character tokenizer carrying models/tool_template.py's TOOLS_CHAT_TEMPLATE
(Qwen3's tools format). It then serves that folder as `rlpipe serve tiny-tools
--tool-call-parser hermes` does, on a free loopback port, and sends two chat requests:

1. a user question with `tools` (a `get_weather` function): the prompt the server rendered
   (`prompt_token_ids`, decoded) must hold the tool's JSON inside `<tools></tools>`; the reply is
   printed as the hermes parser left it (random weights write noise, so `tool_calls` is empty
   unless the noise happens to be a `<tool_call>` block);
2. the follow-up a client sends after calling the tool: the assistant message with its
   `tool_calls`, then a `tool` message; its prompt must render the call as a hermes
   `<tool_call>` block and the result inside `<tool_response>`.

Exit status 0 when both prompts hold what they must, 1 otherwise (the line names what is
missing). The same folder then serves any client: `rlpipe serve tiny-tools --tool-call-parser
hermes`. How a `<tool_call>` in a reply becomes OpenAI `tool_calls` (streamed and not) is tested
with a scripted model in tests/unit/test_serve_tools.py, since an untrained model never writes one.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = {"id": "call-0", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
WEATHER_RESULT = "18 C, light rain"
PARSER = "hermes"
MAX_TOKENS = 24


def write_tool_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """`folder/checkpoints/step_000000`: tiny-dense (random weights of `seed`) with the character
    tokenizer and TOOLS_CHAT_TEMPLATE; the checkpoint's path."""
    from rlpipe.models.presets import build_model
    from rlpipe.models.tokenizer import IM_END, build_tokenizer
    from rlpipe.models.tool_template import TOOLS_CHAT_TEMPLATE
    from rlpipe.training.checkpoint_io import save_checkpoint

    tokenizer = build_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE)
    model = build_model("tiny-dense", vocab_size=len(tokenizer), seed=seed, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END), bos_token_id=None)
    return save_checkpoint(folder, 0, model.eval(), tokenizer)


def follow_up(reply_calls: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The question, the assistant's tool call (`reply_calls`, default WEATHER_CALL) and the
    tool's result: what a client sends after running the tool."""
    calls = reply_calls or [WEATHER_CALL]
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": WEATHER_RESULT}]


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The `<tools>` block the template writes for `tools` (one JSON object a line)."""
    return "<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>"


def missing_from_question(prompt_text: str) -> str | None:
    """What the first prompt lacks (None: the tool's schema sits in the system turn's block)."""
    if tools_block([WEATHER_TOOL]) not in prompt_text.split("<|im_end|>", 1)[0]:
        return "the get_weather schema inside <tools></tools> of the system turn"
    return None


def missing_from_follow_up(prompt_text: str) -> str | None:
    """What the follow-up prompt lacks (None: the call and its result are rendered)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    result = f"<|im_start|>user\n<tool_response>\n{WEATHER_RESULT}\n</tool_response><|im_end|>"
    for what, text in (("the assistant's <tool_call> block", call), ("the tool's <tool_response>", result)):
        if text not in prompt_text:
            return what
    return None


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not server.started:
            raise RuntimeError("the server did not start within 60 s")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def post_chat(base: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/chat/completions; the answer's JSON."""
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def indent(text: str) -> str:
    return "\n".join(("    " + line).rstrip() for line in text.split("\n"))


def run_check(folder: Path, out: Callable[[str], None] = print) -> int:
    """Write the checkpoint, serve it, send both requests and print what came back; exit status."""
    from rlpipe.engines.serve_app import build_app

    path = write_tool_checkpoint(folder)
    out(f"wrote {path}: tiny-dense, random weights, a chat template that renders tools (Qwen3's format)")
    app = build_app(folder, served_model_names=[str(folder)], tool_call_parser=PARSER, device="cpu")
    tokenizer = app.state.rlpipe.slot.current.tokenizer
    with serving(app) as base:
        out(f"serving it as `rlpipe serve {folder} --tool-call-parser {PARSER}` does, at {base}")
        first = post_chat(base, {"messages": QUESTION, "tools": [WEATHER_TOOL], "temperature": 0,
                                 "max_tokens": MAX_TOKENS})
        second = post_chat(base, {"messages": follow_up(), "tools": [WEATHER_TOOL], "temperature": 0,
                                  "max_tokens": MAX_TOKENS})
    prompts = [tokenizer.decode(a["prompt_token_ids"], skip_special_tokens=False) for a in (first, second)]
    choice = first["choices"][0]
    out(f"\n1. messages + tools: the prompt the server rendered ({first['usage']['prompt_tokens']} tokens):")
    out(indent(prompts[0]))
    out(f"   reply ({PARSER} parser, random weights): finish_reason={choice['finish_reason']!r} "
        f"content={choice['message']['content']!r} tool_calls={choice['message']['tool_calls']}")
    out(f"\n2. the follow-up with the assistant's tool_calls and a tool message ({second['usage']['prompt_tokens']} "
        "tokens), from the user turn on:")
    out(indent("<|im_start|>user" + prompts[1].split("<|im_start|>user", 1)[1]))
    missing = missing_from_question(prompts[0]) or missing_from_follow_up(prompts[1])
    if missing:
        out(f"\ntool_check: FAILED: the prompt lacks {missing}")
        return 1
    out("\ntool_check: ok: the tools reach the prompt; the tool call and its result are rendered")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpipe.engines.tool_check",
                                     description="Write a tiny checkpoint whose chat template renders tools, "
                                     "serve it with --tool-call-parser hermes and show what a tools request renders.")
    parser.add_argument("folder", help="where the checkpoint is written (FOLDER/checkpoints/step_000000)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        print(f"tool_check: {args.folder!r} is a file, not a folder", file=sys.stderr)
        return 2
    return run_check(folder)


if __name__ == "__main__":
    sys.exit(main())
