"""Markdown tables and cells for docs/BENCHMARKS.md (benchmarks/headlines.py, run_all.py)."""

from __future__ import annotations


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value).replace("|", "\\|")


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A Markdown table; floats get 3-4 significant digits, None shows as a dash."""
    cell = lambda v: "–" if v is None else fmt(v)  # noqa: E731
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def ratio(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}×"


def share(value: float | None) -> str | None:
    return None if value is None else f"{value:.1%}"
