"""The sampler process (engines/process_engine.py): the in-process torch engine's completions,
sampled in a child process from shared-memory weights that each sync refreshes."""

from __future__ import annotations

import re

import pytest
import torch
from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.engines.process_engine import ProcessEngine
from rlpipe.engines.torch_engine import TorchEngine

from tests.unit.test_engine import dense_model, prompts_of
from tests.unit.test_partial_rollouts import load, perturbed


@pytest.mark.slow
def test_the_child_samples_what_the_torch_engine_samples_and_takes_each_sync():
    """Same seed and weights: the same completions as the torch engine in this process; the
    trainer's updates reach the child only through `sync` (with the version it records), and a
    failed request is raised here with the child's reason."""
    trainer = dense_model()
    prompts, params = prompts_of([5, 9, 7]), SamplingParams(n=2, max_new_tokens=10, seed=3, temperature=0.9)
    engine = ProcessEngine(trainer, threads=1)
    try:
        assert isinstance(engine, Engine)
        here = TorchEngine(trainer).generate(prompts, params)
        there = engine.generate(prompts, params)
        assert [[(c.tokens, c.finish_reason) for c in g] for g in there] == \
            [[(c.tokens, c.finish_reason) for c in g] for g in here]
        torch.testing.assert_close(torch.tensor([c.logprobs for g in there for c in g]),
                                   torch.tensor([c.logprobs for g in here for c in g]))
        load(trainer, perturbed(trainer, seed=1))  # an optimizer step: not seen before the sync
        assert [[c.tokens for c in g] for g in engine.generate(prompts, params)] == [[c.tokens for c in g]
                                                                                    for g in here]
        engine.sync(None, 1)
        assert engine.policy_version == 1
        updated = TorchEngine(trainer).generate(prompts, params)
        assert [[c.tokens for c in g] for g in engine.generate(prompts, params)] == [[c.tokens for c in g]
                                                                                    for g in updated]
        try:
            engine.generate([[10**6]], params)
        except RuntimeError as error:
            assert "the sampler process failed: ValueError: prompts[0] has token ids outside" in str(error)
        else:
            raise AssertionError("a bad prompt was sampled")
    finally:
        engine.close()
    assert not engine._process.is_alive()


@pytest.mark.parametrize(("config", "message"), [
    ({"engine": {"producer": "process"}},
     "engine.producer = 'process' is the sampler of the in-process torch engine for async RL: it needs "
     "engine.type = 'torch' and rl.off_policy.max_steps >= 1 (got engine.type = 'torch', rl.off_policy.max_steps = 0)"),
    ({"engine": {"producer": "process"}, "rl": {"off_policy": {"max_steps": 1, "partial_rollouts": True}}},
     "engine.producer = 'process' with rl.off_policy.partial_rollouts is not supported"),
    ({"engine": {"producer": "fork"}}, "engine.producer"),
])
def test_a_producer_the_run_cannot_use_is_refused_naming_the_field(config, message):
    from rlpipe.core.config import ConfigError
    from rlpipe.tasks.config import validate_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(config)
    assert validate_config({"engine": {"producer": "process"}, "rl": {"off_policy": {"max_steps": 2}}}).engine.producer \
        == "process"
