"""A distillation teacher over HTTP: `rlpipe serve`'s prompt log-probs and /tokenize, the HTTP
teacher's scores against the in-process teacher's, its refusals of another tokenizer, a smaller
vocabulary, an unreachable server and answers that do not line up, and the lineage it leaves in
the rollouts table for the canned query `teacher_by_step`."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from rlpipe.core.config import ConfigError
from rlpipe.engines.http import HttpOptions
from rlpipe.engines.http_teacher import HttpTeacher, TeacherResponseError
from rlpipe.engines.serve_app import build_app
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.rollouts.distill import ModelTeacher, with_teacher
from rlpipe.rollouts.records import Rollout
from rlpipe.storage.queries import run_canned
from rlpipe.storage.writer import write_table
from rlpipe.tasks.config import RunConfig
from rlpipe.tasks.teacher import served_teacher
from rlpipe.training.checkpoint_io import save_checkpoint

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
COMPLETIONS = [[14, 15, 16, 17], [], [18]]
NO_RETRY = HttpOptions(retries=0)


def served(root, tokenizer, vocab_size=None, seed=0):
    """A tiny checkpoint under `root` and an in-process `rlpipe serve` of it; (client, model)."""
    model = build_model("tiny-dense", vocab_size=vocab_size or len(tokenizer), seed=seed)
    save_checkpoint(root, 0, model, tokenizer)
    checkpoint = root / "checkpoints" / "step_000000"
    return TestClient(build_app(checkpoint, served_model_names=["teacher-v1"]), base_url="http://localhost"), model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    client, model = served(tmp_path_factory.mktemp("teacher"), build_tokenizer())
    with client:
        yield client, model


def test_serve_answers_vllm_prompt_logprobs_and_tokenize(server):
    client, model = server
    ids = [5, 6, 7, 8, 9]
    out = client.post("/v1/completions", json={"prompt": [ids, ids[:2]], "n": 2, "max_tokens": 1,
                                               "prompt_logprobs": 2}).json()
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    entries = out["choices"][1]["prompt_logprobs"]  # choice 1: prompt 0's second sample
    assert len(entries) == 5 and entries[0] is None and out["choices"][2]["prompt_logprobs"][0] is None
    for position in range(1, 5):
        entry, token = entries[position], ids[position]
        assert entry[str(token)]["logprob"] == pytest.approx(float(want[position - 1, token]), abs=1e-5)
        assert entry[str(token)]["rank"] == int((want[position - 1] > want[position - 1, token]).sum()) + 1
        assert len(entry) in (2, 3) and all(v["logprob"] <= 0 for v in entry.values())  # itself and the top 2
    tokens = client.post("/tokenize", json={"prompt": "12 + 3", "add_special_tokens": False}).json()
    assert tokens["tokens"] == build_tokenizer()("12 + 3", add_special_tokens=False)["input_ids"]
    for body, says in [({"prompt": ids, "prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
                       ({"prompt": ids, "prompt_logprobs": 0, "stream": True}, "not supported with stream")]:
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400 and says in refused.json()["error"]["message"]


def test_the_served_teacher_scores_as_the_in_process_one_and_names_itself(server):
    client, model = server
    teacher = HttpTeacher("http://localhost", NO_RETRY, client=client)
    teacher.check(build_tokenizer())
    got = teacher.logprobs(PROMPTS, COMPLETIONS)
    assert got[1] == [] and got == [pytest.approx(x, abs=1e-5) for x in ModelTeacher(model).logprobs(PROMPTS, COMPLETIONS)]
    lineage = teacher.lineage()
    assert lineage["teacher"] == "teacher-v1" and lineage["teacher_url"] == "http://localhost"
    assert lineage["teacher_checkpoint"].endswith("step_000000")
    assert HttpTeacher("http://localhost", NO_RETRY, name="mine", client=client).lineage()["teacher"] == "mine"


def test_rows_scored_over_http_say_which_teacher_for_the_canned_query(server, tmp_path):
    client, _ = server
    teacher = HttpTeacher("http://localhost", NO_RETRY, name="t", client=client)
    rows = with_teacher([Rollout(run_id="r", step=3, policy_version=2, env="e", example_id=f"x{i}", group_id="g",
                                 sample_id=f"s{i}", attempt=1, prompt_tokens=p, completion_tokens=c,
                                 completion_logprobs=[-1.0] * len(c), finish_reason="stop", prompt_text="",
                                 completion_text="", n_prompt_tokens=len(p), n_completion_tokens=len(c))
                         for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True))], teacher)
    assert {(r.teacher, r.teacher_url) for r in rows} == {("t", "http://localhost")}
    write_table(tmp_path, "rollouts", 3, [r.row() for r in rows], run_id="r")
    [row] = run_canned([tmp_path], "teacher_by_step").to_pylist()
    scored = [x for r in rows for x in r.teacher_logprobs]
    assert (row["step"], row["teacher"], row["teacher_url"], row["samples"], row["tokens"]) == \
        (3, "t", "http://localhost", 2, 5)
    assert row["teacher_checkpoint"].endswith("step_000000")
    assert row["reverse_kl"] == pytest.approx(sum(-1.0 - t for t in scored) / 5, abs=1e-5)


def test_a_teacher_with_another_tokenizer_or_a_smaller_vocabulary_is_refused_in_one_line(tmp_path):
    rl = RunConfig(rl={"distill": {"type": "reward", "url": "http://localhost", "retries": 0}}).rl
    other, _ = served(tmp_path / "other", build_tokenizer("0123456789+-*="))
    with other, pytest.raises(ValueError) as refused:
        served_teacher(rl, build_tokenizer(), client=other)
    assert "has another tokenizer than the student" in str(refused.value) and "\n" not in str(refused.value)
    student = build_tokenizer()
    small, _ = served(tmp_path / "small", student, vocab_size=len(student) - 1)
    with small, pytest.raises(ValueError) as refused:
        served_teacher(rl, student, client=small)
    assert f"cannot score the student's last token id {len(student) - 1}" in str(refused.value)


def test_an_unreachable_teacher_is_one_line_before_anything_is_written(tmp_path):
    from rlpipe.tasks.preflight import preflight

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = RunConfig(flow="rl", runs_root=str(tmp_path / "runs"),
                       rl={"distill": {"type": "reward", "url": f"http://127.0.0.1:{port}", "retries": 0}})
    with pytest.raises(ConfigError) as refused:
        preflight(config)
    message = str(refused.value)
    assert message.startswith(f"rl.distill.url: the teacher at http://127.0.0.1:{port} cannot teach") and \
        "unreachable" in message and "\n" not in message
    assert not (tmp_path / "runs").exists()


def _answering(choices) -> httpx.Client:
    """A client whose server answers every completions request with `choices`."""
    body = json.dumps({"choices": choices}).encode()  # NaN as JavaScript's, as Python servers send it
    return httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": "application/json"})))


def _entry(token, logprob=-0.5):
    return {str(token): {"logprob": logprob, "rank": 1, "decoded_token": "x"}}


@pytest.mark.parametrize(("choices", "says"), [
    ([], "answered 0 choices for 1 sequences"),
    ([{"index": 0, "text": ""}], "no prompt_logprobs for sequence 0"),
    ([{"index": 0, "prompt_logprobs": [None, _entry(6), _entry(7)]}], "3 prompt log-probs for 4 tokens sent"),
    ([{"index": 0, "prompt_logprobs": [None, _entry(6), _entry(7), _entry(9)]}],
     "scored token(s) ['9'] at position 3, not the student's token 8"),
    ([{"index": 0, "prompt_logprobs": [None, _entry(6), _entry(7), _entry(8, float("nan"))]}], "log-prob nan"),
    ([{"index": 0, "prompt_logprobs": [None, _entry(6), _entry(7), _entry(8, float("-inf"))]}], "log-prob -inf"),
    ([{"index": 0, "prompt_logprobs": [None, _entry(6), _entry(7), _entry(8, 2.0)]}], "log-prob 2.0"),
])
def test_answers_that_do_not_line_up_are_refused_naming_the_place(choices, says):
    teacher = HttpTeacher("http://teacher", NO_RETRY, client=_answering(choices))
    with pytest.raises(TeacherResponseError, match="the teacher at http://teacher") as refused:
        teacher.logprobs([[5, 6, 7]], [[8]])
    assert says in str(refused.value)


def test_a_teacher_that_goes_away_mid_run_stops_it_naming_the_teacher():
    from rlpipe.engines.http_wire import EngineUnavailableError

    down = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(503, text="overloaded")))
    with pytest.raises(EngineUnavailableError) as stopped:
        HttpTeacher("http://teacher", NO_RETRY, client=down).logprobs([[5, 6]], [[7]])
    assert str(stopped.value).startswith("the teacher at http://teacher: ") and "unreachable" in str(stopped.value)


def test_a_vllm_teacher_is_asked_by_its_served_name_in_vllms_shapes():
    """A stand-in for `vllm serve` answering as vLLM does (its /v1/models, /tokenize and
    prompt_logprobs entries with rank and decoded_token): every request names the model."""
    student, seen = build_tokenizer(), []

    def vllm(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body and body.get("model")))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "Qwen/Qwen3-0.6B", "root": "/m/q"}]})
        if request.url.path == "/tokenize":
            ids = student(body["prompt"], add_special_tokens=body["add_special_tokens"])["input_ids"]
            return httpx.Response(200, json={"count": len(ids), "max_model_len": 4096, "tokens": ids,
                                             "token_strs": None})
        choices = [{"index": i, "text": "", "prompt_logprobs": [None] + [
            {str(t): {"logprob": -0.25 * k, "rank": k, "decoded_token": "x"}} for k, t in enumerate(ids[1:], 1)]}
            for i, ids in enumerate(body["prompt"])]
        return httpx.Response(200, json={"choices": choices})

    teacher = HttpTeacher("vllm+http://gpu:8000", NO_RETRY, client=httpx.Client(transport=httpx.MockTransport(vllm)))
    teacher.check(student)
    assert teacher.logprobs([[5, 6, 7]], [[8, 9]]) == [[-0.75, -1.0]]
    assert teacher.lineage() == {"teacher": "Qwen/Qwen3-0.6B", "teacher_checkpoint": "/m/q", "teacher_url": "http://gpu:8000"}
    assert {model for path, model in seen if path != "/v1/models"} == {"Qwen/Qwen3-0.6B"}


def test_a_url_names_a_served_teacher_for_rescore_over_a_real_socket(server):
    from rlpipe.tasks.teacher import teacher_for

    from tests.serve_sockets import serving

    client, model = server
    config = RunConfig(rl={"distill": {"type": "reward", "retries": 0}, "teacher": "t"})
    with serving(client.app) as (host, port):
        teacher = teacher_for(f"http://{host}:{port}", config)
        try:
            got = teacher.logprobs(PROMPTS, COMPLETIONS)
            lineage = teacher.lineage()
        finally:
            teacher.close()
    assert got == [pytest.approx(x, abs=1e-5) for x in ModelTeacher(model).logprobs(PROMPTS, COMPLETIONS)]
    assert lineage["teacher"] == "teacher-v1" and lineage["teacher_url"] == f"http://{host}:{port}"
