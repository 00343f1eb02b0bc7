"""The tools of Model Context Protocol servers behind one synchronous call, through the official
`mcp` Python SDK (`[[task.mcp_servers]]`, envs/config.py; episodes get them from envs/mcp_tools.py).

    toolbox = McpToolbox(servers)             # starts (stdio) or connects to (HTTP) every server
    toolbox.tools                             # their tools in OpenAI's `tools` shape
    outcome = toolbox.call("add", {"a": 2})   # a ToolOutcome: the reply text or the error said
    toolbox.close()                           # every server closed, no process left behind

Transports: a server with `command` is started as a child process speaking MCP over its stdin and
stdout (the SDK's `stdio_client`); a server with `url` is reached over streamable HTTP (the
SDK's `streamable_http_client`). The SDK is asynchronous, the environment's `step` is not: one
toolbox owns one event loop on a daemon thread, each server lives in one task there for the
whole run (its SDK `Client` opened and closed in that task), and a call is handed to that task
and waited for from the caller's thread, so several threads (one per engine) may call at once.

Every failure of a call is the model's to see, never the run's: an unknown tool, arguments that
do not match the tool's input schema (checked here with jsonschema before anything is sent), an
error the tool reports, a call over `call_timeout_s`, or a server that died are each answered with
a tool message saying so (`ToolOutcome.error` names the kind: `unknown_tool`, `bad_arguments`,
`tool_error`, `timeout`, `server_error`; a Hermes `<tool_call>` block that is not a call at all is
answered as `bad_call` by envs/mcp_tools.py). A server that died stays dead for the rest of the run;
calls to it are answered at once. Only starting fails the run: a server that does not start,
connect and list its tools within `connect_timeout_s`, a `tools` name it does not list, or two
servers listing the same tool name raise one line naming the server.

A stdio server's process is started in a process group of its own (the SDK's
`start_new_session`); `close()` ends that whole group, so a helper the server started (a
subprocess, a worker) does not outlive it even when the server itself exits at once. Its stdout
is read through a cap (`_CappedStdout`): a tool reply whose line passes `_line_cap(max_output_chars)`
bytes is cut as it streams in, answered at once with its first `max_output_chars` characters and
a note, and the rest of that line is discarded as it arrives, never held; a call to a server still
sending the rest of a cut reply a second later is refused in one line (a server that hangs in the
middle of a reply cannot hold up the calls after it). Replies over HTTP are cut after they arrive.
(The SDK spawns the process in `mcp.client.stdio._create_platform_compatible_process`; this
module wraps that function once, for the servers it starts.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlpipe.envs.config import McpServerConfig
from rlpipe.envs.mcp_stdio import (
    _BUSY_WAIT_S,
    _SPAWNING,
    CUT_META,
    _CappedStdout,
    _end_group,
    _hook_spawn,
)

# Seconds a call may overrun its own timeout before the caller stops waiting for the server task
# (the SDK's own deadline answers first; this one covers a server task that no longer answers).
_GRACE_S = 5.0
_CLOSE_S = 10.0


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call's result as the model sees it.

    server:    the server that owns the tool ('' for an unknown tool)
    error:     None, or the kind of failure: unknown_tool, bad_arguments, tool_error, timeout,
               server_error
    text:      the reply the model reads (the tool's output, or the error said in one line)
    seconds:   wall time of the call
    """

    server: str
    name: str
    arguments: dict[str, Any]
    text: str
    error: str | None
    seconds: float

    def record(self) -> dict[str, Any]:
        """The call as kept in the episode's tool message (`tool_call`)."""
        return {"server": self.server, "name": self.name, "arguments": self.arguments,
                "error": self.error, "seconds": round(self.seconds, 4)}


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP tool (name, description, input schema) in OpenAI's `tools` shape."""
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description or "",
        "parameters": dict(tool.input_schema or {"type": "object", "properties": {}})}}


def result_text(result: Any, max_chars: int) -> str:
    """The text of an MCP `CallToolResult`: its text blocks joined, other blocks named by type,
    the structured content as JSON when there is no block; cut to `max_chars`."""
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return clip("\n".join(parts), max_chars)


def clip(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and a note of how many were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters cut]"


