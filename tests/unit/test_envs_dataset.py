"""The dataset environment: JSONL and Parquet loading, columns, ids, eval split, rewards."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlpipe.envs.dataset import DatasetConfig, DatasetEnv
from rlpipe.envs.registry import build_env


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


ROWS = [
    {"question": "2+2?", "solution": "4", "qid": "a", "level": 1},
    {"question": [{"role": "user", "content": "3+3?"}], "solution": "6", "qid": "b", "level": 2},
    {"question": "5*5?", "solution": "25", "qid": "c", "level": 3},
]


def test_jsonl_loader_columns_ids_and_reward(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    env = build_env(
        "dataset",
        path=str(path),
        prompt_column="question",
        answer_column="solution",
        id_column="qid",
        reward="numeric_match",
    )
    train = env.examples("train")
    assert [ex.example_id for ex in train] == ["a", "b", "c"]
    assert train[0].prompt == "2+2?" and train[0].answer == "4" and train[0].meta == {"level": 1}
    assert env.reset(train[1]) == [{"role": "user", "content": "3+3?"}]
    assert env.reset(train[0]) == [{"role": "user", "content": "2+2?"}]
    assert env.reward(train[0], "The answer is 4").reward == 1.0
    assert env.reward(train[2], "24").components == {"format": 1.0, "correct": 0.0}
    assert list(env.examples("eval")) == []


def test_parquet_loader_and_eval_path(tmp_path):
    table = pa.table({"prompt": ["1+1=", "2+3=", "9+9="], "answer": [2, 5, 18]})
    pq.write_table(table, tmp_path / "train.parquet")
    pq.write_table(table.slice(0, 1), tmp_path / "eval.parquet")
    env = DatasetEnv(
        DatasetConfig(
            path=str(tmp_path / "train.parquet"), eval_path=str(tmp_path / "eval.parquet")
        )
    )
    train, evals = env.examples("train"), env.examples("eval")
    assert [ex.answer for ex in train] == [2, 5, 18]
    assert [ex.example_id for ex in train] == ["train/0", "train/1", "train/2"]
    assert [ex.example_id for ex in evals] == ["eval/0"]
    assert env.reward(train[1], " 5 ").reward == 1.0  # exact_match strips
    assert env.reward(train[1], "6").reward == 0.0


def test_missing_file_and_column_errors_name_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        build_env("dataset", path=str(tmp_path / "nowhere.jsonl"))
    path = _write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"column 'prompt' \(prompt_column\) missing.*question"):
        build_env("dataset", path=str(path))
    with pytest.raises(ValueError, match=r"column 'answer' \(answer_column\)"):
        build_env("dataset", path=str(path), prompt_column="question")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "answer": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        build_env("dataset", path=str(tmp_path / "bad.jsonl"))
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported"):
        build_env("dataset", path=str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_env(
            "dataset",
            path=str(path),
            prompt_column="question",
            answer_column="solution",
            reward="nope",
        )


def test_eval_fraction_holds_out_stable_rows(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": i} for i in range(200)]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    a = build_env("dataset", path=str(path), eval_fraction=0.25)
    b = build_env("dataset", path=str(path), eval_fraction=0.25)
    eval_ids = [ex.example_id for ex in a.examples("eval")]
    assert eval_ids == [ex.example_id for ex in b.examples("eval")]
    assert 25 <= len(eval_ids) <= 75
    assert not set(eval_ids) & {ex.example_id for ex in a.examples("train")}
    assert len(eval_ids) + len(a.examples("train")) == 200


# ----------------------------------------------------------------- datasets: folders and the hub


def test_save_to_disk_folders_and_data_file_folders(tmp_path, monkeypatch):
    import datasets

    from tests.hub_cache import use_hub_cache

    use_hub_cache(monkeypatch, tmp_path / "hf")
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(6)]
    whole = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                                  "test": datasets.Dataset.from_list(rows[4:])})
    whole.save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    (tmp_path / "files").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "files" / "train.parquet")
    env = build_env("dataset", path=str(tmp_path / "dict"), eval_split="test", prompt_column="q",
                    answer_column="a", reward="math")
    assert [ex.prompt for ex in env.examples("train")] == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert [ex.answer for ex in env.examples("eval")] == ["5", "6"]
    assert env.reward(env.examples("eval")[0], "it is 5").reward == 1.0
    assert len(build_env("dataset", path=str(tmp_path / "one"), prompt_column="q", answer_column="a").examples("train")) == 6
    assert len(build_env("dataset", path=str(tmp_path / "files"), prompt_column="q", answer_column="a").examples("train")) == 3
    with pytest.raises(ValueError, match="has no split 'validation'; splits: train, test"):
        build_env("dataset", path=str(tmp_path / "dict"), split="validation", prompt_column="q", answer_column="a")


def test_a_hub_dataset_by_name_config_and_split_offline(tmp_path, monkeypatch):
    """hf:NAME:CONFIG read through `datasets` from a hub-cache snapshot (HF_HUB_OFFLINE=1, as
    after one download), GSM8K's '#### N' answers scored by the math reward."""
    from tests.hub_cache import tiny_hub_gsm8k, use_hub_cache

    use_hub_cache(monkeypatch, tmp_path / "hf")
    tiny_hub_gsm8k(tmp_path / "hf", train=12, test=3)
    env = build_env("dataset", path="hf:openai/gsm8k:main", split="train", eval_split="test",
                    prompt_column="question", answer_column="answer", reward="math",
                    system_prompt="Answer after ####.", prompt_template="Solve: {question}")
    train, held = env.examples("train"), env.examples("eval")
    assert (len(train), len(held)) == (12, 3)
    assert env.reset(train[0]) == [{"role": "system", "content": "Answer after ####."},
                                   {"role": "user", "content": "Solve: 1+2="}]
    assert train[0].answer == "1 plus 2 is 3.\n#### 3"  # the column as stored; the reward reduces it
    assert env.reward(train[0], "1 and 2 make\n#### 3").reward == 1.0
    assert env.reward(train[0], "#### 4").reward == 0.0
    for options, says in [({"path": "hf:nobody/nothing"}, "hf:nobody/nothing"),
                          ({"path": "hf:openai/gsm8k:main", "split": "dev"}, "dev"),
                          ({"path": "hf:openai/gsm8k:main", "prompt_template": "{problem}"}, "names column 'problem'")]:
        with pytest.raises(ValueError, match=says) as error:
            build_env("dataset", prompt_column="question", answer_column="answer", **options)
        assert "\n" not in str(error.value)


