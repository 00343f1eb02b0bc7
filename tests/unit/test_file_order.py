"""The session's file order (tests/file_order.py): the listed heavy files first, in the list's
order, then the rest as collected; a file's tests stay together and in order."""

from pathlib import Path

from tests.file_order import HEAVIEST_FIRST, heaviest_first

ROOT = Path(__file__).resolve().parents[2]


def test_listed_files_run_first_in_list_order_and_each_files_tests_stay_in_order():
    a, b = HEAVIEST_FIRST[0], HEAVIEST_FIRST[1]
    nodeids = ["tests/unit/test_x.py::one", f"{b}::first", "tests/unit/test_y.py::one", f"{a}::only",
               f"{b}::second", "tests/unit/test_x.py::two"]
    order = [nodeids[i] for i in heaviest_first(nodeids)]
    assert order == [f"{a}::only", f"{b}::first", f"{b}::second", "tests/unit/test_x.py::one",
                     "tests/unit/test_x.py::two", "tests/unit/test_y.py::one"]


def test_every_listed_file_exists_once():
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)
    assert [name for name in HEAVIEST_FIRST if not (ROOT / name).is_file()] == []
