"""`optim.optimizer` (training/step.py `build_optimizer`): torchao's AdamW with bf16 stochastic
rounding keeps the small updates plain bf16 AdamW rounds away, and a config that asks for it where
it cannot run is refused in one line before the run writes anything."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.training.step import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[2]


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


def _moved(kind: str, steps: int = 12, lr: float = 1e-6) -> tuple[float, torch.nn.Module]:
    """Mean movement of a bf16 weight under a constant gradient of 1 (AdamW's update is then lr a step)."""
    start = (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    model = _Linear(start.clone())
    optimizer = build_optimizer(model, lr=lr, kind=kind)
    scheduler = build_scheduler(optimizer, warmup_steps=0, total_steps=steps, min_lr_ratio=1.0)
    for _ in range(steps):
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
        scheduler.step()
    return float((model.weight.detach().float() - start.float()).mean()), optimizer


def test_stochastic_rounding_keeps_the_updates_plain_bf16_adamw_rounds_away():
    pytest.importorskip("torchao", reason="optim.optimizer = 'adamw_bf16_sr' needs torchao (pip install 'rlpipe[lean]')")
    want = -12 * 1e-6
    plain, _ = _moved("adamw")
    rounded, optimizer = _moved("adamw_bf16_sr")
    assert abs(plain) < 0.2 * abs(want)  # round-to-nearest drops most of them
    assert rounded == pytest.approx(want, rel=0.1)  # exact in expectation over 4,096 weights
    # the schedule drives it (torchao keeps lr as a tensor the scheduler fills), and its state saves as plain tensors
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(1e-6)
    state = optimizer.state_dict()["state"][0]
    assert state["exp_avg"].dtype == torch.bfloat16 and type(state["exp_avg"]) is torch.Tensor
    saved = io.BytesIO()  # a checkpoint's optimizer.pt is read back with weights_only=True
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    model = _Linear(torch.zeros(64, 64, dtype=torch.bfloat16))
    resumed = build_optimizer(model, lr=1e-6, kind="adamw_bf16_sr")
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    model.weight.grad = torch.ones_like(model.weight)
    resumed.step()
    assert float(resumed.state[model.weight]["step"]) == 13 and model.weight.detach().float().mean() < 0


def test_stochastic_rounding_refuses_fp32_weights_and_unknown_kinds_in_one_line():
    model = _Linear(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"rounds bf16 weights; these are \['float32'\] \(set model.weights_dtype"):
        build_optimizer(model, lr=1e-3, kind="adamw_bf16_sr")
    with pytest.raises(ValueError, match=r"optim.optimizer must be one of \('adamw', 'adamw_bf16_sr'\); got 'sgd'"):
        build_optimizer(model, lr=1e-3, kind="sgd")


def test_a_config_asking_for_it_where_it_cannot_run_is_refused_before_the_run(tmp_path, monkeypatch):
    from rlpipe.flows.common import resolve_config

    find_spec = importlib.util.find_spec
    with pytest.raises(ConfigError, match=r"^rl\.optim\.optimizer: 'adamw_bf16_sr' rounds bf16 weights and "
                                          r"model\.weights_dtype is 'float32'"):
        resolve_config(str(ROOT / "configs" / "tiny.toml"), [f"runs_root={tmp_path}", "flow=rl",
                                                             "rl.optim.optimizer=adamw_bf16_sr"], None)
    with pytest.raises(ConfigError, match=r"^rl\.optim\.optimizer: 'adamw_bf16_sr' needs torchao, which is not installed"):
        with monkeypatch.context() as patched:
            patched.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
            resolve_config(str(ROOT / "configs" / "tiny.toml"), [f"runs_root={tmp_path}", "flow=rl",
                                                                 "model.weights_dtype=bfloat16",
                                                                 "rl.optim.optimizer=adamw_bf16_sr"], None)
    with pytest.raises(ConfigError, match=r"optim\.optimizer"):
        resolve_config(str(ROOT / "configs" / "tiny.toml"), [f"runs_root={tmp_path}", "rl.optim.optimizer=sgd"], None)
