"""The installed `rlpipe` script imports through the package list in pyproject.toml, not the
working tree: a package missing there works under pytest (the repo root is on sys.path) and
fails for users (`make demo`: "No module named 'rollouts'")."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = {"tests", "benchmarks"}


def test_every_top_level_package_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - NOT_SHIPPED
    assert on_disk - listed == set(), f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but not packages: {sorted(listed - on_disk)}"
