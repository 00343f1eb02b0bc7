"""MCP servers that misbehave (envs/mcp_toolbox.py): one that dies mid-run (stdio or streamable
HTTP) is answered as an error and leaves no process, one that floods a reply is cut as it
streams, one stuck in the middle of a reply is refused in one line, and closing ends a server's
whole process group. The test server and its fixtures are test_mcp_tools.py's."""

from __future__ import annotations

import time

import pytest
from rlpipe.envs.config import McpServerConfig
from rlpipe.envs.mcp_toolbox import McpToolbox
from test_mcp_tools import (  # same folder: pytest puts it on sys.path
    SERVER,
    _gone,
    _start_http,
    _stdio,
)


@pytest.fixture(scope="module")
def server_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(SERVER)
    return path


def test_a_server_that_dies_is_answered_as_an_error_and_leaves_no_process(server_script):
    with McpToolbox([_stdio(server_script)]) as box:
        pid = int(box.call("pid", {}).text)
        died = box.call("die", {})
        assert died.error == "server_error" and "'local'" in died.text
        after = box.call("add", {"a": 1, "b": 1})
        assert after.error == "server_error"
    assert _gone(pid)


def test_an_http_server_that_dies_is_answered_as_an_error(server_script, tmp_path):
    url, proc = _start_http(server_script, tmp_path / "server.log")
    try:
        with McpToolbox([McpServerConfig(name="remote", url=url)]) as box:
            assert box.call("add", {"a": 1, "b": 2}).text == "3"
            died = box.call("die", {})
            assert died.error == "server_error" and "'remote'" in died.text
            assert proc.wait(10) == 3
            after = box.call("add", {"a": 1, "b": 2})
            assert after.error == "server_error" and "'remote'" in after.text
    finally:
        proc.kill()
        proc.wait(10)


def test_close_ends_the_servers_whole_process_group(server_script):
    with McpToolbox([_stdio(server_script)]) as box:
        server_pid = int(box.call("pid", {}).text)
        helper = int(box.call("helper", {}).text)
        assert not _gone(helper)
    for _ in range(50):
        if _gone(helper):
            break
        time.sleep(0.1)
    assert _gone(server_pid) and _gone(helper)


def test_a_huge_reply_comes_back_cut_as_it_streams_and_the_next_call_is_not_held_up(server_script):
    with McpToolbox([_stdio(server_script, call_timeout_s=20.0, max_output_chars=50)]) as box:
        started = time.monotonic()
        huge = box.call("big", {"n": 32 << 20})
        took = time.monotonic() - started
        assert huge.error is None and huge.text.startswith("x" * 50 + "\n[... reply cut at max_output_chars")
        assert took < 10, took  # not the call timeout: 20 s before
        started = time.monotonic()
        assert box.call("add", {"a": 2, "b": 3}).text == "5"
        assert time.monotonic() - started < 5


def test_a_server_stuck_in_the_middle_of_a_reply_is_refused_in_one_line(server_script):
    with McpToolbox([_stdio(server_script, call_timeout_s=2.0, max_output_chars=50)]) as box:
        assert box.call("stall", {}).error == "timeout"
        started = time.monotonic()
        refused = box.call("add", {"a": 2, "b": 3})
        assert refused.error == "server_error" and "\n" not in refused.text
        assert "is still sending the rest of a reply cut at max_output_chars" in refused.text
        assert time.monotonic() - started < 3
