"""What every config section shares: the strict pydantic base, the error type, `--set` overrides,
the finite-number check and the readable forms of errors and fields.

The sections themselves live beside what they configure (training/config.py, rollouts/config.py,
engines/config.py, envs/config.py, storage/config.py); tasks/config.py composes them into a run's
`RunConfig`. A component whose frozen options are not its section itself gets them from
`options_from`, the one function that copies fields by name (no hand copies), a key that
moved to another place is refused naming that place (`moved_key_errors`), and a key that was
removed is refused saying why (`removed_key_errors`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


class Section(BaseModel):
    """A `[section]` of a run config: unknown keys refused, every field documented by its docstring."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              allow_inf_nan=False)


def check_plain_name(name: str, key: str) -> str:
    """`name` if it is one plain folder name: no separator, not '.' or '..', no control character,
    no surrounding spaces (a run_name of '..' would put the run, and --overwrite, outside runs_root)."""
    if (not name or name != name.strip() or name in (".", "..") or any(c in name for c in "/\\")
            or any(ord(c) < 32 for c in name)):
        raise ValueError(f"{key} must be a plain folder name (no '/', '\\', '.' or '..'), got {name!r}")
    return name


def non_finite_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every inf or nan float in a nested dict/list (TOML accepts `inf` and `nan`)."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [prefix or "(value)"]
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list | tuple):
        items = enumerate(data)
    else:
        return []
    return [key for name, value in items
            for key in non_finite_keys(value, f"{prefix}.{name}" if prefix else str(name))]


def check_shares(weights: list[float], names: list[str], key: str) -> None:
    """Mixture weights that each give a share: their sum finite, and no weight a share of 0 of it
    (each weight may be finite and the sum not: two of 1e308). ValueError naming `key`."""
    total = sum(weights)
    if not math.isfinite(total):
        raise ValueError(f"{key}: the weights sum to {total} ({', '.join(f'{w:g}' for w in weights)}); give "
                         "weights whose sum is a finite number (shares are weight / sum)")
    for weight, name in zip(weights, names, strict=True):
        if weight / total == 0.0:
            raise ValueError(f"{key}: weight {weight:g} of entry {name!r} is 0 of the sum {total:g}, so it would "
                             "never be drawn; give weights within a sane ratio (or remove the entry)")


