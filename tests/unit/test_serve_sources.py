"""`rlpipe serve MODEL` serves what a user has: a checkpoint, a run folder (its newest checkpoint;
a pipeline's RL phase first), a plain Hugging Face folder, a hub id from the cache (built here: no
network); anything else is refused in one line. Every request is logged in one line: client,
method and path, status, tokens, seconds."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from fastapi.testclient import TestClient
from rlpipe.engines.serve_app import build_app
from rlpipe.engines.serve_sources import served_source
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer

from tests.hub_cache import tiny_hub_model, use_hub_cache
from tests.unit.test_server import ckpt, run_dir  # noqa: F401 - fixtures

GREEDY = {"prompt": "12+7=", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def served(app_source, **kwargs):
    return TestClient(build_app(app_source, **kwargs), base_url="http://localhost")


def greedy_tokens(client) -> list[int]:
    answer = client.post("/v1/completions", json=GREEDY)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def test_a_run_folder_serves_its_newest_checkpoint(run_dir, tmp_path):  # noqa: F811
    with served(run_dir) as client:
        health = client.get("/health").json()
        assert health["policy_version"] == 3 and health["checkpoint"] == str(ckpt(run_dir, 3))
        assert client.get("/v1/models").json()["data"][0]["id"] == str(run_dir)  # MODEL as given
    pipeline = tmp_path / "pipe"
    shutil.copytree(ckpt(run_dir, 0), pipeline / "sft" / "checkpoints" / "step_000000")
    (pipeline / "sft" / "run.json").write_text("{}")
    assert served_source(pipeline).path == pipeline / "sft" / "checkpoints" / "step_000000"  # no RL checkpoint yet
    shutil.copytree(ckpt(run_dir, 3), pipeline / "rl" / "checkpoints" / "step_000003")
    source = served_source(pipeline)
    assert (source.kind, source.path) == ("run", pipeline / "rl" / "checkpoints" / "step_000003")


def test_a_plain_hugging_face_folder_and_a_hub_id_serve_as_policy_version_0(run_dir, tmp_path, monkeypatch):  # noqa: F811
    tok = build_tokenizer()
    plain = tmp_path / "plain"
    build_model("tiny-dense", vocab_size=len(tok), seed=1).save_pretrained(plain)  # step 3's weights
    tok.save_pretrained(plain)
    assert not (plain / "metadata.json").exists()
    with served(ckpt(run_dir, 3)) as client:
        expected = greedy_tokens(client)
    with served(plain) as client:
        assert client.get("/health").json()["policy_version"] == 0
        assert greedy_tokens(client) == expected
    use_hub_cache(monkeypatch, tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = tiny_hub_model(tmp_path / "hf", "tiny-org/Tiny-Qwen3", seed=1)
    with served("tiny-org/Tiny-Qwen3") as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-org/Tiny-Qwen3"
        assert client.get("/health").json()["checkpoint"] == str(snapshot)
        assert len(greedy_tokens(client)) == 4


@pytest.mark.parametrize("make, words", [
    (lambda p: p.mkdir(), "is not a checkpoint (metadata.json), a run folder (run.json, checkpoints/) or a "
                          "Hugging Face model folder (config.json)"),
    (lambda p: (p / "checkpoints").mkdir(parents=True), "has no checkpoint yet"),
    (lambda p: None, "does not exist: give a checkpoint, a run folder, a Hugging Face model folder or a hub id"),
])
def test_anything_else_is_refused_in_one_line(tmp_path, make, words):
    folder = tmp_path / "x"
    make(folder)
    with pytest.raises(ValueError, match=re.escape(words)) as refused:
        served_source(folder)
    assert "\n" not in str(refused.value) and str(folder) in str(refused.value)


def test_the_command_line_refuses_a_folder_it_cannot_serve(tmp_path, capsys):
    from rlpipe.engines.serve_cli import main

    assert main([str(tmp_path), "--port", "0"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"rlpipe serve: '{tmp_path}' is not a checkpoint")


LINE = re.compile(r'rlpipe serve: testclient:\d+ "(?P<request>[A-Z]+ [^"]+)" (?P<status>\d{3}) '
                  r'(?P<tokens>-|prompt_tokens=\d+ completion_tokens=\d+) (?P<seconds>\d+\.\d{3})s')


def test_one_log_line_per_request_with_its_status_tokens_and_seconds(run_dir):  # noqa: F811
    lines: list[str] = []
    with served(ckpt(run_dir, 0), token="secret", request_log=lines.append) as client:
        auth = {"Authorization": "Bearer secret"}
        answer = client.post("/v1/completions", json={**GREEDY, "n": 2}, headers=auth).json()
        chat = client.post("/v1/chat/completions", headers=auth, json={
            "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "ignore_eos": True}).json()
        with client.stream("POST", "/v1/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 5, "ignore_eos": True,
                "stream": True}) as stream:
            "".join(stream.iter_text())
        client.get("/health", headers=auth)
        client.get("/health")  # no token: 401
        client.post("/v1/completions", json={**GREEDY, "max_tokens": 10**7}, headers=auth)  # over the cap
    found = [LINE.fullmatch(line) for line in lines]
    assert all(found), lines
    got = [(m["request"], m["status"], m["tokens"]) for m in found]
    tokens = lambda usage: f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"  # noqa: E731
    assert got == [("POST /v1/completions", "200", tokens(answer["usage"])),
                   ("POST /v1/chat/completions", "200", tokens(chat["usage"])),
                   ("POST /v1/chat/completions", "200", f"prompt_tokens={chat['usage']['prompt_tokens']} "
                                                         "completion_tokens=5"),
                   ("GET /health", "200", "-"), ("GET /health", "401", "-"), ("POST /v1/completions", "400", "-")]
    assert answer["usage"]["completion_tokens"] == 8 and all(float(m["seconds"]) < 60 for m in found)
    assert json.dumps(lines).count("secret") == 0


def test_a_registered_version_serves_from_its_artifact_folder(run_dir, tmp_path, monkeypatch):  # noqa: F811
    """`rlpipe serve models:/NAME@best --runs-root runs`: the version's files are read where the
    registry keeps them (hard links to the checkpoint's, no copy), verified, at its policy version."""
    from rlpipe.storage.tracking import MlflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="no MLflow registry at .* to read a models:/ model from"):
        served_source("models:/served@best", tmp_path / "nowhere")
    tracker = MlflowTracker.for_runs_root(tmp_path / "runs")
    with tracker.start("served", "rlpipe-test"):
        version = tracker.register_checkpoint(ckpt(run_dir, 3), "served")
        tracker.set_alias("served", "best", version)
    source = served_source("models:/served@best", tmp_path / "runs")
    assert source.kind == "registry" and source.path.is_relative_to(tmp_path / "runs" / "mlartifacts")
    assert not (source.path / "optimizer.pt").exists()
    with served(source.path) as client:
        assert client.get("/health").json()["policy_version"] == 3
        assert len(greedy_tokens(client)) == 4
    from rlpipe.tasks.teacher import teacher_folder  # a models:/ teacher is read in place too

    assert teacher_folder("models:/served@best", tmp_path / "runs") == source.path
