"""The suite's own layout: pytest imports test files by basename (tests/ holds no packages), so two
test files of one name in different folders make one of them an import error at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_name_of_its_own():
    names = Counter(path.name for path in TESTS.rglob("test_*.py") if "__pycache__" not in path.parts)
    assert [name for name, count in names.items() if count > 1] == []
