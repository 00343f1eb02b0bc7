"""The `device` setting on any machine: resolution, the clear error for CUDA without a GPU,
placement and precision of the model (the CUDA runs themselves are in tests/gpu)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.models.device import resolve_device
from rlpipe.models.presets import build_model
from rlpipe.models.varlen_plan import make_flash_views
from rlpipe.tasks.config import validate_config
from rlpipe.tasks.setup import engine_dtype, place_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import build_optimizer, forward_backward, optim_step

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the error path cannot run")


def test_auto_is_the_default_and_resolves_to_what_torch_sees():
    assert validate_config({}).device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CPU", "", "mps"])
def test_config_refuses_an_unknown_device(bad):
    with pytest.raises(ConfigError, match="device"):
        validate_config({"device": bad})
    with pytest.raises(ValueError, match="device must be"):
        resolve_device(bad)


@NO_CUDA
@pytest.mark.parametrize("setting", ["cuda", "cuda:0"])
def test_cuda_without_cuda_names_the_setting(setting):
    with pytest.raises(ValueError, match=rf"device = '{setting}' but CUDA is not available.*set device"):
        resolve_device(setting)


@pytest.mark.slow
@NO_CUDA
def test_cli_fails_with_one_line_before_creating_the_run(tmp_path):
    out = warm_cli.run(
        [sys.executable, "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs/tiny.toml"), "--set", "device=cuda",
         "--set", f"runs_root={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "device = 'cuda' but CUDA is not available" in lines[0], out.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no tracking database


def test_place_model_pure_bf16_keeps_weights_and_optimizer_state_in_bf16():
    model = place_model(build_model("tiny-dense", 64, seed=0), "cpu", "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    optimizer = build_optimizer(model, lr=1e-3)
    seqs = [Sequence(tokens=list(range(1, 20)), weights=[1.0] * 19)]
    forward_backward(model, pack(seqs, 256), nll_loss)
    optim_step(model, optimizer, None)
    assert optimizer.state[next(model.parameters())]["exp_avg"].dtype == torch.bfloat16
    assert engine_dtype(model, bf16_autocast=True) == torch.bfloat16  # its own dtype on the CPU


def test_engine_samples_fp32_on_the_cpu_even_under_autocast():
    model = place_model(build_model("tiny-dense", 64, seed=0), "cpu")
    assert engine_dtype(model, bf16_autocast=True) == torch.float32


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_activation_checkpointing_gives_the_same_gradients(preset):
    seqs = [Sequence(tokens=[(7 * i + j) % 60 + 1 for j in range(n)], weights=[1.0] * n)
            for i, n in enumerate([5, 17, 30, 9])]
    grads, losses = [], []
    for checkpointing in (False, True):
        model = place_model(build_model(preset, 64, seed=0), "cpu", activation_checkpointing=checkpointing)
        losses.append(forward_backward(model, pack(seqs, 256), nll_loss)["loss"])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def _dense_reference(q, k, v, views):
    """Per view: queries attend keys 0 .. a + (len_k - len_q) (bottom-right causal), in fp32."""
    outs = []
    cu_q, cu_k = views.cu_q.tolist(), views.cu_k.tolist()
    keys = k if views.keys is None else k[views.keys]
    values = v if views.keys is None else v[views.keys]
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], keys[cu_k[i]:cu_k[i + 1]], values[cu_k[i]:cu_k[i + 1]]
        lq, lk = len(qi), len(ki)
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = (qi @ ki.T).masked_fill(~visible, float("-inf"))
        outs.append(scores.softmax(-1) @ vi)
    return torch.cat(outs)


def test_flash_views_give_the_attention_of_the_bucket_plan():
    """The varlen-kernel layout (run on CUDA) checked on the CPU against the same maths: shared
    prefixes included, each continuation sees its whole prefix, then its own tokens causally."""
    from rlpipe.models.attention import varlen_attention
    from rlpipe.models.varlen_plan import make_plan

    cu = torch.tensor([0, 6, 9, 13, 17, 20, 27, 30], dtype=torch.int32)
    prefix_index = torch.tensor([-1, 0, 0, 0, -1, -1, 5])
    views = make_flash_views(cu, prefix_index).flash
    assert views.cu_k.tolist() == [0, 6, 15, 25, 35, 38, 45, 55]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 30, 8) for _ in range(3))
    expected = _dense_reference(q[0, 0], k[0, 0], v[0, 0], views)
    buckets = varlen_attention(q, k, v, make_plan(cu, prefix_index=prefix_index), scaling=1.0)
    assert torch.allclose(buckets[0, :, 0], expected, atol=1e-5)
