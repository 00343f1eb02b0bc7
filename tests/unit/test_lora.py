"""LoRA through peft: adapters train, checkpoints hold merged weights plus a PEFT folder, and the
engines' log-probs agree with the trainer's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from rlpipe.engines.base import SamplingParams  # noqa: E402
from rlpipe.engines.torch_engine import TorchEngine  # noqa: E402
from rlpipe.models.loading import load_model  # noqa: E402
from rlpipe.tasks.setup import make_model_and_tokenizer  # noqa: E402
from rlpipe.training.batch import Sequence, pack_one  # noqa: E402
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint  # noqa: E402
from rlpipe.training.logprobs import token_logprobs  # noqa: E402
from rlpipe.training.lora import LoraOptions, add_lora, has_lora, merged_state_dict  # noqa: E402
from rlpipe.training.rl_loss import build_rl_loss  # noqa: E402
from rlpipe.training.step import build_optimizer, forward_backward, optim_step  # noqa: E402


def _batch():
    return pack_one([Sequence(tokens=[5, 6, 7, 8, 9, 10], weights=[0, 0, 1.0, 1.0, 1.0, 1.0], sample_id="a"),
                     Sequence(tokens=[5, 6, 11, 12, 13], weights=[0, 0, -1.0, -1.0, -1.0], sample_id="b")])


def _trained_lora(steps: int = 3):
    model, tokenizer = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    add_lora(model, LoraOptions(rank=4, alpha=8.0))
    optimizer = build_optimizer(model, lr=5e-2)
    for _ in range(steps):
        forward_backward(model, [_batch()], build_rl_loss("reinforce"))
        optim_step(model, optimizer)
    return model, tokenizer


def _logprobs(model, batch):
    with torch.no_grad():
        return token_logprobs(model.eval(), batch)[0]


def test_only_adapters_train_and_start_is_unchanged():
    model, _ = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    before = _logprobs(model, _batch())
    base = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, LoraOptions(rank=4))
    assert has_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    torch.testing.assert_close(_logprobs(model, _batch()), before)  # B = 0
    model.train()
    optimizer = build_optimizer(model, lr=5e-2)
    forward_backward(model, [_batch()], build_rl_loss("reinforce"))
    optim_step(model, optimizer)
    assert (_logprobs(model, _batch()) - before).abs().max() > 1e-3  # the adapters moved the policy
    merged_names = set(merged_state_dict(model))
    assert merged_names == set(base)  # the plain HF names, nothing extra
    with pytest.raises(ValueError, match="not modules"):
        add_lora(make_model_and_tokenizer("tiny-dense", "", {}, seed=0)[0], LoraOptions(rank=8, targets=("nope",)))


def test_checkpoint_is_merged_hf_folder_plus_peft_adapter(tmp_path):
    from peft import PeftModel

    model, tokenizer = _trained_lora()
    batch = _batch()
    trainer = _logprobs(model, batch)
    path = save_checkpoint(tmp_path, 3, model, tokenizer)
    assert (path / "model.safetensors").is_file() and (path / "adapter" / "adapter_config.json").is_file()
    # merged weights load as a plain transformers model (what rlpipe serve / vLLM / SGLang read)
    merged = load_model(path)
    assert not has_lora(merged)
    torch.testing.assert_close(_logprobs(merged, batch), trainer, atol=1e-5, rtol=1e-5)
    # the adapter folder loads with peft over the starting weights
    start, _ = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    peft_model = PeftModel.from_pretrained(start, str(path / "adapter"))
    torch.testing.assert_close(_logprobs(peft_model.base_model.model, batch), trainer, atol=1e-5, rtol=1e-5)
    # resume: a fresh LoRA model over the start gets the adapters back
    fresh, _ = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    add_lora(fresh, LoraOptions(rank=4, alpha=8.0))
    load_checkpoint(path, model=fresh, restore_rng=False)
    torch.testing.assert_close(_logprobs(fresh, batch), trainer)


def test_engine_and_trainer_logprobs_agree(tmp_path):
    model, tokenizer = _trained_lora()
    prompts = [[5, 6, 7], [5, 6, 11]]
    params = SamplingParams(n=4, max_new_tokens=6, seed=0)
    engines = {"in-process (shared adapters)": TorchEngine(model.eval()),
               "synced merged checkpoint": TorchEngine(load_model(save_checkpoint(tmp_path, 1, model, tokenizer)).eval())}
    for name, engine in engines.items():
        groups = engine.generate(prompts, params)
        seqs = [Sequence(tokens=p + c.tokens, weights=[0.0] * len(p) + [1.0] * len(c.tokens),
                         logprobs=[0.0] * len(p) + c.logprobs, sample_id=f"{i}-{j}")
                for i, (p, group) in enumerate(zip(prompts, groups, strict=True)) for j, c in enumerate(group)]
        batch = pack_one(seqs)
        mask = batch.token_weights != 0
        gap = (_logprobs(model, batch) - batch.log_probs)[mask].abs().max()
        assert gap < 1e-4, (name, float(gap))