def schema_error(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """None when `arguments` match the tool's JSON schema, else the first mismatch in one line."""
    import jsonschema

    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    except jsonschema.exceptions.SchemaError:
        return None  # the server's schema is its own business: let the server judge
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def from_environment(server: McpServerConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What `server` takes from the run's environment: its `pass_env` variables (stdio) or its
    `headers_env` headers (HTTP), by their names; ValueError naming a variable that is not set."""
    environ = os.environ if environ is None else environ
    wanted = {name: name for name in server.pass_env} | dict(server.headers_env)
    missing = sorted(f"{variable!r}" for variable in wanted.values() if variable not in environ)
    if missing:
        key = "pass_env" if server.pass_env else "headers_env"
        raise ValueError(f"MCP server {server.name!r}: environment variable {', '.join(missing)} of {key} is not set")
    return {key: environ[variable] for key, variable in wanted.items()}


async def _transport(server: McpServerConfig, stack: contextlib.AsyncExitStack) -> Any:
    """The SDK transport of `server`; an HTTP client it needs is closed with `stack`."""
    if server.command:
        from mcp import StdioServerParameters, stdio_client

        env = {**server.env, **from_environment(server)}
        return stdio_client(StdioServerParameters(command=server.command, args=list(server.args),
                                                  env=env or None, cwd=server.cwd or None))
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    # the SDK's default timeouts (30 s, 5 min for a stream's reads); the calls' own deadline is
    # call_timeout_s
    headers = {**server.headers, **from_environment(server)}
    http = await stack.enter_async_context(httpx2.AsyncClient(
        headers=headers, follow_redirects=True, timeout=httpx2.Timeout(30.0, read=300.0)))
    return streamable_http_client(server.url, http_client=http)


"""`_meta` key of a reply cut as it streamed in: the bytes its line had when it was cut."""
def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Server:
    """One server's connection, living in one task of the toolbox's loop."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self.dead: str | None = None
        self.queue: asyncio.Queue | None = None
        self.pending: set[concurrent.futures.Future] = set()
        self.pid: int | None = None  # a stdio server's process (its group's id)
        self.stdout: _CappedStdout | None = None

    async def run(self, ready: concurrent.futures.Future) -> None:
        from mcp import Client

        self.queue = asyncio.Queue()
        if self.config.command:
            _hook_spawn()
            _SPAWNING.set(self)  # this task's context: the spawn in _transport records it
        try:
            async with contextlib.AsyncExitStack() as stack:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    client = await stack.enter_async_context(
                        Client(await _transport(self.config, stack), mode="legacy"))
                    listing = await _list_tools(client)
                ready.set_result(listing)
                await self._serve(client)
        except BaseException as exc:  # noqa: BLE001 - said to every waiting call, and at start
            self.dead = _describe(exc)
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(self.dead))
            if not isinstance(exc, Exception):
                raise
        finally:
            self.dead = self.dead or "closed"
            _end_group(self.pid)  # helpers the server left in its group go with it
            for future in list(self.pending):
                if not future.done():
                    future.set_exception(ConnectionError(self.dead))

    def enqueue(self, item: tuple[str, dict[str, Any], concurrent.futures.Future]) -> None:
        """Hand a call to the server's task (on the loop's thread: a server that ended meanwhile
        fails the call at once rather than leaving it unread)."""
        if self.dead is not None or self.queue is None:
            item[2].set_exception(ConnectionError(self.dead or "not started"))
        else:
            self.queue.put_nowait(item)

    async def _serve(self, client: Any) -> None:
        import anyio

        async with anyio.create_task_group() as group:
            while (item := await self.queue.get()) is not None:
                group.start_soon(self._call, client, *item)
            group.cancel_scope.cancel()

    async def _call(self, client: Any, name: str, arguments: dict[str, Any],
                    future: concurrent.futures.Future) -> None:
        try:
            result = await client.call_tool(name, arguments, read_timeout_seconds=self.config.call_timeout_s)
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)