def non_utf8_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every string in a nested dict/list that is not valid UTF-8 text (a `--set`
    value from non-UTF-8 bytes arrives with surrogate escapes, which no file or MLflow can hold)."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            return [prefix or "(value)"]
        return []
    if isinstance(data, dict):
        items = [(name, value) for name, value in data.items()]
        bad_names = [f"{prefix}.{name}" if prefix else str(name) for name in data if non_utf8_keys(name)]
    elif isinstance(data, list | tuple):
        items, bad_names = list(enumerate(data)), []
    else:
        return []
    return bad_names + [key for name, value in items
                        for key in non_utf8_keys(value, f"{prefix}.{name}" if prefix else str(name))]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `a.b=c`; the value is read as a TOML literal, else kept as a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    keys = [part.strip() for part in key.split(".")]
    if not all(keys):
        raise ConfigError(f"--set has an empty key part in {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of the nested config dict `data` with each `--set a.b=c` of `overrides` applied."""
    data = json.loads(json.dumps(data))
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for part in keys[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def format_validation_error(error: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """One line per problem of a failed validation, each naming its dotted key, in our words (an
    unknown key of `model` with the closest known one: "did you mean ...?")."""
    problems = [_problem(item, model) for item in error.errors()]
    where = f"invalid config {source}".rstrip()
    if len(problems) == 1:  # the usual case: one line
        return f"{where}: {problems[0]}"
    return "\n".join([f"{where}:", *(f"  {problem}" for problem in problems)])


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def _problem(item: dict, model: type[BaseModel] | None) -> str:
    """`key: what is wrong` for one pydantic error; a model validator's own message as it is (it
    names its keys)."""
    loc = item["loc"]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    kind, message = item["type"], item["msg"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc[:-1]), n=1)
        parent = key[: len(key) - len(str(loc[-1]))]
        return f"{key}: unknown key" + (f"; did you mean {parent}{close[0]}?" if close else "")
    if kind == "missing":
        return f"{key}: required, but not given"
    if kind == "value_error":  # our validators: ValueError("rl.x (..) must ...") naming the key
        message = str(item.get("ctx", {}).get("error", message.removeprefix("Value error, ")))
        return message if not key or message.startswith(key.split("[")[0]) else f"{key}: {message}"
    if kind in _BOUNDS:
        bound, sign = _BOUNDS[kind]
        message = f"must be {sign} {item['ctx'][bound]}"
    else:
        message = message.replace("Input should be", "must be").replace("Assertion failed, ", "")
    given = item.get("input")
    shown = "" if isinstance(given, dict | list) or given is None else f", got {given!r}"
    return f"{key or '(config)'}: {message}{shown}"


def _fields_at(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The field names of the section of `model` at `loc` ([] when unknown)."""
    for part in loc:
        if model is None:
            return []
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        model = _section_type(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds: itself, or the item of a list or an optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in typing.get_args(annotation) if (found := _section_type(arg))), None)


def describe_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per field of `model` and its sections: dotted key, default, docstring."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        item = (typing.get_args(annotation) or (None,))[0] if typing.get_origin(annotation) is list else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"[{prefix}{name}]  {field.description or ''}")
            lines += describe_fields(annotation, f"{prefix}{name}.")
        elif isinstance(item, type) and issubclass(item, BaseModel):  # a list of sections: [[a.b]]
            lines.append(f"[[{prefix}{name}]]  {field.description or ''}")
            lines += describe_fields(item, f"{prefix}{name}[].")
        elif field.is_required():
            lines.append(f"  {prefix}{name} (required)  # {field.description or ''}")
        else:
            default = field.get_default(call_default_factory=True)
            lines.append(f"  {prefix}{name} = {default!r}  # {field.description or ''}")
    return lines


T = TypeVar("T")


def options_from(cls: type[T], *sections: Any, **given: Any) -> T:
    """The frozen options `cls` (a dataclass) of a component: each field from `given` by name,
    else from the first of `sections` with an attribute of that name, else its default. The
    one way options are made from config sections: a field renamed in a section is a `given`."""
    names = {field.name for field in dataclasses.fields(cls) if field.init}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    values = {}
    for name in names:
        if name in given:
            values[name] = given[name]
            continue
        source = next((section for section in sections if hasattr(section, name)), None)
        if source is not None:
            values[name] = getattr(source, name)
    return cls(**values)


def moved_key_errors(data: Any, moved: dict[str, str]) -> list[str]:
    """One line per key of the nested config dict `data` that `moved` (old dotted key -> new
    dotted key) says now lives elsewhere. A key that became a table (`loss = "cispo"` of `[rl]`,
    now `type = "cispo"` of `[rl.loss]`) is moved only while its value is not a table."""
    out = []
    for old, new in moved.items():
        *parents, last = old.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            continue
        value = node[last]
        if new.startswith(old + ".") and isinstance(value, dict):
            continue  # already the new table
        section, _, key = new.rpartition(".")
        out.append(f"{old} moved to {new}: write {key} = {json.dumps(value)} under [{section}]")
    return out


def with_moved_keys(data: dict, moved: dict[str, str]) -> dict:
    """A copy of the nested config dict `data` with every moved key at its new place (a stored
    run's config.json, written before the keys moved, reads as it meant)."""
    data = json.loads(json.dumps(data))
    # a key that becomes a table moves first, so the keys moving into that table find it
    for old, new in sorted(moved.items(), key=lambda item: not item[1].startswith(item[0] + ".")):
        *parents, last = old.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            continue
        if new.startswith(old + ".") and isinstance(node[last], dict):
            continue
        value = node.pop(last)
        *new_parents, new_last = new.split(".")
        target = data
        for part in new_parents:
            target = target.setdefault(part, {})
        target[new_last] = value
    return data


def removed_key_errors(data: Any, removed: dict[str, str]) -> list[str]:
    """One line per key of the nested config dict `data` that `removed` (dotted key -> why it
    went, in a few words) says no longer exists: `<key> was removed: <why>`."""
    return [f"{key} was removed: {why}" for key, why in removed.items()
            if key.rpartition(".")[2] in _parent_table(data, key)]


def without_removed_keys(data: dict, removed: dict[str, str]) -> dict:
    """A copy of the nested config dict `data` without the keys of `removed` (a stored run's
    config.json, written while they existed, reads as today's config)."""
    data = json.loads(json.dumps(data))
    for key in removed:
        _parent_table(data, key).pop(key.rpartition(".")[2], None)
    return data


def _parent_table(data: Any, dotted: str) -> dict:
    """The table of `data` that holds the last part of `dotted` ({} where there is none)."""
    node = data
    for part in dotted.split(".")[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}
