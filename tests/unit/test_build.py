"""The one builder (tasks/build.py) and the one trainer interface (training/trainer.py): what a
plan builds from a config and a starting point, and that a LocalTrainer step is the functional
step (forward_backward + optim_step) bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rlpipe.tasks.build import StartPoint, build, rl_plan, supervised_plan
from rlpipe.tasks.config import RunConfig
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step
from rlpipe.training.trainer import LocalTrainer, TrainOptions


def _config(**sections) -> RunConfig:
    return RunConfig.model_validate({"device": "cpu", "model": {"bf16_autocast": False}, **sections})


def test_a_supervised_plan_builds_a_local_trainer_and_an_eval_engine_only():
    config = _config()
    built = build(config, supervised_plan(config, "sft"), StartPoint())
    assert isinstance(built.trainer, LocalTrainer) and built.trainer.reference is None
    assert built.model is built.trainer.model and built.start_step == 0 and built.data_state == {}
    assert built.engines == [] and built.eval_engine is not None and built.closing == [built.eval_engine]
    assert built.trainer.options == TrainOptions(
        step=StepOptions(normaliser="token", autocast=False, entropy=True),
        max_grad_norm=config.sft.optim.max_grad_norm)


def test_an_rl_plan_with_a_kl_penalty_keeps_the_starting_weights_frozen_as_the_reference():
    config = _config(rl={"loss": {"kl_coef": 0.1, "ppo_epochs": 2}})
    plan = dataclasses.replace(rl_plan(config), engines="none")
    assert plan.total_steps == config.rl.steps * 2 and plan.options.epochs == 2 and plan.reference
    built = build(config, plan, StartPoint())
    reference = built.trainer.reference
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    for (name, a), b in zip(built.model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.options.epochs = 3


def test_lora_is_off_at_rank_zero_and_otherwise_takes_the_config_section_values():
    config = _config(model={"lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj"]}})
    options = config.model.lora.options()
    assert (options.rank, options.alpha, options.dropout, options.targets) == (4, 8.0, 0.0, ("q_proj",))
    assert _config().model.lora.options() is None


def test_a_local_trainer_step_is_forward_backward_then_optim_step():
    config = _config()
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(tokens=torch.randint(1, 60, (n,), generator=g).tolist(), weights=[1.0] * n,
                     sample_id=f"s{n}") for n in (7, 12, 5)]
    batches = pack(seqs, 16)
    models = [build(config, supervised_plan(config, "sft"), StartPoint()).model for _ in range(2)]
    options = TrainOptions(step=StepOptions(normaliser="sequence", entropy=False), max_grad_norm=0.5)
    trainer = LocalTrainer(models[0], build_optimizer(models[0], lr=1e-2), None, options)
    seen: dict = {}
    got = trainer.step(batches, nll_loss, {}, seen)
    optimizer = build_optimizer(models[1], lr=1e-2)
    want = forward_backward(models[1], batches, nll_loss, StepOptions(normaliser="sequence"))
    want |= optim_step(models[1], optimizer, None, 0.5)
    assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in want.items() if k != "seconds"}
    assert sorted(seen) == sorted(tuple(b.sample_ids) for b in batches)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_engine_auto_is_the_torch_engine_off_cuda_and_vllm_on_a_cuda_model_where_vllm_is_installed(monkeypatch):
    import importlib.util

    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.tasks.build import engine_type, make_engines

    config = _config(engine={"type": "auto"})
    model = build(config, supervised_plan(config, "sft"), StartPoint()).model
    assert engine_type(config, model) == "torch"
    assert [type(engine) for engine in make_engines(config, model)] == [TorchEngine]

    # what engine_type reads of a model placed on a GPU: its parameters' device
    cuda_param = type("P", (), {"device": torch.device("cuda", 0)})()
    on_cuda = type("M", (), {"parameters": lambda self: iter([cuda_param])})()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    assert engine_type(config, on_cuda) == "vllm"
    assert engine_type(_config(engine={"type": "auto"}, train={"parallel": "ddp"}), on_cuda) == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert engine_type(config, on_cuda) == "torch"
    assert engine_type(_config(engine={"type": "torch"}), on_cuda) == "torch"
