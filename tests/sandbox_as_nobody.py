"""Sandboxed runs made by an unprivileged user (`nobody`, through setpriv), so bubblewrap builds
the sandbox in a user namespace: the sandbox's modules are copied to a folder that user can
read, and the system's python3 runs them (the test's venv is not readable by it).

    python, results = run_as_nobody([program, ...])   # or pytest.skip with the reason
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("sandbox.py", "sandbox_bwrap.py", "sandbox_cgroup.py", "sandbox_files.py", "seccomp.py")
RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from rlpipe.envs.sandbox import SandboxLimits, isolation_problem, run_python
assert isolation_problem() is None, isolation_problem()
out = []
for path in sys.argv[2:]:
    result = run_python(open(path).read(), timeout_s=60, memory_mb=256, limits=SandboxLimits(output_bytes=8 << 20))
    out.append({"stdout": result.stdout, "stderr": result.stderr, "exit_code": result.exit_code})
print(json.dumps(out))
"""


class Result:
    """What one run left, as envs/sandbox.py's SandboxResult names it."""

    def __init__(self, reply: dict) -> None:
        self.stdout, self.stderr, self.exit_code = reply["stdout"], reply["stderr"], reply["exit_code"]


def run_as_nobody(programs: list[str]) -> tuple[str, list[Result]]:
    """The system python3 and each program's result, run by `nobody` (skips where that user gets
    no sandbox, or there is no system python3)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the unprivileged user")
    shared = Path(tempfile.mkdtemp(prefix="rlpipe-nobody-"))
    try:
        package = shared / "rlpipe" / "envs"
        package.mkdir(parents=True)
        for name in ("rlpipe/__init__.py", "rlpipe/envs/__init__.py"):
            (shared / name).write_text("")
        for name in MODULES:
            shutil.copy(ROOT / "envs" / name, package / name)
        paths = []
        for i, program in enumerate(programs):
            paths.append(shared / f"probe{i}.py")
            paths[-1].write_text(program)
        for path in [shared, *shared.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c",
                               RUN, str(shared), *map(str, paths)], capture_output=True, text=True,
                              timeout=300, cwd="/")
        if "isolation_problem" in done.stderr or "AssertionError" in done.stderr:
            pytest.skip(f"no unprivileged sandbox here: {done.stderr.strip().splitlines()[-1]}")
        assert done.returncode == 0, done.stderr
        return python, [Result(reply) for reply in json.loads(done.stdout)]
    finally:
        shutil.rmtree(shared)
