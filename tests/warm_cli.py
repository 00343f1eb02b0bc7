"""`python -m rlpipe.flows.cli ...` and `python -c CODE ...` for the tests, forked from a warm
interpreter.

Every CLI process a test starts spends about 5 of its 11 CPU seconds importing torch and
transformers, and a helper script that opens a run's tables or MLflow store 1 to 3 seconds. A
worker of the test session keeps one helper process (the zygote) that has imported them once and
forks a child for each command; the child takes the command's environment, working directory,
standard streams and session, then runs `rlpipe.flows.cli` as `python -m` would, or CODE as
`python -c` would (sys.argv, `''` first on sys.path, `__main__`). It is a real process of its own:
its own pid, exit status, signals and files, so the fault tests kill it, wait for it and read its
output as they would a `subprocess.Popen`.

The zygote imports what every command imports and reads no per-test setting while it does: torch,
transformers, MLflow (its store URIs are read when used), Prefect and the rlpipe modules the
commands start from (RUN_MODULES). Prefect fixes its settings and its logging from the
environment it is imported in, so the child, once it has the command's environment, makes both
again from it, as a fresh import would (`refresh_prefect`). Nothing of these starts a thread or
sets a signal handler at import (a unit test checks it). A command whose environment differs
from the zygote's in any variable that a library may read at import (anything but PREFECT_*,
RLPIPE_*, PYTEST_* and the MLflow store URIs: HF_HOME, OMP_NUM_THREADS, ... ) runs as an ordinary
subprocess, as does any other command. So do all commands when RLPIPE_TEST_COLD_CLI=1. The one
difference allowed in PYTHONPATH is folders put before it (the checkout, the fault hooks): the
child puts them where PYTHONPATH would and runs a sitecustomize.py among them first, where a cold
interpreter would have run it at start-up; the fault hooks patch what rlpipe calls through its
module (`os.replace`, `torch.save`, ...), which rlpipe looks up when it calls, never binds at
import.

A warm launcher (a command with --nproc-per-node) starts its ranks warm too: before it runs, it
forks a rank zygote of its own, and torch's launcher gets each rank, `python -u -m
rlpipe.flows.cli ...`, as that zygote's child, in a session of its own with the launcher's
environment, streams and the rank's variables (`start_ranks_warm`). The rank zygote dies with its
launcher, and each rank's parent-death signal with it, as a rank of a cold launcher does.

`run` and `Popen` take the arguments of their `subprocess` namesakes that the tests use.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

PRELOAD = ("torch", "safetensors.torch", "pyarrow.parquet", "duckdb", "tokenizers", "transformers.modeling_utils",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe", "mlflow",
           "mlflow.store.tracking.sqlalchemy_store")
# Prefect, the modules the CLI's commands start from (flows/cli.py SUBCOMMANDS, named here: the
# zygote must not import flows/cli.py itself, which each child runs afresh as `python -m` does)
# and the flows `run` runs: about 1.6 of the CPU seconds a child would spend importing
RUN_MODULES = ("prefect.main", "rlpipe.flows.runner", "rlpipe.flows.pipeline", "rlpipe.flows.rl",
               "rlpipe.flows.supervised", "rlpipe.flows.replay", "rlpipe.flows.rescore", "rlpipe.storage.sqlcli",
               "rlpipe.storage.lineage", "rlpipe.dashboards.report", "rlpipe.engines.serve_cli")
# read when used, not at import: these may differ between the zygote and a command. Of MLflow's
# own, the store URIs, the async logging buffer (storage/tracking.py sets it in the process that
# logs) and the artifact progress bar (core/environment.py) are read by the call that uses them.
# polars, which the zygote imports through MLflow, sets _RJEM_MALLOC_CONF for itself when imported:
# a test process that imported it since has it, and the child's polars is loaded already.
LAZY_PREFIXES = ("PREFECT_", "RLPIPE_", "PYTEST_")
LAZY_NAMES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS",
              "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "_RJEM_MALLOC_CONF")
CLI_MODULE = "rlpipe.flows.cli"


class ColdCommand(UserWarning):
    """A command the zygote could have run, started cold because its environment differs from the
    zygote's in a variable read at import: a test that means it to be cold starts it with
    `subprocess`; one that does not learns here which variable to leave as it is."""


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not (k.startswith(LAZY_PREFIXES) or k in LAZY_NAMES)}


def path_before(env: dict[str, str], base: dict[str, str]) -> list[str] | None:
    """The folders that `env`'s PYTHONPATH puts before `base`'s (the checkout for `from tests ...`,
    the fault hooks' tests/fault_hooks), None if PYTHONPATH differs in any other way."""
    given, known = env.get("PYTHONPATH", ""), base.get("PYTHONPATH", "")
    if given == known:
        return []
    if known and not given.endswith(os.pathsep + known):
        return None
    extra = (given[: -len(known) - 1] if known else given).split(os.pathsep)
    return [d for d in extra if d]


# ---------------------------------------------------------------------------------------------
# the zygote (this file run as a script)


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the command's streams, session, directory and environment, run
    the CLI module as `python -m` does, and exit as it exits (atexit handlers and all)."""
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 256)
    if request.get("rank"):  # a rank, as torch's launcher starts it: `python -u`
        import ctypes
        import io

        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
        # /proc/PID/environ shows the environment a process was exec'd with, the zygote's here: the
        # name says which rank it is (/proc/PID/comm), for a test that looks for one
        name = f"rlpipe-rank-{request['env'].get('RANK', '')}".encode()[:15]
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name))  # PR_SET_NAME
    if any(arg.split("=", 1)[0] == LAUNCH_FLAG for arg in request["args"]) and request["args"][0] != "-c":
        start_ranks_warm()  # before this process takes the command's environment and path
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    refresh_prefect()
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    import runpy

    for position, folder in enumerate(request["path"], start=1):  # as PYTHONPATH places them
        sys.path.insert(position, folder)
        if os.path.isfile(os.path.join(folder, "sitecustomize.py")):  # a cold start runs it first
            runpy.run_path(os.path.join(folder, "sitecustomize.py"), run_name="sitecustomize")

    if request["args"][0] == "-c":  # as `python -c CODE ARGS...` runs CODE
        code, sys.argv, sys.path[0] = request["args"][1], ["-c", *request["args"][2:]], ""
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = [CLI_MODULE, *request["args"]]
        runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def refresh_prefect() -> None:
    """Prefect's settings and logging made again from this process's environment now, as importing
    Prefect makes them (prefect/context.py's global settings context, prefect/main.py's logging)."""
    import prefect.context
    import prefect.logging.configuration

    prefect.context.refresh_global_settings_context()
    prefect.logging.configuration.setup_logging(incremental=False)


def serve(channel: socket.socket) -> None:
    """Fork a child per request; report each child's pid, and its exit status once it ends."""
    import importlib

    for name in (*PRELOAD, *RUN_MODULES):
        importlib.import_module(name)
    channel.sendall(b'{"ready": true}\n')
    channel.settimeout(0.05)
    children: set[int] = set()
    pending, fds = b"", []
    while True:
        try:
            data, more, _, _ = socket.recv_fds(channel, 1 << 20, 3)
        except TimeoutError:
            data, more = None, []
        if data == b"":
            return  # the test process has gone
        fds += more
        pending += data or b""
        if b"\n" in pending:  # one request at a time: the test side waits for its pid
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                channel.close()
                become(request, fds)
            for fd in fds:
                os.close(fd)
            fds = []
            children.add(pid)
            channel.sendall(json.dumps({"started": pid}).encode() + b"\n")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                ended = {"ended": pid, "code": os.waitstatus_to_exitcode(status)}
                channel.sendall(json.dumps(ended).encode() + b"\n")


# ---------------------------------------------------------------------------------------------
# the test side


class Zygote:
    """A zygote of this process's: started on first use, ended with the process (`zygote`)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.env = dict(os.environ)
        self.process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._connect(ours)

    def _connect(self, ours: socket.socket) -> None:
        self.channel, self.lock = ours, threading.Lock()
        self.started: queue.Queue[int] = queue.Queue()
        self.pids: set[int] = set()  # every child it started
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        reader = self.channel.makefile("rb")
        if json.loads(reader.readline() or b"{}").get("ready") is not True:
            raise RuntimeError("the warm CLI zygote did not start")
        threading.Thread(target=self._read, args=(reader,), daemon=True).start()
        import atexit

        atexit.register(self.close)

    def close(self) -> None:
        """End the zygote (its children run on) and reap it."""
        self._hang_up()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _hang_up(self) -> None:
        """Tell the zygote its channel has closed. `close()` alone would not: the reader thread's
        file object holds the socket open, and the zygote would wait out the timeout below."""
        try:
            self.channel.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the zygote has gone already
        self.channel.close()

    def _read(self, reader) -> None:
        for line in reader:
            message = json.loads(line)
            if "started" in message:
                self.started.put(message["started"])
            else:
                with self.ended:
                    self.codes[message["ended"]] = message["code"]
                    self.ended.notify_all()

    def start(self, args: list[str], env: dict[str, str], path: list[str], cwd: str, fds: list[int],
              new_session: bool, rank: bool = False) -> int:
        request = {"args": args, "env": env, "path": path, "cwd": cwd, "new_session": new_session, "rank": rank}
        with self.lock:
            socket.send_fds(self.channel, [json.dumps(request).encode() + b"\n"], fds)
            pid = self.started.get(timeout=60)
            self.pids.add(pid)
            return pid

    def running(self) -> bool:
        """Whether a child it started has not ended yet."""
        with self.ended:
            return bool(self.pids - set(self.codes))

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.ended:
            self.ended.wait_for(lambda: pid in self.codes, timeout)
            return self.codes.get(pid)


class ForkedZygote(Zygote):
    """A zygote forked from this process as it is now, which must run no thread yet: a warm
    launcher's, for its ranks. It ends with this process (Linux's parent-death signal), so a
    rank's own parent-death signal still reaches it when its launcher dies."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.env = dict(os.environ)
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
            serve(theirs)  # a rank it forks leaves from inside, as it exits (atexit handlers and all)
            os._exit(0)  # its channel closed: the launcher has gone
        theirs.close()
        self._connect(ours)

    def close(self) -> None:
        """End it (it leaves once its channel closes) and reap it; `returncode` says how it ended."""
        self._hang_up()
        deadline = time.monotonic() + 10
        while (ended := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(self.pid, 9)
                ended = os.waitpid(self.pid, 0)
                break
            time.sleep(0.01)
        self.returncode = os.waitstatus_to_exitcode(ended[1])


LAUNCH_FLAG = "--nproc-per-node"


def start_ranks_warm() -> None:
    """In a warm launcher (a command with --nproc-per-node), before it runs: torch's launcher
    starts each rank, `python -u -m rlpipe.flows.cli ...`, as a child of a zygote forked from
    this process now, not as a fresh interpreter (5 to 7 CPU seconds of imports a rank). The rank
    is a process of its own in a session of its own, with the launcher's environment, streams and
    the rank's variables, as torch starts it; any other command torch is given runs as it would."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    ranks = ForkedZygote()
    cold = subprocess_handler.SubprocessHandler._popen
    rank_command = [sys.executable, "-u", "-m", CLI_MODULE]

    def popen(handler, args, env):
        args = [str(a) for a in args]
        if args[:4] != rank_command:
            return cold(handler, args, env)
        return WarmProcess(args, env, os.getcwd(), None, handler._stdout, handler._stderr, False, True,
                           via=ranks, cli_args=args[4:])

    subprocess_handler.SubprocessHandler._popen = popen


ZYGOTES_KEPT = 2
# this process's zygotes by the import-time environment each started in, least recently used first
_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote] = {}


def zygote() -> Zygote:
    """The zygote of this process's import-time environment now, started on first use. A test that
    changes a variable read at import (a fixture's HF_HOME, ...) gets one of its own, and the one
    before is kept for when the variable is back: the last ZYGOTES_KEPT are kept, and an older one
    ends once no child it started is running."""
    key = tuple(sorted(import_time_env(dict(os.environ)).items()))
    found = _ZYGOTES.pop(key, None)
    if found is None or found.process.poll() is not None:
        found = Zygote()
    _ZYGOTES[key] = found
    for old in list(_ZYGOTES)[:-ZYGOTES_KEPT]:
        if not _ZYGOTES[old].running():
            _ZYGOTES.pop(old).close()
    return found


def warm_args(args, env) -> list[str] | None:
    """The CLI arguments of `args` if the zygote can run it with `env`, else None (with a
    ColdCommand warning where only the environment stands in the way)."""
    if os.environ.get("RLPIPE_TEST_COLD_CLI") == "1" or isinstance(args, str | bytes | os.PathLike):
        return None
    if any(isinstance(a, bytes) for a in args):
        return None  # a shell's non-UTF-8 argument: only a real exec passes it as it is
    args = [str(a) for a in args]
    if args[:3] == [sys.executable, "-m", CLI_MODULE]:
        args = args[3:]
    elif args[:2] == [sys.executable, "-c"] and len(args) > 2:
        args = args[1:]  # -c CODE ARGS...
    else:
        return None
    differing = import_time_differences(dict(os.environ if env is None else env), zygote().env)
    if differing:
        import warnings

        warnings.warn(f"`{' '.join(args[:2])[:80]} ...` runs cold: {', '.join(differing)} differ from the warm "
                      "zygote's environment and may be read at import", ColdCommand, stacklevel=3)
        return None
    return args


def import_time_differences(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables that `env` sets otherwise than `base` and that a library may read at import
    (PYTHONPATH where it differs in more than folders put before it)."""
    given, known = {**import_time_env(env), "PYTHONPATH": ""}, {**import_time_env(base), "PYTHONPATH": ""}
    differing = sorted(k for k in given.keys() | known.keys() if given.get(k) != known.get(k))
    return differing + (["PYTHONPATH"] if path_before(env, base) is None else [])


def _stream(value, target: int) -> tuple[int, object | None]:
    """(fd for the child's stream `target`, the test's end of a pipe or None) for a stdin, stdout
    or stderr argument; None inherits this process's own, as subprocess does."""
    mode = "w" if target == 0 else "r"
    if value is None:
        return os.dup(target), None
    if value == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if value == subprocess.PIPE:
        read, write = os.pipe()
        return (read, os.fdopen(write, "wb")) if mode == "w" else (write, os.fdopen(read, "rb"))
    return os.dup(value if isinstance(value, int) else value.fileno()), None


class WarmProcess:
    """The subset of subprocess.Popen the tests use, for a child of the zygote."""

    def __init__(self, args, env, cwd, stdin, stdout, stderr, text, start_new_session,
                 via: Zygote | None = None, cli_args: list[str] | None = None) -> None:
        self.args, self.returncode, self._text = args, None, text
        merged = stderr == subprocess.STDOUT  # the child's stderr goes where its stdout goes
        fds, ends = zip(*(_stream(stdin, 0), _stream(stdout, 1), _stream(None if merged else stderr, 2)), strict=True)
        if merged:
            os.close(fds[2])
            fds = (fds[0], fds[1], fds[1])
        env = dict(os.environ if env is None else env)
        self._zygote = via or zygote()  # the one that reports this child's end, whatever the environment is later
        try:
            self.pid = self._zygote.start(cli_args or warm_args(args, env), env, path_before(env, self._zygote.env) or [],
                                          str(cwd or os.getcwd()), list(fds), start_new_session,
                                          rank=cli_args is not None)
        finally:
            for fd in set(fds):
                os.close(fd)
        self.stdin, self.stdout, self.stderr = ends
        if text:
            import io

            self.stdout, self.stderr = (io.TextIOWrapper(e) if e else None for e in (self.stdout, self.stderr))

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None):
        results: dict[str, object] = {}
        readers = [threading.Thread(target=lambda k=k, s=s: results.__setitem__(k, s.read()), daemon=True)
                   for k, s in (("out", self.stdout), ("err", self.stderr)) if s is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("out"), results.get("err")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def Popen(args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False,  # noqa: N802
          start_new_session=False, **rest):
    """subprocess.Popen, warm where the zygote can run the command."""
    if rest or warm_args(args, env) is None:
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, **rest)
    return WarmProcess(args, env, cwd, stdin, stdout, stderr, text, start_new_session)


def run(args, *, env=None, cwd=None, capture_output=False, text=False, timeout=None, input=None,  # noqa: A002
        stdout=None, stderr=None, check=False, start_new_session=False):
    """subprocess.run, warm where the zygote can run the command."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    if input is not None or warm_args(args, env) is None:
        return subprocess.run(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, timeout=timeout,
                              input=input, check=check, start_new_session=start_new_session)
    with WarmProcess(args, env, cwd, None, stdout, stderr, text, start_new_session) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
    # the test process has gone or hung up: leave at once, as the rank zygote does, and do not
    # spend a second or two tearing down the modules it imported for nothing
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
