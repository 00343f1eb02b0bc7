"""Partial rollouts: a weight update lands between two decode steps of a generation in flight,
the unfinished completions go on with the new weights, and each token records (and is scored
by) the version that sampled it."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace

import pytest
import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.snapshot import SnapshotEngine
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.rollouts.generation import version_span
from rlpipe.rollouts.options import rollout_options
from rlpipe.rollouts.records import Rollout

from tests.unit.test_engine import dense_model, llama_model, prompts_of, recompute_logprobs

MODELS = {"dense": dense_model, "llama": llama_model}


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New weights for `model`: each parameter moved by noise (the next policy version)."""
    g = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.3 * p.detach().std() * torch.randn(p.shape, generator=g)
            for name, p in model.named_parameters()}


def load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def assert_scored_by_their_versions(completions, prompts, weights_by_version, model, temperature):
    """Each token's log-prob is its own version's: recomputed by a full forward of that version."""
    for prompt, group in zip(prompts, completions, strict=True):
        for completion in group:
            for version in set(completion.versions):
                load(model, weights_by_version[version])
                expected = recompute_logprobs(model, prompt, completion, temperature)
                mine = torch.tensor(completion.versions) == version
                got = torch.tensor(completion.logprobs)
                torch.testing.assert_close(got[mine], expected[mine], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "llama"])
def test_weights_swapped_mid_generation_continue_from_the_new_version(kind):
    """The fast Qwen3 path and the HF fallback: a swap after the 5th token (a sync arriving then),
    every completion's first 5 tokens are version 0's and the rest version 1's, each log-prob
    that of the weights that sampled the token (the cache was recomputed, not reused)."""
    model = MODELS[kind]()
    v0 = {name: p.detach().clone() for name, p in model.named_parameters()}
    v1 = perturbed(model, seed=3)
    engine = TorchEngine(model, max_batch_size=4)  # 3 prompts x 2 = two chunks: the second starts at v1
    calls = []

    def pause():
        calls.append(1)
        if len(calls) == 5:
            load(model, v1)
            engine.sync(None, 1)

    prompts = prompts_of([5, 9, 7])
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.8, seed=7)
    out = engine.generate(prompts, params, pause=pause)
    versions = [c.versions for group in out for c in group]
    assert versions.count([0] * 5 + [1] * 7) == 4  # the first chunk: interrupted after its 5th token
    assert versions.count([1] * 12) == 2  # the second chunk started from the new weights
    assert_scored_by_their_versions(out, prompts, {0: v0, 1: v1}, model, params.temperature)


def test_a_swap_after_some_sequences_stopped_continues_the_others_exactly():
    """Stop tokens end some sequences before the swap (the batch is compacted around them): the
    others go on from the new weights, every token scored by the version that sampled it."""
    model = dense_model(scale=2.0)
    v0 = {name: p.detach().clone() for name, p in model.named_parameters()}
    v1 = perturbed(model, seed=4)
    engine = TorchEngine(model)
    calls = []

    def pause():
        calls.append(1)
        if len(calls) == 4:
            load(model, v1)
            engine.sync(None, 1)

    prompts = prompts_of([6, 4, 8, 5], seed=2)
    params = SamplingParams(n=4, max_new_tokens=10, seed=11, stop_token_ids=tuple(range(0, 64, 3)))
    out = engine.generate(prompts, params, pause=pause)
    completions = [c for g in out for c in g]
    assert any(c.finish_reason == "stop" and len(c.tokens) <= 4 for c in completions)  # ended before it
    assert any(c.versions[0] == 0 and c.versions[-1] == 1 for c in completions)  # spans the swap
    assert all(c.versions == ([0] * 4 + [1] * 6)[:len(c.tokens)] for c in completions)
    assert_scored_by_their_versions(out, prompts, {0: v0, 1: v1}, model, params.temperature)


def test_without_a_swap_the_completions_are_unchanged():
    """A pause that changes nothing leaves sampling exactly as without the hook, every token at
    the engine's version."""
    model = dense_model()
    engine = TorchEngine(model, policy_version=4)
    prompts, params = prompts_of([6, 4]), SamplingParams(n=3, max_new_tokens=10, seed=1)
    plain = engine.generate(prompts, params)
    paused = engine.generate(prompts, params, pause=lambda: None)
    assert [[c.tokens for c in g] for g in paused] == [[c.tokens for c in g] for g in plain]
    assert all(c.versions == [4] * len(c.tokens) for g in paused for c in g)
    assert all(c.versions is None for g in plain for c in g)


