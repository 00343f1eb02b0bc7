"""Two `rlpipe serve` processes behind HttpEngines: generate across both, sync a new checkpoint
to both in parallel, match the trainer's log-probs after the sync, and fail loudly when one dies.

All traffic stays on 127.0.0.1; every wait is bounded; the servers are killed in a finally."""

from __future__ import annotations

import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.http import EngineUnavailableError, HttpEngine, HttpOptions
from rlpipe.engines.serve_process import serve_url, start_serve, stop_processes
from rlpipe.models.loading import load_model
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.batch import Sequence, pack_one
from rlpipe.training.checkpoint_io import save_checkpoint
from rlpipe.training.logprobs import token_logprobs

from tests import warm_cli

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 120.0


def recompute(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs of `completion` after `prompt` (packed forward, chunked head)."""
    seq = Sequence(tokens=prompt + completion, weights=[1.0] * (len(prompt) + len(completion)))
    with torch.no_grad():
        logprobs, _ = token_logprobs(model.eval(), pack_one([seq]), temperature=temperature)
    return logprobs[len(prompt) - 1 : len(prompt) + len(completion) - 1]


def test_two_servers_generate_sync_and_fail_loudly(tmp_path):
    tok = build_tokenizer()
    first = save_checkpoint(tmp_path, 0, build_model("tiny-dense", vocab_size=len(tok), seed=0), tok)
    second = save_checkpoint(tmp_path, 1, build_model("tiny-dense", vocab_size=len(tok), seed=1), tok)
    allow = tmp_path / "checkpoints"
    procs: list[subprocess.Popen] = []
    engines: list[HttpEngine] = []
    try:
        for _ in range(2):
            procs.append(start_serve(first, "--allow-root", str(allow), token="tok", popen=warm_cli.Popen))
        urls = []
        for proc in procs:  # the ready line comes once the port accepts: a connection at once succeeds
            urls.append(serve_url(proc, START_TIMEOUT_S))
            host, port = urls[-1].removeprefix("http://").rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5).close()
        assert all(url.startswith("http://127.0.0.1:") for url in urls), urls
        engines = [HttpEngine(u, HttpOptions(timeout_s=60, retries=2, api_token="tok", backoff_s=0.05)) for u in urls]
        assert [e.health()["policy_version"] for e in engines] == [0, 0]

        prompts = [tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a, b in
                   [(1, 2), (30, 4), (5, 66), (7, 8)]]
        params = SamplingParams(n=2, max_new_tokens=8, temperature=0.9, seed=3)
        with ThreadPoolExecutor(max_workers=2) as pool:
            halves = list(pool.map(lambda i: engines[i].generate(prompts[2 * i : 2 * i + 2], params), [0, 1]))
        groups = halves[0] + halves[1]
        assert len(groups) == 4 and all(len(g) == 2 and len(g[0].tokens) == 8 for g in groups)
        # both servers serve the same weights: the same request gives the same answer
        assert engines[0].generate(prompts[:1], params) == engines[1].generate(prompts[:1], params)

        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda e: e.sync(str(second), 1), engines))
        assert [e.health()["policy_version"] for e in engines] == [1, 1]
        trainer = load_model(second)
        for engine in engines:
            for temperature in (1.0, 0.7):
                c = engine.generate(prompts[:1], SamplingParams(max_new_tokens=10, temperature=temperature,
                                                                seed=8))[0][0]
                expected = recompute(trainer, prompts[0], c.tokens, temperature)
                assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), \
                    (c.logprobs, expected.tolist())

        procs[1].kill()
        procs[1].wait(timeout=30)
        start = time.monotonic()
        with pytest.raises(EngineUnavailableError, match=urls[1].replace(".", r"\.")):
            engines[1].generate(prompts, params)
        assert time.monotonic() - start < 30
        assert engines[0].generate(prompts[:1], params)[0]  # the other server still answers
    finally:
        for engine in engines:
            engine.close()
        stop_processes(procs)
