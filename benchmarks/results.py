"""How a benchmark writes what it measured: its `--out` JSON (the file run_all.py collects) and the
generated documents, each atomically (a temporary file, then a rename), so that a benchmark
killed mid-write leaves the previous file, never half a JSON for run_all to choke on.

    write_results(args.out, report)
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace `path` with `text` in one rename (its folder is made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_results(path: str | os.PathLike, report: dict) -> Path:
    """`report` as indented JSON at `path` (values JSON cannot hold are written as their str)."""
    return write_atomic(path, json.dumps(report, indent=2, default=str) + "\n")


def machine_platform() -> str:
    """The operating system and processor architecture a result was measured on ("Linux
    x86_64"): not `platform.platform()`, whose kernel build string names the one machine it ran on."""
    return f"{platform.system()} {platform.machine()}"
