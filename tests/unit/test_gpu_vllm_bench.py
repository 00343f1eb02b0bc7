"""benchmarks/gpu_vllm.py's bookkeeping: the weight sync is split from vLLM's wake-up whichever
side wakes where, and the report renders both sides and a failed one."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from benchmarks.gpu_report import render
from benchmarks.gpu_vllm import render_rl_vs_trl_vllm, sync_seconds, time_calls, trl_side


def fake_vllm(wake_s: float, load_s: float, wake_inside_load: bool):
    llm = SimpleNamespace(wake_up=lambda tags=None: time.sleep(wake_s))

    def load():  # TRL's sync_weights wakes the weights itself; rlpipe wakes, then pushes
        if wake_inside_load:
            llm.wake_up(tags=["weights"])
        time.sleep(load_s)

    return llm, SimpleNamespace(load=load)


def test_weight_load_is_timed_apart_from_the_wake_up_inside_or_before_it():
    cpu = torch.device("cpu")
    for inside in (True, False):
        llm, side = fake_vllm(wake_s=0.2, load_s=0.05, wake_inside_load=inside)
        calls: list[dict] = []
        time_calls(side, "load", cpu, calls)
        time_calls(llm, "wake_up", cpu, calls)
        for _ in range(2):
            if not inside:
                llm.wake_up(tags=["weights"])
            side.load()
            llm.wake_up(tags=["kv_cache"])  # not a weight wake-up: left out
        sync = sync_seconds(calls, "load")
        assert len(sync["load_s"]) == 2 and len(sync["wake_s"]) == 2
        assert all(0.05 <= s < 0.2 for s in sync["load_s"]), sync  # >= 0.25 if the wake were counted
        assert all(s >= 0.2 for s in sync["wake_s"]), sync


def test_the_comparison_renders_ratios_and_a_failed_side():
    result = {"model": "qwen3-0.6b preset", "prompts": 32, "group": 8, "max_new_tokens": 128, "steps": 5,
              "vllm_gpu_memory_utilization": 0.3,
              "trl": {"seconds_per_step": 4.0, "load_s_median": 0.18, "wake_s_median": 0.05},
              "rlpipe": {"seconds_per_step": 1.8, "tokens_per_second": 20000.0, "load_s_median": 0.03,
                         "wake_s_median": 0.04},
              "rlpipe_compiled": {"error": "exit 1: Traceback ... CUDA out of memory"},
              "rlpipe_step_time_ratio": 0.45}
    text = "\n".join(render_rl_vs_trl_vllm(result))
    assert "| TRL (`use_vllm`, colocate) | 4.00 | - | 0.18 | 0.05 | - |" in text
    assert "| 1.80 | 20,000 | 0.03 | 0.04 | 0.45x |" in text
    assert "failed:" in text and "CUDA out of memory" in text
    assert "## One RL step: rlpipe vs TRL GRPOTrainer, both with vLLM colocated" in render(
        {"device": "H100", "rl_vs_trl_vllm": result})


def test_the_trl_side_takes_vllms_torch_sampler_before_trl_loads_where_flashinfer_is_missing(monkeypatch):
    """TRL's own vLLM gets the engine's FlashInfer decision (engines/vllm_lifecycle.py): the variable
    is set when `import trl` starts (stopped there: no TRL run on the CPU)."""
    import importlib.util
    import os
    import sys

    from rlpipe.engines import vllm_lifecycle

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    monkeypatch.setattr(vllm_lifecycle, "_said", {vllm_lifecycle.FLASHINFER_SAMPLER})
    monkeypatch.delenv(vllm_lifecycle.FLASHINFER_SAMPLER, raising=False)
    monkeypatch.delitem(sys.modules, "trl", raising=False)
    seen = []

    class StopAtTrl:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "trl":
                seen.append(os.environ.get(vllm_lifecycle.FLASHINFER_SAMPLER))
                raise ImportError("stopped at import trl")
            return None

    monkeypatch.setattr(sys, "meta_path", [StopAtTrl, *sys.meta_path])
    try:
        trl_side(None, None, None)
    except ImportError as stopped:
        assert "stopped at import trl" in str(stopped)
    assert seen == ["0"]
