"""A prompt dataset (a file, a folder, or a hub dataset), scored by a registered reward function.

    [task]
    env = "dataset"
    options = { path = "data/train.jsonl", eval_path = "data/eval.jsonl",
                prompt_column = "question", answer_column = "answer", reward = "numeric_match" }
    options = { path = "hf:openai/gsm8k:main", split = "train", eval_split = "test",
                prompt_column = "question", answer_column = "answer", reward = "math" }

`path` (and `eval_path`) is a .parquet, .jsonl or .json file; a folder (a `datasets`
`save_to_disk` folder, or a folder of data files `datasets.load_dataset` reads); or
`hf:NAME[:CONFIG]`, a dataset on the Hugging Face hub read by `datasets.load_dataset` at `split`
(and `revision`), into the normal Hugging Face cache (HF_HOME, HF_TOKEN; offline, a prepared
`datasets` cache or a hub-cache snapshot of the repository is read). Each row gives a prompt (a
string, or chat messages: a list of {"role", "content"}) and an answer; `prompt_template` formats
the prompt from the row's columns and `system_prompt` adds a system turn. `reward` names a function
in the reward registry (`envs.rewards`, plus `math` from envs/math_answers.py) and gets the answer
column's value as stored; `reward_module` is imported first so that its `@register_reward`
functions exist. Eval rows: `eval_path` and/or `eval_split` when set, else `eval_fraction` of the
rows held out by a stable hash of their id. Missing files, splits and columns raise errors naming
them.
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
    """Train rows: a .parquet, .jsonl (one JSON object per line) or .json (a list of objects) file,
    a folder (`datasets` save_to_disk, or data files), or `hf:NAME[:CONFIG]` (a hub dataset)."""
    split: str = "train"
    """Split of a folder or hub dataset that gives the train rows."""
    revision: str = ""
    """Hub dataset revision (branch, tag or commit); empty = the default branch."""
    eval_path: str = ""
    """Eval rows (same forms as `path`); empty = `path` at `eval_split` when that is set, else hold
    out `eval_fraction` of `path`."""
    eval_split: str = ""
    """Split of the eval rows (of `eval_path`, else of `path`); empty = `split`."""
    prompt_column: str = "prompt"
    """Column holding the prompt (text or chat messages)."""
    prompt_template: str = ""
    """Python format string of the user prompt over the row's columns, e.g. "{question}\\nGive the
    final answer after ####." (literal braces doubled: "\\\\boxed{{}}"); empty = the prompt column
    as is."""
    system_prompt: str = ""
    """A system turn put before the prompt; empty = none."""
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


HUB_PREFIX = "hf:"


def _datasets_quiet() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _hub_rows(spec: str, split: str, revision: str) -> list[dict[str, Any]]:
    """Rows of `hf:NAME[:CONFIG]` at `split`: `datasets.load_dataset` from the hub (or its own
    prepared cache offline); offline without that, from the repository's snapshot in the hub
    cache (huggingface_hub, as a model's)."""
    datasets = _datasets_quiet()
    name, _, config = spec.removeprefix(HUB_PREFIX).partition(":")
    if not name:
        raise ValueError(f"dataset {spec!r}: want hf:NAME or hf:NAME:CONFIG")
    if (cached := _unreachable_hub_snapshot(spec, name, revision)) is not None:
        return _load_with_datasets(lambda: datasets.load_dataset(cached, config or None, split=split), spec).to_list()
    try:
        loaded = datasets.load_dataset(name, config or None, split=split, revision=revision or None)
    except ConnectionError as offline:
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(name, repo_type="dataset", revision=revision or None)
        except Exception:  # noqa: BLE001 - not cached either: the first error says why
            raise ValueError(f"dataset {spec!r}: {_first_line(offline)}") from None
        loaded = _load_with_datasets(lambda: datasets.load_dataset(folder, config or None, split=split), spec)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise ValueError(f"dataset {spec!r} (split {split!r}): {_first_line(error)}") from None
    return loaded.to_list()


class HubUnreachable(ConnectionError, ValueError):
    """A hub dataset neither cached nor reachable: nothing in the options to fix (a ValueError
    like every other dataset problem, a ConnectionError for what is at fault)."""


def _unreachable_hub_snapshot(spec: str, name: str, revision: str) -> str | None:
    """None when the hub answers for dataset `name` (one request, no retries); when it cannot be
    reached (no network, HF_HUB_OFFLINE=1), the dataset's snapshot in the hub cache, or
    HubUnreachable in one line: `datasets` would retry a dead hub for half a minute first."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().dataset_info(name, revision=revision or None, timeout=10)
        return None
    except HfHubHTTPError:
        return None  # reached: load_dataset names what is wrong (no such repo, gated, revision)
    except Exception:  # noqa: BLE001 - a transport error of whichever HTTP client the hub library uses
        pass
    try:
        return snapshot_download(name, repo_type="dataset", revision=revision or None, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached
        raise HubUnreachable(f"hub dataset {spec!r} is not in the Hugging Face cache and the hub cannot be reached "
                              "(no network, or HF_HUB_OFFLINE=1): download it once online, or give a local file "
                              "or folder") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _load_with_datasets(load: Any, spec: str) -> Any:
    try:
        return load()
    except (ValueError, FileNotFoundError, OSError, KeyError) as error:
        raise ValueError(f"dataset {spec!r}: {_first_line(error)}") from None


def _folder_rows(folder: Path, split: str) -> list[dict[str, Any]]:
    """Rows of a `datasets` save_to_disk folder (a Dataset, or a DatasetDict's `split`), else of
    the data files in `folder` as `datasets.load_dataset` reads them."""
    datasets = _datasets_quiet()
    saved = (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()
    if saved:
        loaded = _load_with_datasets(lambda: datasets.load_from_disk(str(folder)), str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"dataset {str(folder)!r} has no split {split!r}; splits: {', '.join(loaded)}")
            loaded = loaded[split]
    else:
        loaded = _load_with_datasets(lambda: datasets.load_dataset(str(folder), split=split), str(folder))
    return loaded.to_list()


def read_dataset(path: str, split: str = "train", revision: str = "") -> list[dict[str, Any]]:
    """Rows (dicts) of a dataset file, folder or `hf:NAME[:CONFIG]` hub dataset (module
    docstring); ValueError/FileNotFoundError with one line naming it."""
    if path.startswith(HUB_PREFIX):
        return _hub_rows(path, split, revision)
    if Path(path).is_dir():
        return _folder_rows(Path(path), split)
    return read_rows(path)


def _check_columns(rows: list[dict[str, Any]], columns: dict[str, str], path: str) -> None:
    if not rows:
        raise ValueError(f"dataset {path!r} has no rows")
    for option, column in columns.items():
        for i, row in enumerate(rows):
            if column not in row:
                available = ", ".join(sorted(row)) or "none"
                raise ValueError(
                    f"dataset {path!r}: column {column!r} ({option}) missing"
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
        train = self._load(config.path, config.split, "train")
        if config.eval_path or config.eval_split:
            eval_rows = self._load(config.eval_path or config.path, config.eval_split or config.split, "eval")
            self._train, self._eval = train, eval_rows
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
                "environment 'dataset' needs option 'path' (a .parquet/.jsonl/.json file, a folder, "
                "or hf:NAME[:CONFIG])"
            )
        return cls(options_to_config(DatasetConfig, options, "dataset"))

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        """The rows in file order (shuffling is the prompt source's job; `seed` is unused)."""
        return self._eval if check_split(split) == "eval" else self._train

    def score(self, example: Example, completion_text: str) -> RewardValue:
        return self._reward_fn(completion_text, example.answer, example)

    def _load(self, path: str, split: str, source: str) -> list[Example]:
        cfg = self.config
        rows = read_dataset(path, split, cfg.revision)
        # with a template the prompt column is unused, but one the config names must still exist
        named = not cfg.prompt_template or cfg.prompt_column != DatasetConfig.prompt_column
        columns = {"prompt_column": cfg.prompt_column} if named else {}
        columns["answer_column"] = cfg.answer_column
        if cfg.id_column:
            columns["id_column"] = cfg.id_column
        _check_columns(rows, columns, path)
        examples = []
        for i, row in enumerate(rows):
            prompt = self._prompt(row, i, path)
            example_id = str(row[cfg.id_column]) if cfg.id_column else f"{source}/{i}"
            meta = {k: v for k, v in row.items() if k not in columns.values()}
            examples.append(Example(self.name, example_id, prompt, row[cfg.answer_column], meta))
        ids = [ex.example_id for ex in examples]
        if len(set(ids)) != len(ids):
            raise ValueError(f"dataset {path!r}: column {cfg.id_column!r} has duplicate ids")
        return examples

    def _prompt(self, row: dict[str, Any], index: int, path: str) -> str | list[dict[str, Any]]:
        """The row's prompt: the prompt column (or `prompt_template` over the row), with
        `system_prompt` as a first turn."""
        cfg = self.config
        prompt = row.get(cfg.prompt_column)
        if cfg.prompt_template:
            try:
                prompt = cfg.prompt_template.format_map(row)
            except KeyError as missing:
                raise ValueError(f"dataset {path!r}: prompt_template names column {missing}, which row "
                                 f"{index} lacks; columns: {', '.join(sorted(row))}") from None
            except (ValueError, IndexError, AttributeError) as error:
                raise ValueError(f"prompt_template {cfg.prompt_template!r}: {error}") from None
        if not isinstance(prompt, str | list):
            raise ValueError(
                f"dataset {path!r}: row {index} column {cfg.prompt_column!r} is "
                f"{type(prompt).__name__}, want text or a list of chat messages"
            )
        if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise ValueError(f"dataset {path!r}: row {index} column {cfg.prompt_column!r} is a list but not "
                             "chat messages ({'role', 'content'} dicts)")
        if cfg.system_prompt:
            turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            prompt = [{"role": "system", "content": cfg.system_prompt}, *turns]
        return prompt