async def _list_tools(client: Any) -> list[Any]:
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += list(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


class McpToolbox:
    """The tools of several MCP servers behind one synchronous `call`; see the module docstring."""

    def __init__(self, servers: Sequence[McpServerConfig]) -> None:
        if not servers:
            raise ValueError("McpToolbox needs at least one MCP server")
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError("task.mcp_servers needs the MCP SDK: pip install -e '.[mcp]' in the checkout") from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlpipe-mcp", daemon=True)
        self._thread.start()
        self._servers: list[_Server] = []
        self._tasks: list[concurrent.futures.Future] = []
        self._owner: dict[str, tuple[_Server, Any]] = {}
        self._closed = False
        try:
            for config in servers:
                self._open(config)
        except BaseException:
            self.close()
            raise
        self.tools = [openai_tool(tool) for _, tool in self._owner.values()]

    def _open(self, config: McpServerConfig) -> None:
        server = _Server(config)
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._servers.append(server)
        self._tasks.append(asyncio.run_coroutine_threadsafe(server.run(ready), self._loop))
        where = config.url or " ".join([config.command, *config.args])
        try:
            listed = ready.result(timeout=config.connect_timeout_s + _GRACE_S)
        except TimeoutError:  # the caller's wait, or the server task's own deadline
            raise ValueError(f"MCP server {config.name!r} ({where}) did not start and list its tools within "
                             f"connect_timeout_s={config.connect_timeout_s:g}") from None
        except Exception as exc:  # noqa: BLE001 - one line naming the server
            raise ValueError(f"MCP server {config.name!r} ({where}) could not be started: {_describe(exc)}") from None
        names = {tool.name: tool for tool in listed}
        missing = sorted(set(config.tools or ()) - set(names))
        if missing:
            raise ValueError(f"MCP server {config.name!r} lists no tool {', '.join(map(repr, missing))}; "
                             f"it lists: {', '.join(sorted(names)) or 'none'}")
        for name in config.tools if config.tools is not None else names:
            if name in self._owner:
                raise ValueError(f"MCP tool {name!r} is listed by servers {self._owner[name][0].config.name!r} "
                                 f"and {config.name!r}; keep it on one (the servers' `tools` lists)")
            self._owner[name] = (server, names[name])

    @property
    def names(self) -> list[str]:
        """The tools' names, in listing order."""
        return list(self._owner)

    def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run one tool call; never raises for the call's own failures (see the module docstring)."""
        start = time.monotonic()

        def outcome(server: str, text: str, error: str | None) -> ToolOutcome:
            return ToolOutcome(server, name, dict(arguments), text, error, time.monotonic() - start)

        if name not in self._owner:
            return outcome("", f"error: unknown tool {name!r}; tools: {', '.join(self._owner)}", "unknown_tool")
        server, tool = self._owner[name]
        label = server.config.name
        problem = schema_error(dict(tool.input_schema or {}), arguments)
        if problem is not None:
            return outcome(label, f"error: bad arguments for {name!r}: {problem}", "bad_arguments")
        if server.dead is not None or self._closed:
            return outcome(label, f"error: MCP server {label!r} is not running ({server.dead or 'closed'})",
                           "server_error")
        deadline = time.monotonic() + _BUSY_WAIT_S
        while server.stdout is not None and server.stdout.discarding and time.monotonic() < deadline:
            time.sleep(0.01)
        if server.stdout is not None and server.stdout.discarding:
            return outcome(label, f"error: MCP server {label!r} is still sending the rest of a reply cut at "
                                  f"max_output_chars ({server.stdout.discarding} bytes so far); call it again later",
                           "server_error")
        future: concurrent.futures.Future = concurrent.futures.Future()
        server.pending.add(future)
        try:
            self._loop.call_soon_threadsafe(server.enqueue, (name, dict(arguments), future))
            result = future.result(timeout=server.config.call_timeout_s + _GRACE_S)
        except concurrent.futures.TimeoutError:
            return outcome(label, _timeout_text(name, server.config), "timeout")
        except Exception as exc:  # noqa: BLE001 - the model reads what went wrong
            if getattr(exc, "code", None) == _request_timeout_code():
                return outcome(label, _timeout_text(name, server.config), "timeout")
            return outcome(label, f"error: MCP server {label!r} failed on {name!r}: {_describe(exc)}",
                           "server_error")
        finally:
            server.pending.discard(future)
        cut = (getattr(result, "meta", None) or {}).get(CUT_META)
        if cut is not None:
            text = result_text(result, server.config.max_output_chars)
            return outcome(label, f"{text}\n[... reply cut at max_output_chars as it streamed in, after "
                                  f"{cut} bytes]", None)
        text = result_text(result, server.config.max_output_chars)
        if result.is_error:
            return outcome(label, f"error: {text}", "tool_error")
        return outcome(label, text, None)

    def close(self) -> None:
        """Close every server (stdio servers' processes end) and stop the loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        for server in self._servers:
            if server.queue is not None:
                self._loop.call_soon_threadsafe(server.queue.put_nowait, None)
        for task in self._tasks:
            try:
                task.result(timeout=_CLOSE_S)
            except BaseException:  # noqa: BLE001 - closing: a server that failed is already dead
                task.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> McpToolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _timeout_text(name: str, config: McpServerConfig) -> str:
    return f"error: tool {name!r} timed out after call_timeout_s={config.call_timeout_s:g}"


def _request_timeout_code() -> int:
    from mcp_types import REQUEST_TIMEOUT

    return REQUEST_TIMEOUT
