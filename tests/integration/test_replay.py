"""`rlpipe replay RUN_DIR --step N` on tiny RL runs: bit for bit on CPU fp32, from the checkpoint
just before the step or replaying forward from an earlier one (async, PPO epochs and partial
batches included), and a non-zero exit naming what differs when a stored value was tampered with."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.test_rl_loop_regression import config_dict, sft_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rl_run(sft_checkpoint, tmp_path_factory) -> Path:  # noqa: F811
    from rlpipe.flows.rl import run_rl
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    config = validate_config(config_dict(tmp_path_factory.mktemp("replay"), "rl",
                                         {"steps": 4, "checkpoint_every": 2}))
    run_rl(config, start_checkpoint=sft_checkpoint)
    return config.run_dir / "rl"


def replay(capsys, *args: str) -> tuple[int, str]:
    from rlpipe.flows.cli import main

    code = main(["replay", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_step_with_a_checkpoint_before_it_replays_bit_for_bit(rl_run, capsys):
    code, out = replay(capsys, str(rl_run), "--step", "3")
    assert code == 0, out
    first = out.splitlines()[0]
    assert first.endswith(f"trainer state from {rl_run / 'checkpoints' / 'step_000002'}"), first
    assert "OK: step 3 matches bit for bit" in out
    assert out.count(" yes") == 4  # loss, grad_norm, lr, trainer_logprobs


def test_a_step_without_one_replays_forward_from_the_nearest_earlier(rl_run, sft_checkpoint, capsys):  # noqa: F811
    code, out = replay(capsys, str(rl_run), "--step", "4")
    assert code == 0, out
    assert "replaying steps 3..4 forward" in out and out.count(" yes") == 8
    code, out = replay(capsys, str(rl_run), "--step", "2", "--start", sft_checkpoint)
    assert code == 0 and "replaying steps 1..2 forward from the starting weights" in out, out


def test_a_tampered_stored_value_is_named(rl_run, tmp_path, capsys):
    from rlpipe.storage.writer import read_table, write_table

    copy = tmp_path / "rl"
    shutil.copytree(rl_run, copy)
    rows = read_table(copy, "train_steps", 3).to_pylist()
    rows[0]["loss"] += 1e-12
    write_table(copy, "train_steps", 3, rows)
    code, out = replay(capsys, str(copy), "--step", "3")
    assert code == 1 and "MISMATCH: step 3: loss" in out, out

    rows[0]["loss"] -= 1e-12
    write_table(copy, "train_steps", 3, rows)
    tokens = read_table(copy, "train_tokens", 3).to_pylist()
    t = next(i for i, s in enumerate(tokens[0]["token_sample"]) if s >= 0)
    tokens[0]["trainer_logprobs"][t] += 1e-3
    write_table(copy, "train_tokens", 3, tokens)
    code, out = replay(capsys, str(copy), "--step", "3")
    assert code == 1 and "MISMATCH: step 3: trainer_logprobs" in out and "max |diff| 0.001" in out, out


VARIANTS = {
    # generation one step ahead of training, with the off-policy TIS and sequence mask, and a KL penalty
    "async_kl": {"off_policy": {"max_steps": 1, "sequence_mask": 0.5}, "loss": {"kl_coef": 0.05}},
    # two optimizer steps per batch (the optimizer state evolves within the step), partial batches
    "ppo_partial": {"loss": {"type": "ppo_clip", "ppo_epochs": 2},
                    "buffer": {"partial_batches": True, "max_attempts": 1, "oversample_factor": 1.0}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_async_kl_ppo_epochs_and_partial_batches_replay_forward(variant, sft_checkpoint, tmp_path, capsys):  # noqa: F811
    from rlpipe.flows.rl import run_rl
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    config = validate_config(config_dict(tmp_path, variant, {"steps": 3, "checkpoint_every": 0,
                                                             **VARIANTS[variant]}))
    run_rl(config, start_checkpoint=sft_checkpoint)
    code, out = replay(capsys, str(config.run_dir / "rl"), "--step", "3", "--start", sft_checkpoint)
    assert code == 0 and out.count(" yes") == 12, out
