"""VllmEngine: a clear error where it cannot run, its configuration and weight names (on a CUDA
machine with vLLM, log-probs and weight updates: tests/gpu/test_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from rlpipe.engines.vllm_lifecycle import vllm_unavailable_reason, write_vllm_config
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer

REASON = vllm_unavailable_reason()


def test_import_is_lazy():
    code = "import sys, rlpipe.engines.vllm_engine; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(REASON is None, reason="vLLM can run here: the error path cannot")
def test_constructor_says_what_is_missing():
    from rlpipe.engines.vllm_engine import VllmEngine

    model = build_model("tiny-dense", vocab_size=len(build_tokenizer()))
    with pytest.raises(RuntimeError, match="CUDA GPU|vllm extra"):
        VllmEngine(model)


def test_config_for_vllm_is_portable(tmp_path):
    model = build_model("tiny-dense", vocab_size=len(build_tokenizer()))
    config = write_vllm_config(model, tmp_path).read_text()
    assert "Qwen3ForCausalLM" in config and "varlen" not in config.lower()


def test_config_keys_reach_the_vllm_engine(monkeypatch):
    from rlpipe.tasks.build import make_engines
    from rlpipe.tasks.config import RunConfig

    built = []
    monkeypatch.setattr("rlpipe.engines.vllm_engine.VllmEngine", lambda model, **kw: built.append(kw) or kw)
    model = build_model("tiny-dense", vocab_size=len(build_tokenizer()))
    config = RunConfig.model_validate(
        {"device": "cpu", "engine": {"type": "vllm", "gpu_memory_utilization": 0.55, "max_model_len": 2048,
                                     "cuda_graphs": True}})
    make_engines(config, model)
    make_engines(RunConfig.model_validate({"device": "cpu", "engine": {"type": "vllm"}}), model)
    # async RL: vLLM stays awake (a wake-up would push the trainer's tensors mid-step)
    make_engines(RunConfig.model_validate(
        {"device": "cpu", "engine": {"type": "vllm"}, "rl": {"off_policy": {"max_steps": 1}}}), model)
    # a CPU model samples in its own float32; on CUDA with bf16 autocast it is "bfloat16"
    common = {"dtype": "float32", "gpu_memory_utilization": 0.3, "max_model_len": None, "enforce_eager": True}
    assert built == [
        {**common, "gpu_memory_utilization": 0.55, "max_model_len": 2048, "enforce_eager": False,
         "sleep_between_calls": True},
        {**common, "sleep_between_calls": True},
        {**common, "sleep_between_calls": False},
    ]
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        RunConfig.model_validate({"engine": {"type": "vllm", "gpu_memory_utilization": 1.5}})


def test_checkpoints_name_the_lm_head_only_where_vllm_servers_reload_them():
    from rlpipe.tasks.checkpoint import reloaded_by_vllm_servers
    from rlpipe.tasks.config import RunConfig

    def engine(section: dict):
        return RunConfig.model_validate({"device": "cpu", "engine": section}).engine

    assert reloaded_by_vllm_servers(engine({"type": "http", "urls": ["http://a:1", "vllm+http://b:2"]}))
    assert not reloaded_by_vllm_servers(engine({"type": "http", "urls": ["http://a:1", "sglang+http://b:2"]}))
    assert not reloaded_by_vllm_servers(engine({"type": "vllm"}))  # pushes tensors, reads no files
    assert not reloaded_by_vllm_servers(engine({"type": "torch"}))


def test_weights_for_vllm_have_hf_names_an_lm_head_and_lora_folded_in(tmp_path):
    from rlpipe.engines.vllm_weights import checkpoint_weights, trainer_weights
    from rlpipe.training.lora import LoraOptions, add_lora, merged_state_dict

    tok = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok))  # tied
    weights = dict(trainer_weights(model))
    assert torch.equal(weights["lm_head.weight"], model.model.embed_tokens.weight)
    model.save_pretrained(tmp_path)  # tied: the files hold no lm_head...
    on_disk = dict(checkpoint_weights(tmp_path))
    assert set(on_disk) == set(weights)  # ...and vLLM still gets one
    assert all(torch.equal(on_disk[k], weights[k]) for k in weights)

    adapted = add_lora(build_model("tiny-dense", vocab_size=len(tok)), LoraOptions(rank=4))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B = 0 at first: make the adapters change the weights
    weights = dict(trainer_weights(adapted))
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    merged = merged_state_dict(adapted)
    assert all(torch.equal(weights[k], merged[k]) for k in merged)
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                           adapted.model.layers[0].self_attn.q_proj.base_layer.weight)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_weights(tmp_path / "missing")


def test_vllm_versions_compare_by_major_and_minor():
    from rlpipe.engines.vllm_weights import version_tuple

    assert version_tuple("0.32.0") == (0, 32)
    assert version_tuple("0.10.1rc1+cpu") == (0, 10)
    assert version_tuple("0.9") < version_tuple("0.32.0") < version_tuple("1.0.0") == (1, 0)


def test_vllm_logging_is_quiet_but_keeps_real_warnings(monkeypatch):
    import logging

    from rlpipe.engines.vllm_lifecycle import quiet_vllm_logging

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    loader = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    renderer = logging.getLogger("vllm.renderers.base")
    for logger in (loader, renderer):
        monkeypatch.setattr(logger, "handlers", [handler])
        monkeypatch.setattr(logger, "filters", [])
        monkeypatch.setattr(logger, "propagate", False)
    quiet_vllm_logging()
    quiet_vllm_logging()  # idempotent: one filter per logger
    assert len(loader.filters) == len(renderer.filters) == 1
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    loader.warning("%s: Failed to load weights", "RotaryEmbedding")
    loader.warning("%s: Failed to load weights", "Qwen3DecoderLayer")
    renderer.warning("Chat template warmup failed")
    renderer.warning("Using None for EOS token id because tokenizer is not initialized")
    renderer.warning("something else")
    assert seen == ["Qwen3DecoderLayer: Failed to load weights", "something else"]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet_vllm_logging()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's choice stands


def test_moe_experts_are_pinned_to_the_kernel_that_reads_pushed_weights():
    from rlpipe.engines.vllm_weights import moe_backend_kwargs

    tok = build_tokenizer()
    moe = build_model("tiny-moe", vocab_size=len(tok)).config
    dense = build_model("tiny-dense", vocab_size=len(tok)).config
    assert moe_backend_kwargs(moe, False, {"moe_backend", "seed"}) == {"moe_backend": "triton"}
    assert moe_backend_kwargs(dense, False, {"moe_backend"}) == {}
    assert moe_backend_kwargs(moe, True, {"moe_backend"}) == {}  # the CPU build repacks instead
    assert moe_backend_kwargs(moe, False, {"seed"}) == {}  # a vLLM without the argument


def test_moe_kernels_that_reorder_experts_are_refused_by_name():
    from types import SimpleNamespace

    from rlpipe.engines.vllm_weights import check_pushable_moe_backends, moe_backend_names
    from torch import nn

    def experts(backend: str, wrapped: bool = False) -> nn.Module:
        layer = nn.Module()
        method = SimpleNamespace(unquantized_backend=SimpleNamespace(name=backend))
        layer.quant_method = SimpleNamespace(old_quant_method=method) if wrapped else method
        return layer

    model = nn.Sequential(nn.Linear(2, 2), experts("TRITON"), experts("FLASHINFER_TRTLLM", True))
    assert moe_backend_names(model) == ["TRITON", "FLASHINFER_TRTLLM"]
    assert moe_backend_names(nn.Linear(2, 2)) == []
    check_pushable_moe_backends(["TRITON", "BATCHED_TRITON", "CPU"])
    check_pushable_moe_backends([])
    with pytest.raises(RuntimeError, match="FLASHINFER_TRTLLM.*scrambled"):
        check_pushable_moe_backends(moe_backend_names(model))


def test_a_moe_model_whose_kernels_vllm_does_not_name_is_warned_about(caplog):
    from types import SimpleNamespace

    from rlpipe.engines.vllm_weights import check_pushable_moe_backends, is_moe

    assert is_moe(SimpleNamespace(num_experts=8)) and is_moe(SimpleNamespace(num_local_experts=8))
    assert not is_moe(SimpleNamespace(num_experts=0)) and not is_moe(SimpleNamespace())
    check_pushable_moe_backends([], moe=False)
    assert not caplog.records
    check_pushable_moe_backends([], moe=True)
    assert "cannot tell which kernel" in caplog.text


def test_a_missing_flashinfer_switches_vllm_to_its_other_sampler(monkeypatch, caplog):
    import importlib.util

    from rlpipe.engines import vllm_lifecycle

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    monkeypatch.setattr(vllm_lifecycle, "_said", set())
    environ: dict[str, str] = {}
    with caplog.at_level("WARNING", logger="rlpipe.engines.vllm_lifecycle"):
        assert vllm_lifecycle.use_sampler_without_flashinfer(environ)
        assert vllm_lifecycle.use_sampler_without_flashinfer({})  # set again, said once
    assert environ == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    said = [r.getMessage() for r in caplog.records if "FlashInfer is not installed" in r.getMessage()]
    assert len(said) == 1 and "VLLM_USE_FLASHINFER_SAMPLER=0" in said[0]
    user = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}  # the user's own choice is kept
    assert not vllm_lifecycle.use_sampler_without_flashinfer(user) and user["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_an_installed_flashinfer_leaves_vllm_its_default(monkeypatch):
    import importlib.machinery
    import importlib.util

    from rlpipe.engines import vllm_lifecycle

    real_find_spec = importlib.util.find_spec
    spec = importlib.machinery.ModuleSpec("flashinfer", None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "flashinfer" else real_find_spec(name, *a))
    environ: dict[str, str] = {}
    assert not vllm_lifecycle.use_sampler_without_flashinfer(environ) and environ == {}


def test_the_vllm_engine_sets_the_sampler_before_vllm_is_imported():
    # in a fresh process without FlashInfer: building the engine (here refused: no GPU or no vLLM)
    # has set the variable before vLLM could read it
    code = ("import os, sys\n"
            "sys.modules['flashinfer'] = None\n"
            "from rlpipe.engines.vllm_engine import VllmEngine\n"
            "from rlpipe.engines.vllm_lifecycle import FLASHINFER_SAMPLER\n"
            "try:\n"
            "    VllmEngine.__init__(object.__new__(VllmEngine), None)\n"
            "except Exception:\n"
            "    pass\n"
            "print(os.environ.get(FLASHINFER_SAMPLER))\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_FLASHINFER_SAMPLER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "0"


# the weight push, with a stand-in for vLLM's worker: its model is a copy of the trainer's in which
# one projection has another shape (as vLLM's fused qkv_proj) and the lm_head another dtype (a bf16
# engine)


def _vllm_side(model):
    import copy
    from types import SimpleNamespace

    vllm_model = copy.deepcopy(model)
    attn = vllm_model.model.layers[0].self_attn
    attn.q_proj.weight = torch.nn.Parameter(torch.zeros(attn.q_proj.weight.shape[0] * 2, attn.q_proj.weight.shape[1]))
    vllm_model.lm_head.weight = torch.nn.Parameter(vllm_model.lm_head.weight.detach().to(torch.bfloat16))
    loaded: list[str] = []

    def load_weights(weights):  # what vLLM's load_weights does: copy into its own parameters
        params = dict(vllm_model.named_parameters())
        for name, tensor in weights:
            if name in params and params[name].shape == tensor.shape:
                params[name].data.copy_(tensor)
            loaded.append(name)

    vllm_model.load_weights = load_weights
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: vllm_model))
    return vllm_model, worker, loaded


def test_the_engine_pushes_every_weight_and_a_checkpoint_never_lands_in_the_trainer(monkeypatch, tmp_path):
    import threading
    import types

    from rlpipe.engines import vllm_engine
    from rlpipe.engines.vllm_engine import VllmEngine

    model = build_model("tiny-dense", vocab_size=40, seed=0, tie_word_embeddings=False)
    vllm_model, worker, loaded = _vllm_side(model)
    monkeypatch.setattr(vllm_engine, "load_weights_on_worker",
                        lambda w, weights: w.model_runner.get_model().load_weights(iter(weights)))
    engine = object.__new__(VllmEngine)  # its state without starting vLLM
    engine.model, engine._asleep, engine._closed = model, False, False
    engine._lock, engine._policy_version = threading.Lock(), 0
    engine._llm = types.SimpleNamespace(collective_rpc=lambda fn, args=(): [fn(worker, *args)],
                                        reset_prefix_cache=lambda: None)
    names = [name for name, _ in model.named_parameters()]
    engine._push_weights()
    assert loaded == names  # every tensor is copied: vLLM keeps weights of its own
    ours, theirs = dict(model.named_parameters()), dict(vllm_model.named_parameters())
    assert all(theirs[n].data_ptr() != ours[n].data_ptr() for n in names)
    with torch.no_grad():  # an optimizer step in place: vLLM sees it at the next push only
        ours["model.norm.weight"].add_(1.0)
    assert not torch.equal(theirs["model.norm.weight"], ours["model.norm.weight"])
    loaded.clear()
    engine._push_weights()
    assert loaded == names and torch.equal(theirs["model.norm.weight"], ours["model.norm.weight"])

    model.save_pretrained(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    checkpoint = {n: p + 1.0 for n, p in before.items()}
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in checkpoint.items()}, tmp_path / "model.safetensors")
    engine.sync(str(tmp_path), 1)
    for name, value in before.items():  # the trainer keeps its weights...
        assert torch.equal(dict(model.named_parameters())[name], value), name
    theirs = dict(vllm_model.named_parameters())
    assert torch.equal(theirs["model.norm.weight"], checkpoint["model.norm.weight"])  # ...vLLM serves the file's
    assert theirs["model.norm.weight"].data_ptr() != model.model.norm.weight.data_ptr()
