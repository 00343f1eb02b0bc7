"""Tools from MCP servers (envs/mcp_toolbox.py, envs/mcp_tools.py): a tiny MCP server this file
writes and starts, over stdio and over streamable HTTP; listing, calling, every error path,
closing, and episodes whose scripted turns call a tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest
from rlpipe.core.config import ConfigError
from rlpipe.engines.base import SamplingParams
from rlpipe.envs.arithmetic import ArithmeticConfig, ArithmeticEnv
from rlpipe.envs.base import Example, StepResult
from rlpipe.envs.config import McpServerConfig
from rlpipe.envs.mcp_toolbox import McpToolbox, from_environment, schema_error
from rlpipe.envs.mcp_tools import McpToolsEnv, ToolUseOptions
from rlpipe.envs.multiturn import episode_reward, with_env_tools
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.storage.writer import conform

from tests.bpe_tokenizer import build_qwen3_like_tokenizer
from tests.ports import PortTaken, says_port_taken, start_on_free_port
from tests.scripted_engine import ScriptedEngine

pytest.importorskip("mcp")

SERVER = textwrap.dedent('''
    import os, sys, time
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("test tools")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def slow(seconds: float) -> str:
        """Sleep, then answer."""
        time.sleep(seconds)
        return "awake"

    @server.tool()
    def boom() -> str:
        """Always fails."""
        raise RuntimeError("kaboom")

    @server.tool()
    def shout(text: str) -> str:
        """The text, repeated."""
        return text * 100

    @server.tool()
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool()
    def getenv(name: str) -> str:
        """A variable of the server's environment ('' when unset)."""
        return os.environ.get(name, "")

    @server.tool()
    def die() -> str:
        """Ends the server's process."""
        os._exit(3)

    @server.tool()
    def helper() -> int:
        """Starts a helper process in the server's process group; its pid."""
        import subprocess
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid

    @server.tool()
    def big(n: int) -> str:
        """n characters."""
        return "x" * n

    @server.tool()
    def stall() -> str:
        """Writes most of a long reply line on the wire, then hangs in the middle of it."""
        import fcntl
        stderr = os.readlink("/proc/self/fd/2")
        for fd in range(3, 64):  # the wire: the SDK moved it off fd 1 (a write-only pipe of its own)
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if (target.startswith("pipe:") and target != stderr
                    and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY):
                os.write(fd, b'{"jsonrpc":"2.0","id":999999,"result":{"content":[{"type":"text","text":"'
                         + b"y" * (4 << 20))
        time.sleep(300)
        return "never"

    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
