"""What sandboxed code can see of the host's files (envs/sandbox_files.py): a probe walks the
sandbox's whole tree and tries to create a file in every folder and open every file for writing.
It sees the interpreter, its standard library (no installed package) and the shared libraries
they link, and can write only its scratch folder and /tmp: set up as root (the code dropped to
nobody) and in a user namespace alike."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from rlpipe.envs import sandbox
from rlpipe.envs.sandbox import SandboxLimits, isolation_problem, run_python

from tests.sandbox_as_nobody import run_as_nobody

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = isolation_problem()
LIBRARY = re.compile(r"^(lib[\w.+-]*|ld-linux[\w.-]*)\.so(\.[\d.]+)?$")

PROBE = """
import json, os, stat, sys
files, links, writable = [], [], []
for top, folders, names in os.walk("/"):
    if top in ("/proc", "/dev", "/sys"):
        folders[:] = []
        continue
    try:
        fd = os.open(os.path.join(top, ".probe"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        os.unlink(os.path.join(top, ".probe"))
        writable.append(top)
    except OSError:
        pass
    for name in names:
        path = os.path.join(top, name)
        if os.path.islink(path):
            links.append(path)
            continue
        files.append(path)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
            writable.append(path)
        except OSError:
            pass
print(json.dumps({"files": files, "links": links, "writable": writable, "root": sorted(os.listdir("/")),
                  "path": sys.path}))
"""


def _stdlib(python: str) -> str:
    """The standard library folder of `python`, as it names it."""
    out = subprocess.run([python, "-I", "-S", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return os.path.realpath(out.stdout.strip())


def _check_seen(stdout: str, python: str, hidden: list[Path]) -> int:
    """What the probe saw is the allowlist's, and nothing of `hidden`; how many files it saw."""
    seen = json.loads(stdout)
    stdlib = _stdlib(python)
    libraries, outside = [], []
    for path in seen["files"]:
        if path.startswith(stdlib + "/") and "/site-packages/" not in path and "/dist-packages/" not in path:
            continue
        if path in (python, "/sandbox/main.py"):
            continue
        (libraries if LIBRARY.match(Path(path).name) else outside).append(path)
    assert outside == [], outside  # nothing of the host outside the allowlist
    assert 0 < len(libraries) < 100, libraries  # the libraries it links, not /usr/lib
    assert f"{stdlib}/os.py" in seen["files"]
    site = [p for p in seen["path"] if p.endswith(("site-packages", "dist-packages"))]
    assert all(not any(f.startswith(p + "/") for f in seen["files"]) for p in site)  # empty, if there
    for host in hidden:
        assert not any(f.startswith(str(host) + "/") for f in seen["files"]), host
    assert not {"etc", "home", "work", "var", "opt", "mnt", "srv"} & set(seen["root"])
    assert not any(f.startswith(("/usr/local/", "/usr/share/", "/usr/bin/")) and f != python for f in seen["files"])
    assert sorted(seen["writable"]) == ["/scratch", "/tmp"]  # nothing else, no file of the host
    return len(seen["files"])


@pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")
def test_sandboxed_code_sees_only_the_interpreter_its_stdlib_and_their_libraries():
    result = run_python(PROBE, timeout_s=60, memory_mb=512, limits=SandboxLimits(output_bytes=8 << 20))
    assert result.exit_code == 0, result.stderr
    hidden = [ROOT, Path(sys.prefix), Path(sysconfig.get_paths()["purelib"]), Path.home() / ".cache"]
    _check_seen(result.stdout, sandbox.interpreter(), hidden)


@pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_in_a_user_namespace_it_sees_the_same_allowlist():
    """Made by an unprivileged user (bubblewrap in a user namespace, the system's python3)."""
    python, (result,) = run_as_nobody([PROBE])
    assert result.exit_code == 0, result.stderr
    _check_seen(result.stdout, os.path.realpath(python), [ROOT, Path("/usr/lib/python3/dist-packages")])
