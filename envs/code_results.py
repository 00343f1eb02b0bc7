"""How the code environment judges a sandboxed run's results (envs/code.py), outside the sandbox:
the records it printed parsed as strict JSON (no NaN, no duplicate keys, no over-long ints) and
compared with the hidden tests' expected values in rlpipe's process, type for type."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value here")


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


_STRICT = json.JSONDecoder(parse_constant=_refuse_constant, object_pairs_hook=_strict_object)


def parse_record(line: str) -> Any:
    """One line of the sandbox's report as plain JSON, or None where it is not strict JSON (NaN,
    Infinity, duplicate keys, an int too long to parse)."""
    try:
        return _STRICT.decode(line)
    except (ValueError, RecursionError):
        return None


def same_value(got: Any, expected: Any) -> bool:
    """Whether a reported value is the expected one: the same JSON type at every level (a bool
    is not an int, a float not an int) and equal. Both sides are plain values parsed or built by
    rlpipe, so no object's own `__eq__` takes part."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(got) == len(expected) and all(same_value(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in expected)
    return got == expected


_NO_VALUE = object()  # a record about a test that carries no value (it raised, or has other keys)


def judge_results(stdout: str, expected: Sequence[Any]) -> list[bool]:
    """Per test, whether the sandbox reported exactly one value for it and that value is the
    expected one (`same_value`). Records that do not parse strictly, tests reported more than
    once, raised or unreported, fail; everything else the sandbox printed is ignored."""
    values: dict[int, list[Any]] = {}
    for line in stdout.splitlines():
        record = parse_record(line) if line.startswith("{") else None
        if not isinstance(record, dict) or type(record.get("test")) is not int:
            continue
        index = record["test"]
        if 0 <= index < len(expected):
            is_value = record.keys() == {"test", "value"}
            values.setdefault(index, []).append(record["value"] if is_value else _NO_VALUE)
    return [len(got := values.get(i, [])) == 1 and got[0] is not _NO_VALUE and same_value(got[0], e)
            for i, e in enumerate(expected)]


def defined_reported(stdout: str) -> bool:
    """Whether the sandbox said the solution defined `f` (diagnosis only: the sandbox can lie)."""
    records = [parse_record(line) for line in stdout.splitlines() if line.startswith("{")]
    return any(r == {"defined": True} for r in records) and not any(
        isinstance(r, dict) and "error" in r for r in records)

