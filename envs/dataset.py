"""A prompt dataset from Parquet or JSONL files, scored by a registered reward function.

    [task]
    env = "dataset"
    options = { path = "data/train.jsonl", eval_path = "data/eval.jsonl",
                prompt_column = "question", answer_column = "answer", reward = "numeric_match" }

Each row gives a prompt (a string, or chat messages: a list of {"role", "content"}) and an answer.
`reward` names a function in the reward registry (`envs.rewards`); `reward_module` is imported first
so that its `@register_reward` functions exist. Without `eval_path`, `eval_fraction` of the rows
are held out by a stable hash of their id. Missing files and columns raise errors naming them.
`reward_module` is code: `rlpipe resume` imports the one a run's config.json names, so resuming
a run directory trusts it (README, "Runs, crashes and trust").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.core.user_code import import_user_module
from rlpipe.envs import math_answers  # noqa: F401 - registers the `math` reward
from rlpipe.envs.base import Example, Split, check_split, options_to_config
from rlpipe.envs.rewards import RewardValue, get_reward
from rlpipe.envs.single_turn import SingleTurnEnv


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Options of the dataset environment (`task.options` in a config)."""

    path: str
    """Train file: .parquet, .jsonl (one JSON object per line) or .json (a list of objects)."""
    eval_path: str = ""
    """Eval file (same format); empty = hold out `eval_fraction` of `path`."""
    prompt_column: str = "prompt"
    """Column holding the prompt (text or chat messages)."""
    answer_column: str = "answer"
    """Column holding the answer the reward checks against."""
    id_column: str = ""
    """Column holding a stable example id; empty = the row number."""
    reward: str = "exact_match"
    """Name of a registered reward function."""
    reward_module: str = ""
    """Module to import before looking the reward up (it registers user reward functions)."""
    eval_fraction: float = 0.0
    """Share of `path` rows held out for eval when `eval_path` is empty."""
    name: str = "dataset"
    """Environment name written into examples (to tell several datasets apart)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")


def read_utf8(path: str | Path) -> str:
    """A text file's content; ValueError naming the file, line and byte when it is not UTF-8
    (instead of a bare UnicodeDecodeError)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(f"{path}: line {line} is not valid UTF-8 (byte {data[err.start]:#04x} at column "
                         f"{column}); save the file as UTF-8") from None


def jsonl_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a UTF-8 JSONL file; ValueError
    naming the file and line that is not JSON."""
    # split on "\n" only: str.splitlines would also cut at U+2028 inside a JSON string
    for lineno, line in enumerate(read_utf8(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {lineno} is not valid JSON ({exc.msg})") from None


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .parquet, .jsonl or .json file as dicts (FileNotFoundError/ValueError naming it)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if suffix == ".jsonl":
        rows = []
        for lineno, row in jsonl_records(p):
            if not isinstance(row, dict):
                raise ValueError(f"{p}: line {lineno} is not a JSON object")
            rows.append(row)
        return rows
    if suffix == ".json":
        rows = json.loads(read_utf8(p))
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{p}: want a JSON list of objects")
        return rows
    raise ValueError(f"{p}: unsupported dataset format {suffix!r} (want .parquet, .jsonl or .json)")


def _check_columns(rows: list[dict[str, Any]], columns: dict[str, str], path: str) -> None:
    if not rows:
        raise ValueError(f"dataset file {path!r} has no rows")
    for option, column in columns.items():
        for i, row in enumerate(rows):
            if column not in row:
                available = ", ".join(sorted(row)) or "none"
                raise ValueError(
                    f"dataset file {path!r}: column {column!r} ({option}) missing"
                    + (f" in row {i}" if i else "")
                    + f"; columns: {available}"
                )


def _held_out(example_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(example_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class DatasetEnv(SingleTurnEnv):
    """Single-turn prompts from a file, scored by a registered reward function."""

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config
        self.name = config.name
        if config.reward_module:
            try:
                import_user_module(config.reward_module)
            except ImportError as error:
                raise ValueError(f"reward_module {config.reward_module!r}: {error}") from None
        self._reward_fn = get_reward(config.reward)
        train = self._load(config.path, "train")
        if config.eval_path:
            self._train, self._eval = train, self._load(config.eval_path, "eval")
        else:
            held = [_held_out(ex.example_id, config.eval_fraction) for ex in train]
            self._train = [ex for ex, h in zip(train, held, strict=True) if not h]
            self._eval = [ex for ex, h in zip(train, held, strict=True) if h]
        if not self._train:
            raise ValueError(
                f"dataset {config.path!r}: no train rows left after holding out eval rows"
            )

    @classmethod
    def from_options(cls, **options: Any) -> DatasetEnv:
        if "path" not in options:
            raise ValueError(
                "environment 'dataset' needs option 'path' (a .parquet or .jsonl file)"
            )
        return cls(options_to_config(DatasetConfig, options, "dataset"))

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        """The rows in file order (shuffling is the prompt source's job; `seed` is unused)."""
        return self._eval if check_split(split) == "eval" else self._train

    def score(self, example: Example, completion_text: str) -> RewardValue:
        return self._reward_fn(completion_text, example.answer, example)

    def _load(self, path: str, split: str) -> list[Example]:
        cfg = self.config
        rows = read_rows(path)
        columns = {"prompt_column": cfg.prompt_column, "answer_column": cfg.answer_column}
        if cfg.id_column:
            columns["id_column"] = cfg.id_column
        _check_columns(rows, columns, path)
        examples = []
        source = "eval" if split == "eval" else "train"
        for i, row in enumerate(rows):
            prompt = row[cfg.prompt_column]
            if not isinstance(prompt, str | list):
                raise ValueError(
                    f"dataset file {path!r}: row {i} column {cfg.prompt_column!r} is "
                    f"{type(prompt).__name__}, want text or a list of chat messages"
                )
            example_id = str(row[cfg.id_column]) if cfg.id_column else f"{source}/{i}"
            meta = {k: v for k, v in row.items() if k not in columns.values()}
            examples.append(Example(self.name, example_id, prompt, row[cfg.answer_column], meta))
        ids = [ex.example_id for ex in examples]
        if len(set(ids)) != len(ids):
            raise ValueError(f"dataset file {path!r}: column {cfg.id_column!r} has duplicate ids")
        return examples