def _readme_block(after: str) -> str:
    """The indented block of README.md that starts at the line holding `after`."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip() + "\n"


def test_the_readme_dataset_options_and_reward_example_work_as_printed(tmp_path, monkeypatch):
    """README, "Your model, your data, your reward": its [task] block and its reward module, found
    in the working directory (core/user_code.py), on a GSM8K-shaped hub dataset."""
    import sys
    import tomllib

    from rlpipe.envs.rewards import REWARDS

    from tests.hub_cache import tiny_hub_gsm8k, use_hub_cache

    use_hub_cache(monkeypatch, tmp_path / "hf")
    tiny_hub_gsm8k(tmp_path / "hf", train=5, test=2)
    task = tomllib.loads(_readme_block("    [task]"))["task"]
    (tmp_path / "work" / "mypkg").mkdir(parents=True)
    (tmp_path / "work" / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "work" / "mypkg" / "rewards.py").write_text(_readme_block("# mypkg/rewards.py"))
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(REWARDS, "_fns", dict(REWARDS._fns))
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        env = build_env(task["env"], **{**task["options"], "reward": "strict_math", "reward_module": "mypkg.rewards"})
        example = env.examples("train")[0]
        assert env.reset(example) == [{"role": "user", "content": "1+2=\nGive the final answer after ####."}]
        assert env.reward(example, "so #### 3").reward == 1.0
        assert env.reward(example, "#### 3" + " " * 2001).reward == 0.9
        assert len(env.examples("eval")) == 2
    finally:
        for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
            del sys.modules[name]


def test_a_hub_dataset_at_a_pinned_revision_and_literal_braces_in_the_template(tmp_path, monkeypatch):
    from tests.hub_cache import tiny_hub_gsm8k, use_hub_cache

    use_hub_cache(monkeypatch, tmp_path / "hf")
    commit = tiny_hub_gsm8k(tmp_path / "hf", train=4, test=1).name
    env = build_env("dataset", path="hf:openai/gsm8k:main", revision=commit, eval_split="test",
                    prompt_column="question", answer_column="answer", reward="math",
                    prompt_template="{question} Put the answer in \\boxed{{}}.")
    assert env.examples("train")[1].prompt == "2+3= Put the answer in \\boxed{}."
    assert env.reward(env.examples("train")[1], "so \\boxed{5}").reward == 1.0
    with pytest.raises(ValueError, match="hf:openai/gsm8k:main"):
        build_env("dataset", path="hf:openai/gsm8k:main", revision="0" * 40, prompt_column="question",
                  answer_column="answer")


def test_a_hub_dataset_out_of_reach_fails_at_once_in_one_line(tmp_path, monkeypatch, capfd):
    """No network (a hub endpoint that refuses connections) and no cached copy: one line saying
    so, after one request, with no retry lines (`datasets` alone retried for half a minute);
    pre-flight names it without asking to change the options. A cached copy still loads."""
    import time

    import datasets
    from huggingface_hub import constants
    from rlpipe.core.config import ConfigError
    from rlpipe.tasks.preflight import _check

    from tests.hub_cache import tiny_hub_gsm8k, use_hub_cache

    use_hub_cache(monkeypatch, tmp_path / "hf")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    began = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        _check("task.options", "give task.options that environment 'dataset' accepts",
               lambda: build_env("dataset", path="hf:nobody/nothing", prompt_column="question"))
    assert time.perf_counter() - began < 5
    assert str(error.value) == ("task.options: hub dataset 'hf:nobody/nothing' is not in the Hugging Face cache and "
                                "the hub cannot be reached (no network, or HF_HUB_OFFLINE=1): download it once online, "
                                "or give a local file or folder")
    assert "Retrying" not in capfd.readouterr().err
    tiny_hub_gsm8k(tmp_path / "hf", train=4, test=2)
    env = build_env("dataset", path="hf:openai/gsm8k:main", prompt_column="question", eval_split="test")
    assert len(env.examples("train")) == 4


def test_a_prompt_column_that_is_not_there_is_refused_with_a_template_too(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"column 'questoin' \(prompt_column\) missing.*question"):
        build_env("dataset", path=str(path), prompt_column="questoin", prompt_template="Q: {question}",
                  answer_column="solution")
    env = build_env("dataset", path=str(path), prompt_template="Q: {question}", answer_column="solution")
    assert env.reset(env.examples("train")[0])[-1]["content"].startswith("Q: ")