''')


# README's query ("Tools from MCP servers"): calls per tool and outcome
TOOL_CALLS_SQL = """
    select m->>'$.tool_call.name' as tool, m->>'$.tool_call.error' as error, count(*)
    from (select unnest(from_json(messages, '["json"]')) as m from rollouts)
    where m->>'$.role' = 'tool' group by all
"""


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (dead; its parent, gone too, left it to init to reap)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


@pytest.fixture(scope="module")
def server_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(SERVER)
    return path


def _stdio(script, name="local", **options) -> McpServerConfig:
    return McpServerConfig(name=name, command=sys.executable, args=[str(script)], **options)


def _start_http(script, log):
    """A streamable HTTP server of `script` on a free port: (its URL, its process)."""

    def start(port: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(script), "http", str(port)],
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                text = log.read_text()
                raise PortTaken(text) if says_port_taken(text) else AssertionError(text)
            if "Uvicorn running" in log.read_text():
                return proc
            time.sleep(0.1)
        proc.kill()
        raise AssertionError(f"the MCP HTTP server did not start: {log.read_text()[-2000:]}")

    port, proc = start_on_free_port(start)
    return f"http://127.0.0.1:{port}/mcp", proc


@pytest.fixture(scope="module")
def http_url(server_script, tmp_path_factory):
    """A streamable HTTP server the test starts on a free port (its URL)."""
    url, proc = _start_http(server_script, tmp_path_factory.mktemp("mcp-http") / "server.log")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def toolbox(server_script):
    """One stdio server shared by the tests that do not end it."""
    box = McpToolbox([_stdio(server_script, call_timeout_s=1.0, max_output_chars=50)])
    yield box
    box.close()


def test_tools_are_listed_in_openai_shape_and_into_the_chat_template(toolbox):
    assert toolbox.names == ["add", "slow", "boom", "shout", "pid", "getenv", "die", "helper", "big", "stall"]
    add = toolbox.tools[0]
    assert add["type"] == "function" and add["function"]["name"] == "add"
    assert add["function"]["description"] == "Add two integers."
    assert add["function"]["parameters"]["required"] == ["a", "b"]
    env = McpToolsEnv(ArithmeticEnv(ArithmeticConfig(eval_size=5)), toolbox)
    text = build_qwen3_like_tokenizer().apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True,
        **with_env_tools(env, {}))
    assert f"<tools>\n{json.dumps(add)}\n" in text


def test_calls_answer_and_every_failure_is_a_tool_reply_not_a_crash(toolbox):
    ok = toolbox.call("add", {"a": 2, "b": 40})
    assert (ok.text, ok.error, ok.server) == ("42", None, "local")
    unknown = toolbox.call("nope", {})
    assert unknown.error == "unknown_tool" and "'nope'" in unknown.text and "add" in unknown.text
    bad = toolbox.call("add", {"a": "x", "b": 1})
    assert bad.error == "bad_arguments" and "'x' is not of type 'integer'" in bad.text
    failed = toolbox.call("boom", {})
    assert failed.error == "tool_error" and "kaboom" in failed.text
    long = toolbox.call("shout", {"text": "ab"})
    assert long.error is None and long.text.startswith("ab" * 25 + "\n[... 150 more characters cut]")
    slow = toolbox.call("slow", {"seconds": 10})
    assert slow.error == "timeout" and "call_timeout_s=1" in slow.text and 0.9 < slow.seconds < 6
    # the server goes on answering after a call timed out
    assert toolbox.call("add", {"a": 1, "b": 1}).text == "2"
    assert toolbox.call("add", {"a": 1, "b": 1}).record() == {
        "server": "local", "name": "add", "arguments": {"a": 1, "b": 1}, "error": None,
        "seconds": pytest.approx(0.0, abs=5.0)}


def test_schema_errors_name_the_argument():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert schema_error(schema, {"n": 3}) is None
    assert schema_error(schema, {}) == "'n' is a required property"
    assert schema_error(schema, {"n": "3"}) == "n: '3' is not of type 'integer'"


def test_streamable_http_server_and_stdio_server_together(server_script, http_url):
    # both list the same tools: one server keeps `add`, the other everything but it
    servers = [_stdio(server_script, tools=["add", "pid"]),
               McpServerConfig(name="remote", url=http_url, tools=["boom", "slow"], call_timeout_s=0.5)]
    with McpToolbox(servers) as box:
        assert box.names == ["add", "pid", "boom", "slow"]
        assert box.call("add", {"a": 1, "b": 2}).text == "3"
        failed = box.call("boom", {})
        assert (failed.server, failed.error) == ("remote", "tool_error")
        assert box.call("slow", {"seconds": 5}).error == "timeout"
        stdio_pid = int(box.call("pid", {}).text)
    assert _gone(stdio_pid)  # closing ended the stdio server's process


def test_secrets_come_from_the_run_environment_by_name_never_from_the_config(server_script, monkeypatch):
    monkeypatch.setenv("RLPIPE_TEST_MCP_SECRET", "s3cret")
    monkeypatch.setenv("RLPIPE_TEST_MCP_OTHER", "kept")
    with McpToolbox([_stdio(server_script, pass_env=["RLPIPE_TEST_MCP_SECRET"], tools=["getenv"])]) as box:
        assert box.call("getenv", {"name": "RLPIPE_TEST_MCP_SECRET"}).text == "s3cret"
        # set in the run's environment but not named: not the server's
        assert box.call("getenv", {"name": "RLPIPE_TEST_MCP_OTHER"}).text == ""
    remote = McpServerConfig(name="remote", url="http://h/mcp", headers={"X-Team": "a"},
                             headers_env={"Authorization": "SEARCH_AUTH"})
    assert from_environment(remote, {"SEARCH_AUTH": "Bearer t"}) == {"Authorization": "Bearer t"}
    with pytest.raises(ValueError, match=r"^MCP server 'remote': environment variable 'SEARCH_AUTH' of "
                                         r"headers_env is not set$"):
        from_environment(remote, {})


@pytest.mark.slow
def test_starting_fails_in_one_line_naming_the_server(server_script, http_url, tmp_path):
    with pytest.raises(ValueError, match=r"^MCP server 'ghost' .*could not be started: .*$"):
        McpToolbox([McpServerConfig(name="ghost", command=str(tmp_path / "no-such-program"))])
    mute, pid_file = tmp_path / "mute.py", tmp_path / "mute.pid"
    mute.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"^MCP server 'mute' .*within connect_timeout_s=1$"):
        McpToolbox([McpServerConfig(name="mute", command=sys.executable, args=[str(mute)], connect_timeout_s=1)])
    assert time.monotonic() - started < 20 and _gone(int(pid_file.read_text()))  # not left behind
    with pytest.raises(ValueError, match=r"^MCP server 'local' lists no tool 'missing'; it lists: add, "):
        McpToolbox([_stdio(server_script, tools=["missing"])])
    with pytest.raises(ValueError, match=r"^MCP tool 'add' is listed by servers 'local' and 'remote'"):
        McpToolbox([_stdio(server_script), McpServerConfig(name="remote", url=http_url)])


@pytest.mark.parametrize(("entry", "message"), [
    ('name = "a"', "task.mcp_servers[0]: MCP server 'a': give exactly one of command (stdio) or url"),
    ('name = "a"\ncommand = "x"\nurl = "http://h/mcp"', "give exactly one of command (stdio) or url"),
    ('name = "a"\nurl = "ftp://h/mcp"', "url must start with http:// or https://, got 'ftp://h/mcp'"),
    ('name = "a"\ncommand = "x"\nheaders = { k = "v" }', "headers and headers_env apply to url servers only"),
    ('name = "a"\nurl = "http://h/mcp"\npass_env = ["K"]', "args, env, pass_env and cwd apply to command servers only"),
    ('name = "a"\ncommand = "x"\ncall_timeout_s = 0', "task.mcp_servers[0].call_timeout_s: must be > 0"),
    ('name = "a"\ncommand = "x"\n[[task.mcp_servers]]\nname = "a"\nurl = "http://h/mcp"',
     "server names must be unique, repeated: a"),
    ('name = "a"\ncommand = "x"\n[task]\ntool_call_parser = "nope"', "unknown parser 'nope'; known: calculator, hermes"),
])
def test_bad_mcp_config_is_refused_in_one_line_naming_the_key(tmp_path, entry, message):
    from rlpipe.tasks.config import load_config

    config = tmp_path / "run.toml"
    config.write_text(f"[[task.mcp_servers]]\n{entry}\n")
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_preflight_refuses_a_stdio_command_that_is_not_there(tmp_path):
    from rlpipe.tasks.config import load_config
    from rlpipe.tasks.preflight import preflight

    config = tmp_path / "run.toml"
    config.write_text(f'[[task.mcp_servers]]\nname = "a"\ncommand = "{tmp_path / "nothing"}"\n')
    with pytest.raises(ConfigError, match=r"^task.mcp_servers\[0\].command: '.*nothing' is not an executable"):
        preflight(load_config(config))
    config.write_text(f'[[task.mcp_servers]]\nname = "a"\ncommand = "{sys.executable}"\n'
                      'pass_env = ["RLPIPE_TEST_MCP_UNSET"]\n')
    with pytest.raises(ConfigError, match=r"^task.mcp_servers\[0\]: MCP server 'a': environment variable "
                                          r"'RLPIPE_TEST_MCP_UNSET' of pass_env is not set \(set it"):
        preflight(load_config(config))


def _scripted(tok, turns: list[str]) -> ScriptedEngine:
    """The k-th assistant turn of every episode writes turns[k]."""
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def play(prompt):
        k = tok.decode(prompt).count("<|im_start|>assistant") - 1
        return tok.encode(turns[k], add_special_tokens=False) + [end]

    return ScriptedEngine(play, end)


def test_an_episode_calls_the_tool_and_the_call_lands_in_the_rollout_row(toolbox):
    from rlpipe.rollouts.generation import GenerateOptions, SampleRound, generate_rollouts

    tok = build_qwen3_like_tokenizer()  # Qwen3's chat template, which renders `tools`
    env = McpToolsEnv(ArithmeticEnv(ArithmeticConfig(eval_size=5)), toolbox, ToolUseOptions(max_turns=3))
    assert env.max_turns == 3 and env.name == "arithmetic"
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    engine = _scripted(tok, [call, "42"])
    example = Example("arithmetic", "x", "12+30=", 42)
    (row,) = generate_rollouts(engine, tok, env, [example], GenerateOptions(SamplingParams(n=1, max_new_tokens=256), max_context=2048),
                               SampleRound(run_id="r", step=1, attempt=1, policy_version=0))
    # the tools were in every turn's context
    assert all(json.dumps(toolbox.tools[0]) in tok.decode(prompts[0]) for prompts, _ in engine.calls)
    messages = json.loads(row.messages)
    assert messages[1] == {"role": "assistant", "content": call}
    assert messages[2] == {"role": "tool", "name": "add", "content": "42", "tool_call": {
        "server": "local", "name": "add", "arguments": {"a": 12, "b": 30}, "error": None,
        "seconds": messages[2]["tool_call"]["seconds"]}}
    assert messages[3] == {"role": "assistant", "content": "42"}
    assert [(t["turn"], t["producer"]) for t in row.turns] == [(0, "model"), (0, "env"), (1, "model")]
    assert row.n_turns == 2 and row.finish_reason == "stop"
    env_span = row.turns[1]
    assert tok.decode(row.completion_tokens[env_span["start"]: env_span["start"] + env_span["length"]]) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    rollouts = conform("rollouts", [vars(row)], run_id="r", step=1)  # noqa: F841 - scanned by DuckDB below
    # the calls, queried from the rollouts table as docs/ shows
    assert duckdb.sql(TOOL_CALLS_SQL).fetchall() == [("add", None, 1)]
    assert episode_reward(env, vars(row), example).reward == 1.0


def test_a_failing_call_goes_back_to_the_model_and_the_episode_goes_on(toolbox, tmp_path):
    from rlpipe.envs.multiturn import episode_fields, run_episodes
    from rlpipe.storage.queries import run_canned
    from rlpipe.storage.writer import write_table

    tok = build_tokenizer()
    turns = ['<tool_call>{"name": "add", "arguments": {"a": "twelve"}}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "slow", "arguments": {"seconds": 10}}</tool_call>',
             '<tool_call>add(3, 4)</tool_call>', "7"]
    env = McpToolsEnv(ArithmeticEnv(ArithmeticConfig(eval_size=5)), toolbox, ToolUseOptions(max_turns=5))
    (group,) = run_episodes(_scripted(tok, turns), tok, env, [Example("arithmetic", "y", "3+4=", 7)],
                            SamplingParams(n=1, max_new_tokens=256), max_turns=5, max_tokens=4096)
    episode = group[0]
    errors = [m["tool_call"]["error"] for m in episode.messages if m["role"] == "tool"]
    assert errors == ["bad_arguments", "unknown_tool", "timeout", "bad_call"]
    assert episode.finish_reason == "stop" and episode.n_turns == 4
    # the canned query counts them per tool
    row = {"run_id": "r", "step": 1, "policy_version": 0, "env": "arithmetic", "example_id": "y", "group_id": "g",
           "sample_id": "s", "attempt": 1, **episode_fields(episode, tok)}
    write_table(tmp_path, "rollouts", 1, [row], run_id="r")
    got = run_canned([tmp_path], "tool_calls_by_step").to_pylist()
    assert [(r["server"], r["tool"], r["calls"], r["errors"], r["timeouts"]) for r in got] == [
        ("", "", 1, 1, 0), ("", "nope", 1, 1, 0), ("local", "add", 1, 1, 0), ("local", "slow", 1, 1, 1)]
    assert got[-1]["seconds_mean"] > 0.9
    assert episode_reward(env, episode, episode.example).reward == 1.0


def test_a_call_of_the_wrapped_environments_own_tool_is_its_own_step(toolbox):
    class OwnTool:
        name, max_turns, tools = "own", 2, [{"type": "function", "function": {"name": "mine"}}]

        def step(self, example, messages, completion_text):
            return StepResult([{"role": "tool", "content": "from the environment"}], done=False)

    env = McpToolsEnv(OwnTool(), toolbox)
    assert [t["function"]["name"] for t in env.tools][:2] == ["mine", "add"]
    own = env.step(None, [], '<tool_call>{"name": "mine", "arguments": {}}</tool_call>')
    assert own.messages_to_append == [{"role": "tool", "content": "from the environment"}]
    mcp = env.step(None, [], '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert mcp.messages_to_append[0]["content"] == "3"
