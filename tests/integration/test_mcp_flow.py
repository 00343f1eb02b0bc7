"""An RL run whose episodes call an MCP server's tool: configured by `[[task.mcp_servers]]`,
started with the run, called, recorded in the rollouts table, and
stopped when the run ends.

It needs the flow because what it checks spans the run: the config reaching the environment, the
server's process started before the first step and gone after the last, and the calls reaching
the stored tables. The sampler is forced (TorchEngine.generate replaced) so that a fresh tiny
model writes tool calls; training, scoring and the tables are the real ones. One step, the tiny
preset.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SERVER = textwrap.dedent('''
    import os, sys
    from mcp.server.mcpserver import MCPServer

    open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
    server = MCPServer("adder")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    server.run()
''')


def _forced_generate(tokenizer):
    """A sampler that calls `add` on the prompt's operands, then answers: right for even samples,
    wrong for odd ones (so groups have reward variance)."""
    from rlpipe.engines.base import Completion

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    counter = iter(range(10**9))

    def generate(self, prompts, params, on_token=None):
        out = []
        for prompt in prompts:
            text = tokenizer.decode(prompt, skip_special_tokens=False)
            a, b = map(int, re.search(r"<\|im_start\|>user\n(\d+)\+(\d+)=", text).groups())
            if "<|im_start|>tool" not in text:
                reply = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
            else:
                reply = str(a + b + next(counter) % 2)
            tokens = tokenizer.encode(reply, add_special_tokens=False)[: params.max_new_tokens - 1] + [end]
            out.append([Completion(tokens, [-1.0] * len(tokens), "stop") for _ in range(params.n)])
        return out

    return generate


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rl_run_calls_an_mcp_tool_and_stops_its_server(tmp_path, monkeypatch, prefect_in_process):
    pytest.importorskip("mcp")
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.flows.rl import rl_flow
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.storage.catalog import connect

    monkeypatch.setattr(TorchEngine, "generate", _forced_generate(build_tokenizer()))
    script, pids = tmp_path / "server.py", tmp_path / "pids.txt"
    script.write_text(SERVER)
    config = tomllib.loads((ROOT / "configs" / "rl.toml").read_text())
    config |= {"runs_root": str(tmp_path / "runs")}
    config["tracking"] = {"enabled": False}
    config["task"] |= {"tool_max_turns": 2, "eval_examples": 2,
                       "mcp_servers": [{"name": "adder", "command": sys.executable,
                                        "args": [str(script), str(pids)]}]}
    config["rl"] |= {"steps": 1, "eval_every": 0, "checkpoint_every": 0, "prompts_per_step": 2,
                     "group_size": 2, "sampling": {"max_new_tokens": 96}}
    rl_flow(config=config)
    with connect(tmp_path / "runs" / "rl") as con:
        calls = con.sql("""
            select m->>'$.tool_call.server', m->>'$.tool_call.name', m->>'$.tool_call.error', m->>'$.content',
                   json_extract(m, '$.tool_call.arguments')
            from (select unnest(from_json(messages, '["json"]')) as m from rollouts)
            where m->>'$.role' = 'tool'""").fetchall()
        turns = con.sql("select distinct n_turns from rollouts").fetchall()
        rewards = {r for (r,) in con.sql("select reward from scores").fetchall()}
    assert calls and all(c[:3] == ("adder", "add", None) for c in calls)
    assert all(str(sum(json.loads(c[4]).values())) == c[3] for c in calls)  # the server's sums
    assert turns == [(2,)] and 1.0 in rewards
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 1 and _gone(started[0])  # one server for the run, stopped at its end
