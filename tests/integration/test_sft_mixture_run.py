"""An SFT mixture through `rlpipe run`, killed (SIGKILL) after its step-2 checkpoint and resumed:
`[[sft.data]]` given on the command line, and every step, before the kill and after the resume,
trains on the conversations that the seeded mixture and the step's draw name (the resumed run
rebuilds them from its config.json): its `train_steps.tokens` are theirs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_each_sft_step_trains_on_its_share_of_the_mixture_across_a_kill_and_resume(tmp_path, prefect_api_url):
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.storage.catalog import connect
    from rlpipe.tasks.config import load_config
    from rlpipe.tasks.setup import sft_data
    from rlpipe.tasks.supervised_steps import step_indices

    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                                        {"role": "assistant", "content": f"{i}"}]})
                               for i in range(10)) + "\n")
    pq.write_table(pa.Table.from_pylist([{"q": f"{i}+1=", "a": str(i + 1)} for i in range(30)]),
                   tmp_path / "sums.parquet")
    mixture = (f'[{{path = "{chats}", weight = 1}}, '
               f'{{path = "{tmp_path / "sums.parquet"}", prompt_column = "q", response_column = "a", weight = 3}}]')
    overrides = [f"sft.data={mixture}", f"runs_root={tmp_path / 'runs'}", "run_name=mix", "threads=1",
                 "sft.steps=6", "sft.sequences_per_step=8", "sft.examples=40", "sft.eval_every=0",
                 "sft.checkpoint_every=2", "task.eval_examples=4", "tracking.report=false"]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               RLPIPE_PROGRESS="0", PREFECT_API_URL=prefect_api_url, PREFECT_API_REQUEST_TIMEOUT="120")
    args = [arg for text in overrides for arg in ("--set", text)]
    run = tmp_path / "runs" / "mix"
    trigger = run / "tables" / "checkpoints" / "step=2"
    process = warm_cli.Popen([sys.executable, "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs" / "sft.toml"),
                                *args], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=(tmp_path / "run.log").open("w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not trigger.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before its step-2 checkpoint: " + (tmp_path / "run.log").read_text()[-2000:]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    done = warm_cli.run([sys.executable, "-m", "rlpipe.flows.cli", "resume", str(run)], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((run / "run.json").read_text())["status"] == "finished"

    config = load_config(ROOT / "configs" / "sft.toml", overrides)
    assert json.loads((run / "config.json").read_text())["sft"]["data"][1]["weight"] == 3
    tokenizer = build_tokenizer()
    sequences = sft_data(None, tokenizer, config.sft.examples, config.seed, max_len=2048, sources=config.sft.data)
    texts = [tokenizer.decode(seq.tokens) for seq in sequences]
    assert sum("<|im_start|>user\nsay" in text for text in texts) == 10  # weight 1 of 4
    con = connect([run])
    trained = dict(con.execute("select step, tokens from train_steps order by step").fetchall())
    assert sorted(trained) == [1, 2, 3, 4, 5, 6]
    for step, tokens in trained.items():  # the step's packed tokens are those of its drawn conversations
        chosen, _ = step_indices(len(sequences), config.sft.sequences_per_step, step, config.seed)
        assert tokens == sum(len(sequences[i].tokens) for i in chosen), step
    assert len({sum(len(sequences[i].tokens) for i in step_indices(len(sequences), 8, step, seed)[0])
                for step in range(1, 7) for seed in (0, 1, 2)}) > 1  # the check tells draws apart
