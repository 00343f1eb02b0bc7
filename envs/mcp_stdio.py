"""A stdio MCP server's output read through a cap (envs/mcp_toolbox.py): a tool reply longer than
the call's max_output_chars is cut as it streams in, not after a timeout, and the server runs in
a process group of its own that close() ends whole."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import signal
import threading
from typing import Any

CUT_META = "rlpipe/cut_bytes"


_BUSY_WAIT_S = 1.0  # how long a call waits for the rest of a cut reply to be discarded


def _line_cap(max_output_chars: int) -> int:
    """Bytes of one stdout line past which a tool reply is cut: room for `max_output_chars`
    characters escaped (up to 12 bytes each) twice (content and structured content) and 64 KiB."""
    return 24 * max_output_chars + (64 << 10)


_ID = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')


_CALL_RESULT = re.compile(rb'"result"\s*:\s*\{\s*"content"')


_TEXT = re.compile(rb'"text"\s*:\s*"')


def _cut_reply(head: bytes, max_chars: int) -> bytes | None:
    """A JSON-RPC reply standing in for a tool reply cut after its first bytes `head`: its id,
    the first `max_chars` characters of its text, `_meta` saying it was cut (and `isError`, so the
    SDK does not check it against the tool's output schema). None when `head` is not a tool reply
    whose id it can read (such a line is passed on whole)."""
    start = head[:512]
    ident = _ID.search(start)
    if ident is None or not _CALL_RESULT.search(start):
        return None
    text = ""
    if (found := _TEXT.search(head)) is not None:
        raw = head[found.end():found.end() + 12 * max_chars + 16]
        end = re.search(rb'(?<!\\)(?:\\\\)*"', raw)
        raw = raw[:end.start() + len(end.group()) - 1] if end else raw
        for trim in range(0, 16):  # a cut escape or UTF-8 sequence at the end: drop it
            try:
                text = json.loads(b'"' + raw[:len(raw) - trim] + b'"')
                break
            except ValueError:
                continue
    reply = {"jsonrpc": "2.0", "id": json.loads(ident.group(1)),
             "result": {"_meta": {CUT_META: len(head)}, "content": [{"type": "text", "text": text[:max_chars]}],
                        "isError": True}}
    return json.dumps(reply).encode()


class _CappedStdout:
    """A server's stdout as the SDK reads it, one line at a time held back until its newline:
    a line past `cap` bytes that is a tool reply is replaced by `_cut_reply` at once and the rest
    of it discarded as it arrives (see the module docstring)."""

    def __init__(self, inner: Any, cap: int, max_chars: int) -> None:
        self.inner, self.cap, self.max_chars = inner, cap, max_chars
        self.line = bytearray()
        self.passing = False  # a long line that is not a tool reply: passed on as it comes
        self.discarding = 0  # bytes of a cut line discarded so far (0: not discarding)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            data = await self.inner.receive(max_bytes)
            out = bytearray()
            for piece in re.split(b"(\n)", data):
                if piece == b"\n":
                    if self.discarding:
                        self.discarding = 0
                    else:
                        out += self.line + b"\n"
                    self.line.clear()
                    self.passing = False
                elif self.discarding:
                    self.discarding += len(piece)
                elif self.passing:
                    out += piece
                else:
                    self.line += piece
                    if len(self.line) > self.cap:
                        cut = _cut_reply(bytes(self.line), self.max_chars)
                        if cut is None:
                            out += self.line
                            self.passing = True
                        else:
                            out += cut + b"\n"
                            self.discarding = len(self.line)
                        self.line.clear()
            if out:
                return bytes(out)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_SPAWNING: contextvars.ContextVar[Any] = contextvars.ContextVar("rlpipe_mcp_spawning", default=None)
_HOOKED = threading.Lock()


def _hook_spawn() -> None:
    """Wrap the SDK's stdio process spawn (once): a server `_Server.run` is starting records its
    process (for the group kill) and reads its stdout through `_CappedStdout`."""
    import mcp.client.stdio as sdk

    with _HOOKED:
        spawn = getattr(sdk, "_create_platform_compatible_process", None)
        if spawn is None or getattr(spawn, "_rlpipe", False):
            return

        async def spawn_recorded(*args: Any, **kwargs: Any) -> Any:
            process = await spawn(*args, **kwargs)
            server = _SPAWNING.get()
            if server is not None and getattr(process, "_stdout", None) is not None:
                server.pid = process.pid
                server.stdout = _CappedStdout(process._stdout, _line_cap(server.config.max_output_chars),
                                              server.config.max_output_chars)
                process._stdout = server.stdout  # anyio's Process keeps its streams in these fields
            return process

        spawn_recorded._rlpipe = True  # type: ignore[attr-defined]
        sdk._create_platform_compatible_process = spawn_recorded


def _end_group(pgid: int | None) -> None:
    """SIGKILL what is left of a stdio server's process group (its leader's pid: a new session)."""
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)

