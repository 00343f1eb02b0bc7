"""Bad input gives a clear error naming the culprit: non-UTF-8 data files (file and line), and a
reward function that hangs (a recorded reward error, counted in the share that fails a step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlpipe.envs.dataset import read_rows
from rlpipe.tasks.setup import read_chat_jsonl, read_documents

LATIN1 = "café".encode("latin-1")  # b"caf\xe9": not UTF-8


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("reader, name, good", [
    (read_rows, "data.jsonl", json.dumps({"prompt": "1+1", "answer": 2}).encode()),
    (read_chat_jsonl, "chats.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()),
    (read_documents, "docs.jsonl", json.dumps({"text": "a document"}).encode()),
    (read_documents, "docs.txt", b"a document"),
])
def test_non_utf8_data_names_the_file_and_line(tmp_path, reader, name, good):
    bad = b'{"text": "' + LATIN1 + b'"}' if name.endswith(".jsonl") else LATIN1
    path = write_lines(tmp_path / name, [good, b"", good, bad, good])
    with pytest.raises(ValueError, match=rf"{name}: line 4 is not valid UTF-8 \(byte 0xe9"):
        reader(path)
    write_lines(path, [good, good])
    assert len(reader(path)) == 2


@pytest.mark.parametrize("reader, name, good", [
    (read_rows, "data.jsonl", json.dumps({"prompt": "1+1", "answer": 2}).encode()),
    (read_chat_jsonl, "chats.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()),
    (read_documents, "docs.jsonl", json.dumps({"text": "a document"}).encode()),
])
def test_a_jsonl_line_that_is_not_json_names_the_file_and_line(tmp_path, reader, name, good):
    path = write_lines(tmp_path / name, [good, b"", b'{"text": "unterminated', good])
    with pytest.raises(ValueError, match=rf"{name}: line 3 is not valid JSON"):
        reader(path)


def test_a_json_dataset_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b'[\n{"prompt": "x", "answer": 1},\n{"prompt": "' + LATIN1 + b'", "answer": 2}\n]\n')
    with pytest.raises(ValueError, match=r"rows\.json: line 3 is not valid UTF-8"):
        read_rows(path)


class Hangs:
    """A user environment whose reward hangs on some completions (an infinite loop, a dead API)."""

    name = "hangs"

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def reward(self, example, transcript):
        from rlpipe.envs.base import RewardResult

        if transcript == "hang":
            self.release.wait(60)  # bounded so the abandoned thread ends with the test
        return RewardResult(1.0, {})

    def examples(self, split, seed=0):
        return []


def rollouts(texts: list[str]) -> list:
    from tests.rollout_rows import rollout

    return [rollout(sample_id=f"s{i}", example_id="e", completion_text=text) for i, text in enumerate(texts)]


def test_a_hanging_reward_becomes_a_recorded_reward_error_within_the_timeout():
    import time

    from rlpipe.envs.base import Example
    from rlpipe.envs.rewards import RewardError
    from rlpipe.envs.timeout import with_reward_timeout
    from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts

    inner = Hangs()
    env = with_reward_timeout(inner, 0.2)
    examples = {"e": Example("hangs", "e", "prompt", 0)}
    try:
        began = time.monotonic()
        rows = score_rollouts(env, examples, rollouts(["ok", "hang", "ok", "ok"]), ScoreOptions(max_error_fraction=0.5))
        assert time.monotonic() - began < 5
        assert [r.reward for r in rows] == [1.0, 0.0, 1.0, 1.0]
        assert rows[1].error.startswith("RewardTimeout") and "task.reward_timeout_s=0.2s" in rows[1].error
        assert [r.error for r in rows if r.sample_id != "s1"] == [None] * 3
        # timeouts count in the error share that fails a step
        with pytest.raises(RewardError, match="2 of 3 reward calls raised"):
            score_rollouts(env, examples, rollouts(["hang", "hang", "ok"]), ScoreOptions(max_error_fraction=0.5))
        assert env.examples("train") == [] and env.name == "hangs"  # the rest is the env's own
    finally:
        inner.release.set()
    assert with_reward_timeout(inner, 0) is inner


def test_reward_timeout_is_a_config_key_that_refuses_negatives():
    from rlpipe.core.config import ConfigError
    from rlpipe.tasks.config import validate_config

    assert validate_config({"task": {"reward_timeout_s": 2.5}}).task.reward_timeout_s == 2.5
    with pytest.raises(ConfigError, match=r"task\.reward_timeout_s"):
        validate_config({"task": {"reward_timeout_s": -1}})
