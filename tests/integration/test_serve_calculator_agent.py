"""The calculator tool-use agent of configs/multiturn.toml (its SFT phase, shortened, with a
teacher that always calls the tool), served by `rlpipe serve --tool-call-parser calculator` and
driven by the `openai` client through the tool loop: its calls come back as `tool_calls`, the
client runs the tool, the agent answers; the conversation equals the episode the multi-turn
rollout loop (envs/multiturn.py) runs in process with the same greedy policy."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.serve_process import serve_url, start_serve, stop_processes
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.envs.calculator import TOOL, CalculatorConfig, CalculatorEnv, run_tool
from rlpipe.envs.multiturn import run_episodes
from rlpipe.tasks.setup import stop_token_ids
from rlpipe.training.checkpoint_io import load_checkpoint

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
PROBLEMS = 6


def train_agent(tmp_path: Path, monkeypatch) -> Path:
    from rlpipe.flows.sft import sft_flow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) lands in tmp too
    config = tomllib.loads((ROOT / "configs" / "multiturn.toml").read_text())
    config |= {"runs_root": str(tmp_path / "runs"), "flow": "sft"}
    config.pop("rl")
    config["model"]["overrides"] = {"num_hidden_layers": 2}
    config["task"]["options"] |= {"teacher_tool_rate": 1.0}
    config["task"]["eval_examples"] = 8
    config["sft"] |= {"steps": 100, "examples": 3200, "checkpoint_every": 0}
    return Path(sft_flow(config=config)["checkpoint"])


def chat_episode(api, problem: str) -> list[dict]:
    """The tool loop an OpenAI-client agent runs: call the model until it answers."""
    messages = [{"role": "user", "content": problem}]
    for _ in range(3):
        out = api.chat.completions.create(model="calc-agent", messages=messages, tools=[TOOL], temperature=0,
                                          max_tokens=16)
        choice = out.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return messages
        (call,) = choice.message.tool_calls
        assert call.function.name == "calc"
        expression = json.loads(call.function.arguments)["expression"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(expression)})
    return messages


def as_text(messages: list[dict]) -> list[tuple[str, str]]:
    """(role, what the model or tool wrote): a tool call as the agent's own "calc ..." turn."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") or []
        if calls:
            out.append(("assistant", "calc " + json.loads(calls[0]["function"]["arguments"])["expression"]))
        else:
            out.append((message["role"], message["content"]))
    return out


def test_the_trained_calculator_agent_is_served_with_its_tool(tmp_path, monkeypatch, prefect_in_process):
    checkpoint = train_agent(tmp_path, monkeypatch)
    env = CalculatorEnv(CalculatorConfig(max_turns=3))
    examples = list(env.examples("eval"))[:PROBLEMS]
    loaded = load_checkpoint(checkpoint, restore_rng=False)
    episodes = run_episodes(TorchEngine(loaded.model.eval()), loaded.tokenizer, env, examples,
                            SamplingParams(max_new_tokens=16, greedy=True,
                                                           stop_token_ids=stop_token_ids(loaded.tokenizer)), max_turns=3, max_tokens=256)
    proc = start_serve(checkpoint, "--served-model-name", "calc-agent", "--tool-call-parser", "calculator",
                       popen=warm_cli.Popen)
    try:
        api = openai.OpenAI(base_url=serve_url(proc) + "/v1", api_key="none", max_retries=5)
        served = [chat_episode(api, example.prompt) for example in examples]
    finally:
        stop_processes([proc])
    calls = correct = 0
    for example, (episode,), messages in zip(examples, episodes, served, strict=True):
        assert as_text(messages) == [(m["role"], m["content"]) for m in episode.messages], (messages, episode.messages)
        calls += any(m.get("tool_calls") for m in messages)
        transcript = [{"role": role, "content": text} for role, text in as_text(messages)]
        correct += env.reward(example, transcript).reward
    assert calls == PROBLEMS  # the agent calls its tool through the server every time
    assert correct >= PROBLEMS // 2, correct
