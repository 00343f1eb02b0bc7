"""What of the host's files the sandbox mounts (envs/sandbox.py): an allowlist of what the
interpreter needs to run, and nothing else.

    mounts = interpreter_mounts(python)   # bubblewrap arguments, or InterpreterUnreadable

- the interpreter's executable, at its own path;
- its standard library: the folders of `python -I -S`'s `sys.path` (the stdlib and lib-dynload),
  at their own paths (the interpreter finds its prefix from them), with any `site-packages` or
  `dist-packages` folder in them covered by an empty read-only tmpfs: no installed package, no
  `.pth` file, no virtual environment and no project checkout is visible;
- the shared libraries the executable and the stdlib's extension modules link (as `ldd` resolves
  them, and `libgcc_s`, which the C library opens for thread exits), each file at its own name in
  its folder's real path, and the dynamic loader. The host's `/bin`, `/lib*` symlinks into `/usr`
  are kept; no other file of `/usr` or `/lib` is there.

The list is worked out once per interpreter (one `python -I -S` and one `ldd` run).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

MASKED = ("site-packages", "dist-packages")
_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


class InterpreterUnreadable(RuntimeError):
    """The interpreter's files cannot be listed (it does not run, or `ldd` is missing)."""


def _search_path(python: str) -> list[str]:
    """The existing folders and zips of `python -I -S`'s sys.path: its stdlib, nothing installed."""
    try:
        out = subprocess.run([python, "-I", "-S", "-c", "import json, sys; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/")
        paths = json.loads(out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as error:
        raise InterpreterUnreadable(f"{python} -I -S cannot list its standard library: {error}") from None
    found = [os.path.realpath(p) for p in paths if p and os.path.exists(p)]
    outermost = [p for p in found if not any(p != q and p.startswith(q + "/") for q in found)]
    return list(dict.fromkeys(outermost))


def _linked_libraries(files: list[str]) -> list[str]:
    """The shared libraries `files` link, as `ldd` resolves them (the loader included)."""
    ldd = shutil.which("ldd", path="/usr/bin:/bin")
    if ldd is None:
        raise InterpreterUnreadable("`ldd` is not installed: the sandbox cannot list the interpreter's libraries")
    try:
        out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}, cwd="/").stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InterpreterUnreadable(f"`ldd` cannot list the interpreter's libraries: {error}") from None
    libraries = [m.group(1) for line in out.splitlines() if (m := _LDD_LINE.match(line))]
    for libc in [p for p in libraries if Path(p).name.startswith("libc.so")]:
        gcc = Path(libc).parent / "libgcc_s.so.1"
        if gcc.exists():
            libraries.append(str(gcc))
    return list(dict.fromkeys(libraries))


def _in_real_folder(path: str) -> str:
    """`path` with its folder's symlinks resolved and its own name kept (a library's soname)."""
    return str(Path(os.path.realpath(os.path.dirname(path))) / os.path.basename(path))


@functools.cache
def interpreter_mounts(python: str) -> tuple[str, ...]:
    """bubblewrap arguments that mount what `python` needs to run, read-only (module docstring).
    Raises InterpreterUnreadable (one line)."""
    search = _search_path(python)
    if not search:
        raise InterpreterUnreadable(f"{python} -I -S names no standard library folder")
    extensions = [str(p) for folder in search if os.path.isdir(folder)
                  for p in sorted(Path(folder).glob("lib-dynload/*.so")) + sorted(Path(folder).glob("*.so"))]
    binds: dict[str, str] = {}  # destination -> source
    for library in _linked_libraries([python, *extensions]):
        binds.setdefault(_in_real_folder(library), library)
    binds.setdefault(python, python)
    for folder in search:
        binds.setdefault(folder, folder)
    args: list[str] = []
    parents = {str(parent) for dest in binds for parent in Path(dest).parents if str(parent) != "/"}
    for parent in sorted(parents, key=lambda d: (d.count("/"), d)):  # open to the dropped user
        args += ["--perms", "0755", "--dir", parent]
    for dest in sorted(binds, key=lambda d: (d.count("/"), d)):
        args += ["--ro-bind", binds[dest], dest]
    for folder in search:
        for name in MASKED:
            if os.path.isdir(os.path.join(folder, name)):
                masked = os.path.join(folder, name)
                args += ["--perms", "0555", "--tmpfs", masked, "--remount-ro", masked]
    return tuple(args)