def test_snapshot_sync_lands_inside_a_generate_in_flight():
    """SnapshotEngine(partial=True): a sync from the trainer's thread does not wait for the whole
    generate; the sampling thread lets it in at its next decode step and goes on from the new
    snapshot. Without partial, the same sync waits for the generate to finish."""
    trainer = dense_model()
    v0 = {name: p.detach().clone() for name, p in trainer.named_parameters()}
    v1 = perturbed(trainer, seed=5)
    prompts, params = prompts_of([5, 8]), SamplingParams(n=2, max_new_tokens=40, seed=2)

    def run(partial: bool):
        load(trainer, v0)
        engine = SnapshotEngine(trainer, partial=partial)
        sampling = threading.Event()
        original = engine._engine.generate

        def generate(*args, **kwargs):  # signal once the sampling thread holds the engine
            sampling.set()
            return original(*args, **kwargs)

        engine._engine.generate = generate
        if partial:  # hold the first decode step until the sync is waiting: it lands right there
            pause, calls = engine._pause, []

            def first_waits() -> None:
                deadline = time.monotonic() + 10
                while not calls and not engine._syncs_waiting and time.monotonic() < deadline:
                    time.sleep(0.001)
                calls.append(1)
                pause()

            engine._pause = first_waits
        result = {}
        thread = threading.Thread(target=lambda: result.update(out=engine.generate(prompts, params)))
        thread.start()
        assert sampling.wait(10)
        load(trainer, v1)  # the optimizer step
        engine.sync(None, 1)
        thread.join(10)
        return result["out"], engine

    out, engine = run(partial=True)
    assert engine.policy_version == 1
    assert all(c.versions == [0] + [1] * 39 for g in out for c in g)
    assert_scored_by_their_versions(out, prompts, {0: v0, 1: v1}, dense_model(), 1.0)
    plain, _ = run(partial=False)
    assert all(c.versions is None for g in plain for c in g)  # one version sampled it all: v0's
    for prompt, group in zip(prompts, plain, strict=True):
        load(trainer, v0)
        for c in group:
            torch.testing.assert_close(torch.tensor(c.logprobs), recompute_logprobs(trainer, prompt, c, 1.0),
                                       atol=2e-4, rtol=1e-4)


def test_version_span_and_rollout_defaults():
    """first/last policy versions: the tokens' oldest and newest, the round's version when the
    engine does not tell; a rollout row without them (an older table) reads back with them equal
    to its policy_version."""
    assert version_span([2, 2, 3, 3], 1) == {"first_policy_version": 2, "last_policy_version": 3}
    assert version_span(None, 4) == {"first_policy_version": 4, "last_policy_version": 4}
    assert version_span([], 4) == {"first_policy_version": 4, "last_policy_version": 4}
    row = Rollout(run_id="r", step=1, policy_version=5, env="e", example_id="x", group_id="g", sample_id="s",
                  attempt=1, prompt_tokens=[1], completion_tokens=[2], completion_logprobs=[-0.1],
                  finish_reason="stop", prompt_text="a", completion_text="b", n_prompt_tokens=1,
                  n_completion_tokens=1).row()
    assert (row["first_policy_version"], row["last_policy_version"]) == (5, 5)
    old = {k: v for k, v in row.items() if not k.endswith("_policy_version") or k == "policy_version"}
    assert Rollout.from_row(old).last_policy_version == 5


@pytest.mark.parametrize(("config", "message"), [
    ({"rl": {"off_policy": {"partial_rollouts": True}}}, "rl.off_policy.partial_rollouts needs rl.off_policy.max_steps >= 1"),
    ({"rl": {"off_policy": {"partial_rollouts": True, "max_steps": 1}}, "engine": {"type": "vllm"}},
     "rl.off_policy.partial_rollouts needs the in-process engine (engine.type = 'torch' or 'auto'), got engine.type = 'vllm'"),
])
def test_a_config_partial_rollouts_cannot_serve_is_refused_naming_the_field(config, message):
    from rlpipe.core.config import ConfigError
    from rlpipe.tasks.config import validate_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(config)
    ok = validate_config({"rl": {"off_policy": {"partial_rollouts": True, "max_steps": 1}}})
    assert rollout_options(ok.rl).partial_rollouts and not rollout_options(validate_config({}).rl).partial_rollouts


def test_an_episode_spans_the_versions_of_its_model_turns():
    """Multi-turn: an episode whose turns were sampled by versions 0 then 1 (a sync between or
    inside them) records first 0 and last 1; the round's version stays its policy_version."""
    from rlpipe.envs.base import Example
    from rlpipe.envs.calculator import CalculatorConfig, CalculatorEnv
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.rollouts.generation import GenerateOptions, SampleRound, generate_rollouts

    from tests.scripted_engine import ScriptedEngine
    from tests.unit.test_multiturn import _calc_script

    class Versioned(ScriptedEngine):
        def generate(self, prompts, params):
            version = len(self.calls)  # each turn one version newer
            return [[replace(c, versions=[version] * len(c.tokens)) for c in g] for g in super().generate(prompts, params)]

    tok = build_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = Versioned(_calc_script(tok, ["calc 12*34", "ans 408"]), end)
    rows = generate_rollouts(engine, tok, CalculatorEnv(CalculatorConfig(eval_size=10)),
                             [Example("calculator", "0", "12*34", 408)],
                             GenerateOptions(SamplingParams(n=2), max_context=512),
                             SampleRound(run_id="r", step=1, attempt=1, policy_version=0))
    assert [(r.n_turns, r.policy_version, r.first_policy_version, r.last_policy_version) for r in rows] == \
        [(2, 0, 0, 1)] * 2
