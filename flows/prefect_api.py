"""The embedded Prefect API server that a run without PREFECT_API_URL starts, kept out of the
terminal's process group.

Prefect starts that server (a uvicorn child) in the run's own process group, so Ctrl-C in the
terminal reaches it as well as the run: the server died at once, and the run, interrupted, then
spent about a minute per request retrying it (Prefect's client backs off 2, 4, 8, 16, 32 s) before
ending on "ConnectError: Connection refused", or, where the run missed the signal, trained on and
retried for minutes. Started in a session of its own, the server never sees the terminal's
signals; the run stops it on the way out (Prefect's atexit hook, which terminates it and kills
it after 5 s), so it does not outlive the run.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
from typing import Any


class _OwnSession:
    """The `subprocess` module as Prefect's server module sees it: the same, except that Popen
    starts the child in a new session (its own process group, no controlling terminal)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    Popen = functools.partial(subprocess.Popen, start_new_session=True)


def _api_url_set() -> bool:
    """Whether Prefect's settings name an API (PREFECT_API_URL, a profile's)."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def embedded_server_in_own_session() -> None:
    """Make Prefect start its embedded API server in a session of its own (idempotent). Nothing
    to do where an API URL is set (a server of the user's, a deployment's worker): no embedded
    server starts, and Prefect's server package (FastAPI, its database models: about 1.7 CPU-s
    of imports) stays unloaded."""
    if _api_url_set():
        return
    from prefect.server.api import server

    if not isinstance(server.subprocess, _OwnSession):
        server.subprocess = _OwnSession()  # type: ignore[assignment]


def api_for_a_script(startup_timeout_s: float = 120):
    """A context for a script that makes task runs outside a flow (benchmarks/bench_cluster_scoring.py):
    the API set in Prefect's settings (PREFECT_API_URL) where there is one, else a temporary server with a database of its own
    for the block (Prefect's test harness), so nothing lands in the user's Prefect home."""
    if _api_url_set():
        return contextlib.nullcontext()
    from prefect.testing.utilities import prefect_test_harness

    return prefect_test_harness(server_startup_timeout=startup_timeout_s)
