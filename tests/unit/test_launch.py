"""`rlpipe run|resume --nproc-per-node`: the launcher's flags, its errors, and sharing a step out
over ranks (no process group needed)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.flows.launch import (
    add_launch_arguments,
    check_launch_arguments,
    failure_message,
    launch_config,
    mark_failed,
    strip_launch_flags,
)
from rlpipe.flows.runner import main_resume, main_run
from rlpipe.tasks.config import validate_config
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.distributed import balanced_budget, share_of
from rlpipe.training.loss_inputs import is_filler
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

CONFIG = "configs/tiny.toml"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "message"), [
    ((), None),
    (("--nproc-per-node", "2"), None),
    (("--nnodes", "2"), "--nnodes needs --nproc-per-node N"),
    (("--rdzv-endpoint", "h:1"), "--rdzv-endpoint needs --nproc-per-node N"),
    (("--nproc-per-node", "0"), "--nproc-per-node must be >= 1, got 0"),
    (("--nproc-per-node", "2", "--nnodes", "2"), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (("--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:29500"),
     "needs --node-rank R (static rendezvous) or --rdzv-id ID"),
    (("--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "--node-rank", "2"),
     "--node-rank must be in 0..1, got 2"),
    (("--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h", "--node-rank", "1"),
     "--rdzv-endpoint must be HOST:PORT, got 'h'"),
    (("--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "--rdzv-id", "job"), None),
])
def test_launch_flags_are_checked_with_a_message_naming_the_flag(argv, message):
    problem = check_launch_arguments(parse(*argv))
    if message is None:
        assert problem is None
    else:
        assert problem is not None and message in problem


def test_launch_config_follows_torchrun():
    alone = launch_config(parse("--nproc-per-node", "2"))
    assert (alone.rdzv_backend, alone.rdzv_endpoint, alone.nproc_per_node, alone.max_restarts) == \
        ("c10d", "localhost:0", 2, 0)
    assert alone.min_nodes == alone.max_nodes == 1 and alone.run_id
    static = launch_config(parse("--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                                 "--rdzv-endpoint", "node0:29500"))
    assert (static.rdzv_backend, static.rdzv_endpoint, static.rdzv_configs["rank"], static.max_nodes) == \
        ("static", "node0:29500", 1, 2)
    elastic = launch_config(parse("--nproc-per-node", "4", "--nnodes", "2", "--rdzv-endpoint", "node0:29500",
                                  "--rdzv-id", "job7"))
    assert (elastic.rdzv_backend, elastic.run_id) == ("c10d", "job7")


def test_each_rank_runs_the_command_without_the_launch_flags():
    argv = [CONFIG, "--nproc-per-node", "2", "--set", "rl.steps=3", "--nnodes=1", "--rdzv-id", "x", "--overwrite"]
    assert strip_launch_flags(argv) == [CONFIG, "--set", "rl.steps=3", "--overwrite"]


def test_the_failure_names_the_rank_that_died_first():
    failures = {0: ProcessFailure(local_rank=0, pid=11, exitcode=143, error_file=""),
                1: ProcessFailure(local_rank=1, pid=12, exitcode=-9, error_file="")}
    message = failure_message(ChildFailedError("rlpipe.flows.cli", failures))
    assert message.startswith("rank 1 (local rank 1, pid 12) killed by SIGKILL")
    assert "then rank 0 (local rank 0, pid 11) exit code 143" in message


def test_a_run_whose_rank_0_was_killed_is_marked_failed(tmp_path):
    for sub, status in (("", "running"), ("sft", "finished"), ("rl", "running")):
        (tmp_path / sub).mkdir(exist_ok=True)
        (tmp_path / sub / "run.json").write_text(json.dumps({"run_id": "r", "status": status}))
    mark_failed(tmp_path)
    statuses = {sub: json.loads((tmp_path / sub / "run.json").read_text())["status"] for sub in ("", "sft", "rl")}
    assert statuses == {"": "failed", "sft": "finished", "rl": "failed"}


def test_cli_refuses_bad_launch_flags(capsys):
    with pytest.raises(SystemExit) as stop:
        main_run([CONFIG, "--nnodes", "2"])
    assert stop.value.code == 2
    assert "--nnodes needs --nproc-per-node N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_resume(["runs/x", "--nproc-per-node", "-1"])
    assert "--nproc-per-node must be >= 1" in capsys.readouterr().err


def test_a_parallel_config_without_a_launch_is_refused_before_anything_runs(tmp_path, capsys):
    code = main_run([CONFIG, "--set", f"runs_root={tmp_path}", "--set", "train.parallel=fsdp2"])
    assert code == 2
    assert "train.parallel = 'fsdp2' needs a distributed launch: add --nproc-per-node N" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


def test_the_colocated_vllm_engine_is_refused_with_data_parallel_training(tmp_path, monkeypatch, capsys):
    for kind in ("ddp", "fsdp2"):
        with pytest.raises(ConfigError, match="engine.type = 'vllm' with train.parallel"):
            validate_config({"train": {"parallel": kind}, "engine": {"type": "vllm"}})
    # `--nproc-per-node` turns 'none' into ddp for the ranks: refused before any rank starts
    monkeypatch.setattr("rlpipe.flows.runner.launch", lambda *a, **k: pytest.fail("launched"))
    code = main_run([CONFIG, "--nproc-per-node", "2", "--set", f"runs_root={tmp_path}", "--set", "engine.type=vllm"])
    assert code == 2
    assert "sample from vLLM servers instead" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()
    # nor may a resume, or torchrun starting `rlpipe run` itself, get there another way
    run_dir = tmp_path / "made"
    run_dir.mkdir()
    config = validate_config({"engine": {"type": "vllm"}, "runs_root": str(tmp_path), "run_name": "made"})
    (run_dir / "config.json").write_text(config.model_dump_json())
    assert main_resume([str(run_dir), "--nproc-per-node", "2"]) == 2
    assert "sample from vLLM servers instead" in capsys.readouterr().err
    from rlpipe.flows.runner import _rank_config
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    assert "sample from vLLM servers instead" in _rank_config(config)


def test_parallel_config_key_is_checked():
    with pytest.raises(ConfigError, match="train.parallel"):
        validate_config({"train": {"parallel": "zero3"}})
    # LoRA and a KL penalty work under data parallelism (tests/integration/test_distributed_extras.py)
    assert validate_config({"train": {"parallel": "ddp"}, "model": {"lora": {"rank": 4}}}).model.lora.rank == 4
    assert validate_config({"train": {"parallel": "fsdp2"}, "rl": {"loss": {"kl_coef": 0.1}}}).rl.loss.kl_coef == 0.1
    assert validate_config({"train": {"parallel": "fsdp2"}}).train.parallel == "fsdp2"
    # a heartbeat a second: a shorter wait would take a rank starved of CPU for lost
    with pytest.raises(ConfigError, match=r"train.peer_timeout_s: must be >= 5"):
        validate_config({"train": {"peer_timeout_s": 1}})


def _sequences(lengths: list[int]) -> list[Sequence]:
    return [Sequence(tokens=list(range(1, n + 1)), weights=[1.0] * n, sample_id=f"s{i}")
            for i, n in enumerate(lengths)]


def test_packed_micro_batches_are_shared_by_tokens_with_fillers():
    batches = pack(_sequences([30, 20, 20, 10, 10, 5]), 30)
    shares = [share_of(batches, rank, 3) for rank in range(3)]
    assert len({len(s) for s in shares}) == 1  # every rank runs as many micro-batches
    real = [[b for b in s if not is_filler(b)] for s in shares]
    assert sorted(id(b) for s in real for b in s) == sorted(id(b) for b in batches)  # each once
    assert sorted(sum(b.n_tokens for b in s) for s in real) == [30, 30, 35]  # 95 tokens, best split
    for share, kept in zip(shares, real, strict=True):
        assert all(float(f.token_weights.abs().sum()) == 0 for f in share[len(kept):])
    assert [len(share_of(batches[:1], rank, 2)) for rank in (0, 1)] == [1, 1]  # fewer batches than ranks


def test_small_steps_get_smaller_micro_batches_so_every_rank_has_work():
    assert balanced_budget(n_tokens=100, longest=30, token_budget=2048, world_size=2) == 50
    assert balanced_budget(n_tokens=100, longest=70, token_budget=2048, world_size=2) == 70
    assert balanced_budget(n_tokens=10_000, longest=30, token_budget=2048, world_size=2) == 2048
    assert balanced_budget(n_tokens=100, longest=30, token_budget=2048, world_size=1) == 100
    assert torch.equal(pack(_sequences([3]), 3)[0].tokens, torch.tensor([1, 2, 3]))


def test_a_launched_rank_trains_with_ddp_by_default_and_each_rank_on_its_own_gpu(monkeypatch):
    from rlpipe.flows.runner import _rank_config

    config = validate_config({})
    assert _rank_config(config) is config  # a single process
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert _rank_config(config).train.parallel == "ddp"  # torchrun on a 'none' config
    assert _rank_config(validate_config({"train": {"parallel": "fsdp2"}})).train.parallel == "fsdp2"
    assert "every rank on one GPU" in _rank_config(validate_config({"device": "cuda:1"}))
