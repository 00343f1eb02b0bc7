"""Stage output as an Arrow table of exactly its table's schema, or a ValueError naming the table
and the column, before anything touches the disk (storage.writer writes what this returns).

    conform("scores", rows, run_id="demo", step=3)   # rows | pa.Table | dict of columns
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from rlpipe.storage.schemas import schema_for

TableData = pa.Table | Sequence[Mapping[str, Any]] | Mapping[str, Any]


def conform(table: str, data: TableData, *, run_id: str, step: int) -> pa.Table:
    """`data` as a pa.Table of exactly `table`'s schema, run_id and step filled in.

    data: a pa.Table, a list of row dicts, or a dict of equal-length columns.
    Raises ValueError naming the column for an unknown column, a missing required column, a
    value of the wrong type, a null in a required column, or a run_id/step that disagrees.
    """
    schema = schema_for(table)
    columns, n = _columns(table, data)
    unknown = sorted(set(columns) - set(schema.names))
    if unknown:
        raise ValueError(
            f"table {table!r}: unknown column {unknown[0]!r} (columns: {', '.join(schema.names)})"
        )
    arrays = []
    for field in schema:
        if field.name not in columns:
            arrays.append(_missing(table, field, n, run_id=run_id, step=step))
            continue
        array = _to_arrow(table, field, columns[field.name])
        if len(array) != n:
            raise ValueError(
                f"table {table!r}: column {field.name!r} has {len(array)} values, expected {n}"
            )
        if not field.nullable and array.null_count:
            raise ValueError(
                f"table {table!r}: column {field.name!r} is required but has {array.null_count} null value(s)"
            )
        arrays.append(array)
    result = pa.Table.from_arrays(arrays, schema=schema)
    _check_constant(table, result, "step", step)
    _check_constant(table, result, "run_id", run_id)
    return result


def _columns(table: str, data: TableData) -> tuple[dict[str, Any], int]:
    """Column name -> values, and the row count."""
    if isinstance(data, pa.Table):
        return {name: data.column(name) for name in data.column_names}, data.num_rows
    if isinstance(data, Mapping):
        lengths = {name: len(values) for name, values in data.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"table {table!r}: columns differ in length: {lengths}")
        return dict(data), next(iter(lengths.values()), 0)
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        rows = list(data)
        for index, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(
                    f"table {table!r}: row {index} is a {type(row).__name__}, not a dict"
                )
        names: dict[str, None] = {}
        for row in rows:
            names.update(dict.fromkeys(row))
        return {name: [row.get(name) for row in rows] for name in names}, len(rows)
    raise ValueError(
        f"table {table!r}: data must be a pa.Table, a list of dicts or a dict of columns, got {type(data).__name__}"
    )


def _to_arrow(table: str, field: pa.Field, values: Any) -> pa.Array:
    try:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if isinstance(values, pa.Array):
            return values if values.type == field.type else values.cast(field.type)
        if _has_integers(field.type):
            # pa.array(values, type=int32) silently truncates Python floats: infer, then cast safely
            return pa.array(values).cast(field.type)
        return pa.array(values, type=field.type)
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        TypeError,
        OverflowError,
    ) as error:
        raise ValueError(
            f"table {table!r}: column {field.name!r} does not fit {field.type}: {error}"
        ) from error


def _has_integers(type_: pa.DataType) -> bool:
    if pa.types.is_list(type_):
        return _has_integers(type_.value_type)
    return pa.types.is_integer(type_)


def _missing(table: str, field: pa.Field, n: int, *, run_id: str, step: int) -> pa.Array:
    if field.name == "run_id":
        return pa.array([run_id] * n, type=field.type)
    if field.name == "step":
        return pa.array([step] * n, type=field.type)
    if not field.nullable and n:  # an empty write may omit every column
        raise ValueError(f"table {table!r}: required column {field.name!r} is missing")
    return pa.nulls(n, type=field.type)


def _check_constant(table: str, data: pa.Table, name: str, expected: Any) -> None:
    values = data.column(name).unique().to_pylist()
    wrong = [value for value in values if value != expected]
    if wrong:
        raise ValueError(
            f"table {table!r}: column {name!r} holds {wrong[0]!r}, expected {expected!r} for this partition"
        )
