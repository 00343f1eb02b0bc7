"""`rlpipe run configs/tiny.toml --nproc-per-node 2` end to end (gloo, 2 ranks on the CPU): the
pipeline completes with every table and Hugging Face checkpoints; a rank SIGKILLed mid-run fails
the run with an error naming it, and `rlpipe resume --nproc-per-node 2` finishes it with nothing
lost (every table's row count, and the weights, equal the uninterrupted run's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_resume import env_for, rows  # same folder: pytest puts it on sys.path

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
pytestmark = pytest.mark.slow
# lean: 3 SFT steps, 4 RL steps with a checkpoint every 2; a KL penalty (its reference's log-probs
# travel from rank 0 with the batches), so resume also restores the reference
OVERRIDES = ["--set", "sft.steps=3", "--set", "rl.steps=4", "--set", "rl.checkpoint_every=2", "--set", "threads=1",
             "--set", "rl.loss.kl_coef=0.05"]
TABLES = ("rollouts", "scores", "groups", "advantages", "batches", "train_steps", "train_tokens", "evals",
          "checkpoints")


def command(runs: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--nproc-per-node", "2",
            "--set", f"runs_root={runs}", "--set", f"run_name={name}", *OVERRIDES]


@pytest.fixture(scope="module")
def straight(two_rank_run) -> Path:
    """An uninterrupted 2-rank run (conftest.py, shared with the two-node test)."""
    return two_rank_run


def test_tiny_pipeline_completes_on_two_ranks(straight):
    from transformers import AutoModelForCausalLM

    for phase, steps in (("sft", 3), ("rl", 4)):
        assert json.loads((straight / phase / "run.json").read_text())["status"] == "finished"
        assert json.loads((straight / phase / "config.json").read_text())["train"]["parallel"] == "ddp"
        trained = sorted(int(p.name[5:]) for p in (straight / phase / "tables" / "train_steps").glob("step=*"))
        assert trained == list(range(1, steps + 1)), phase
    for table in TABLES:
        assert rows(straight, table) > 0, table
    last = sorted((straight / "rl" / "checkpoints").glob("step_*"))[-1]
    assert last.name == "step_000004"
    model = AutoModelForCausalLM.from_pretrained(last)  # plain transformers, no rlpipe code
    saved = load_file(last / "model.safetensors")
    for name, value in model.state_dict().items():
        if name in saved:
            assert torch.equal(value, saved[name]), name
    state = torch.load(last / "optimizer.pt", weights_only=True)  # the single-process format
    assert len(state["optimizer"]["state"]) == len(list(model.parameters()))


def test_every_trained_token_has_the_trainer_logprob_one_process_computes(straight):
    """Every rank's share of a step reaches the tokens view; step 3's trainer log-probs equal a
    single-process recomputation from checkpoint step 2 (the weights step 3 trained)."""
    from rlpipe.models.loading import autocast_context, load_model
    from rlpipe.storage.catalog import connect
    from rlpipe.storage.writer import read_table
    from rlpipe.tasks.tokens import packed_batch
    from rlpipe.training.logprobs import token_logprobs

    run = straight / "rl"
    con = connect([run])
    trained, missing = con.execute("select count(*), count(*) - count(trainer_logprob) from tokens").fetchall()[0]
    assert trained > 0 and missing == 0, (trained, missing)
    assert con.execute("select count(distinct step) from tokens").fetchall()[0][0] == 4
    # the loss metrics over every rank (their values: tests/integration/test_distributed_extras.py)
    assert con.execute("select count(*) from train_steps where entropy is null or kl is null").fetchall()[0][0] == 0
    config = json.loads((run / "config.json").read_text())
    model = load_model(run / "checkpoints" / "step_000002")
    rows = read_table(run, "train_tokens", 3).to_pylist()
    assert len(rows) >= 2  # a micro-batch per rank at least (tasks/pack.py sizes them so)
    worst = 0.0
    with torch.no_grad(), autocast_context("cpu", config["model"]["bf16_autocast"]):
        for row in rows:
            mine, _ = token_logprobs(model, packed_batch(row), temperature=config["rl"]["sampling"]["temperature"])
            worst = max(worst, (mine.float() - torch.tensor(row["trainer_logprobs"])).abs().max().item())
    # DDP replicas hold rank 0's weights bit for bit, and a micro-batch's forward does not depend
    # on the others: measured 0.0 in fp32 with 1 thread
    assert worst < 1e-6, worst


def test_a_two_rank_step_replays_in_one_process_within_the_tolerance(straight, tmp_path):
    # step 4: no checkpoint after step 2, so steps 3 and 4 are replayed forward
    done = warm_cli.run([sys.executable, "-m", "rlpipe.flows.cli", "replay", str(straight / "rl"), "--step", "4"],
                        env=env_for(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "not bit for bit" in done.stdout and "OK: step 4 matches within 0.0001" in done.stdout, done.stdout


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank`, a process the launcher started: its child whose environment says
    RANK=rank, or where the launcher is warm, its rank zygote's child named rlpipe-rank-RANK
    (tests/warm_cli.py)."""
    parents, marked = {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0")
                    or (entry / "comm").read_text().strip() == f"rlpipe-rank-{rank}"):
                marked.add(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return next((pid for pid in sorted(marked) if launcher in (parents[pid], parents.get(parents[pid]))), None)


def test_a_killed_rank_fails_the_run_naming_it_and_resume_loses_nothing(straight, tmp_path, prefect_api_url):
    # the session's Prefect server for the killed run and its resume (`straight` keeps the embedded one)
    env, runs = env_for(tmp_path, prefect_api_url), tmp_path / "runs"
    killed = runs / "killed"
    trigger = killed / "rl" / "checkpoints" / "step_000002" / "metadata.json"
    process = warm_cli.Popen(command(runs, "killed"), env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not trigger.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before the kill point"
        pid = rank_pid(process.pid, 1)
        assert pid is not None, "rank 1 not found among the launcher's children"
        os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        _, stderr = process.communicate(timeout=TIMEOUT_S)
        failed_in = time.monotonic() - began
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert process.returncode == 1
    assert f"rank 1 (local rank 1, pid {pid}) killed by SIGKILL" in stderr, stderr[-3000:]
    assert f"rlpipe resume {killed} --nproc-per-node 2" in stderr
    assert failed_in < 120, f"rank 0 took {failed_in:.0f} s to give up"
    assert json.loads((killed / "rl" / "run.json").read_text())["status"] == "failed"
    assert json.loads((killed / "run.json").read_text())["status"] == "failed"

    resumed = warm_cli.run([sys.executable, "-m", "rlpipe.flows.cli", "resume", str(killed), "--nproc-per-node", "2"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((killed / "run.json").read_text())["status"] == "finished"
    for table in TABLES:
        assert rows(killed, table) == rows(straight, table), table
    a = load_file(straight / "rl" / "checkpoints" / "step_000004" / "model.safetensors")
    b = load_file(killed / "rl" / "checkpoints" / "step_000004" / "model.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, worst
