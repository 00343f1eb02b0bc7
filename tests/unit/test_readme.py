"""README.md's and docs/CLUSTER.md's commands are all known to the tests (tests/readme_commands.py,
tests/cluster_commands.py), and what README tells users to install exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests import cluster_commands
from tests.readme_commands import COMMANDS, FIXTURE, README, RUN, readme_commands

ROOT = Path(__file__).resolve().parents[2]


def test_every_readme_command_is_run_or_excluded_for_a_stated_reason():
    found = readme_commands()
    unknown = [command for command in found if command not in COMMANDS]
    assert not unknown, f"README commands no test knows (add them to tests/readme_commands.py): {unknown}"
    stale = [command for command in COMMANDS if command not in found]
    assert not stale, f"tests/readme_commands.py lists commands README no longer prints: {stale}"
    assert all(action in (RUN, FIXTURE) or len(action) > 20 for action in COMMANDS.values())


def test_every_cluster_page_command_is_run_or_needs_a_real_cluster():
    found = cluster_commands.cluster_commands()
    unknown = [command for command in found if command not in cluster_commands.COMMANDS]
    assert not unknown, f"docs/CLUSTER.md commands no test knows (add them to tests/cluster_commands.py): {unknown}"
    stale = [command for command in cluster_commands.COMMANDS if command not in found]
    assert not stale, f"tests/cluster_commands.py lists commands docs/CLUSTER.md no longer prints: {stale}"
    run = [command for command, action in cluster_commands.COMMANDS.items() if action == RUN]
    assert all(action == RUN or len(action) > 20 for action in cluster_commands.COMMANDS.values())
    # the page says which of its commands run as printed: exactly those
    text = cluster_commands.CLUSTER.read_text()
    intro = text.split("## 1.")[0]
    assert [c for c in cluster_commands.cluster_commands() if c in intro] == run


def test_the_parser_finds_block_fence_and_inline_commands_without_their_comments():
    text = ("Run `rlpipe sql runs/a --list` or `rlpipe`.\n\n    rlpipe run x.toml   # comment\n"
            "    # not a command\n\n```bash\nduckdb f.duckdb 'select 1'\n```\n")
    assert readme_commands(text) == ["rlpipe sql runs/a --list", "rlpipe run x.toml", "duckdb f.duckdb 'select 1'"]


def test_every_extra_readme_names_exists_and_rlpipe_is_installed_from_the_checkout():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = README.read_text()
    named = set(re.findall(r"\.\[(\w+)\]", text))
    assert {"ui", "vllm", "verifiers", "lora"} <= named and named <= set(extras), named - set(extras)
    assert any(spec.startswith("mlflow") for spec in extras["ui"])  # `mlflow ui` needs the full mlflow
    # rlpipe is not on the package registries: an install by name would fail or fetch another package
    assert not re.search(r"pip install[^`\n]*'rlpipe\[", text)
