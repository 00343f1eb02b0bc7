"""Checkpoints load in plain transformers, resume bit-exactly, and fail loudly when damaged."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from rlpipe.models.attention import VARLEN_ATTENTION
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.checkpoint_files import latest_checkpoint
from rlpipe.training.checkpoint_io import (
    CheckpointOptions,
    CheckpointRecord,
    load_checkpoint,
    save_checkpoint,
)
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import build_optimizer, build_scheduler, forward_backward, optim_step
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _model(tokenizer, seed=0, preset="tiny-dense"):
    return build_model(preset, vocab_size=len(tokenizer), seed=seed)


def test_saved_checkpoint_loads_in_plain_transformers(tmp_path, tokenizer):
    model = _model(tokenizer).eval()
    path = save_checkpoint(tmp_path, 7, model, tokenizer, record=CheckpointRecord(metrics={"loss": 1.5}))
    assert path == tmp_path / "checkpoints" / "step_000007"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metadata.json",
                 "data_state.json", "rng_state.pt"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert VARLEN_ATTENTION not in json.dumps(config)
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["step"] == 7 and meta["policy_version"] == 7 and meta["metrics"] == {"loss": 1.5}
    assert len(meta["sha256"]) == 64

    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tokenizer.encode("hello, world")])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def _steps(model, opt, sched, steps):
    """Train `steps` steps on data drawn from the global torch RNG (so RNG restore matters)."""
    for _ in range(steps):
        seqs = [
            Sequence(tokens=torch.randint(4, 60, (n,)).tolist(), weights=[1.0] * n)
            for n in torch.randint(5, 20, (6,)).tolist()
        ]
        forward_backward(model, pack(seqs, token_budget=48), nll_loss)
        optim_step(model, opt, sched, max_grad_norm=1.0)


def _fresh(tokenizer, seed):
    model = _model(tokenizer, seed=seed)
    opt = build_optimizer(model, lr=3e-3, weight_decay=0.1)
    return model, opt, build_scheduler(opt, warmup_steps=2, total_steps=4)


def test_resume_equals_uninterrupted_training(tmp_path, tokenizer):
    torch.manual_seed(123)
    model, opt, sched = _fresh(tokenizer, seed=0)
    _steps(model, opt, sched, 4)
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(123)
    model, opt, sched = _fresh(tokenizer, seed=0)
    _steps(model, opt, sched, 2)
    path = save_checkpoint(tmp_path, 2, model, tokenizer, opt, sched, CheckpointRecord(data_state={"offset": 12}))
    torch.rand(100), random.random(), np.random.rand()  # perturb every RNG after saving

    model, opt, sched = _fresh(tokenizer, seed=99)  # different init: everything must come back
    ckpt = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert ckpt.model is model and ckpt.data_state == {"offset": 12} and ckpt.step == 2
    _steps(model, opt, sched, 2)
    for n, p in model.named_parameters():
        assert torch.equal(p, straight[n]), n


def test_load_without_model_and_latest(tmp_path, tokenizer):
    model = _model(tokenizer)
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, model, tokenizer)
    p10 = save_checkpoint(tmp_path, 10, model, tokenizer)
    (tmp_path / "checkpoints" / ".tmp-step_000020-dead").mkdir()  # an interrupted write
    (tmp_path / "checkpoints" / "step_000030").mkdir()  # no metadata.json: incomplete
    assert latest_checkpoint(tmp_path) == p10
    ckpt = load_checkpoint(p10, restore_rng=False)
    assert ckpt.model.config._attn_implementation == VARLEN_ATTENTION
    assert ckpt.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert ckpt.tokenizer.chat_template == tokenizer.chat_template
    for (n, a), b in zip(model.state_dict().items(), ckpt.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_rewriting_a_step_replaces_it(tmp_path, tokenizer):
    save_checkpoint(tmp_path, 3, _model(tokenizer, seed=1), tokenizer, record=CheckpointRecord(metrics={"v": 1}))
    path = save_checkpoint(tmp_path, 3, _model(tokenizer, seed=2), tokenizer, record=CheckpointRecord(metrics={"v": 2}))
    assert json.loads((path / "metadata.json").read_text())["metrics"] == {"v": 2}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003"]
    loaded = load_checkpoint(path, restore_rng=False).model
    expected = _model(tokenizer, seed=2)
    assert torch.equal(loaded.model.embed_tokens.weight, expected.model.embed_tokens.weight)


def test_moe_checkpoint_round_trip(tmp_path, tokenizer):
    model = _model(tokenizer, seed=4, preset="tiny-moe")
    path = save_checkpoint(tmp_path, 1, model, tokenizer)
    other = _model(tokenizer, seed=5, preset="tiny-moe")
    load_checkpoint(path, model=other, restore_rng=False)
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


@pytest.fixture
def saved(tmp_path, tokenizer):
    return save_checkpoint(tmp_path, 5, _model(tokenizer), tokenizer)


def test_missing_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "metadata.json"])
def test_missing_file_errors(saved, name):
    (saved / name).unlink()
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_checkpoint(saved)


def test_truncated_weights_error(saved):
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_checkpoint(saved)


def test_flipped_byte_fails_sha_check(saved):
    weights = saved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors.*sha256"):
        load_checkpoint(saved)


def test_optimizer_state_missing_errors(saved, tokenizer):
    model = _model(tokenizer)
    with pytest.raises(ValueError, match=r"optimizer\.pt"):
        load_checkpoint(saved, model=model, optimizer=build_optimizer(model, 1e-3))


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path, tokenizer):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 1, _model(tokenizer), tokenizer)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    torch.load(path / "rng_state.pt", weights_only=True)  # plain tensors and numbers: no pickle code
    load_checkpoint(path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


class _Boom:
    def __reduce__(self):  # what a hostile optimizer.pt would carry: code run at unpickling
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def _rehash(path, name: str) -> None:
    """Record a replaced file's sha256 in metadata.json, as a hand-made checkpoint would."""
    from rlpipe.training.checkpoint_files import sha256_file

    metadata = json.loads((path / "metadata.json").read_text())
    metadata["files"][name] = sha256_file(path / name)
    (path / "metadata.json").write_text(json.dumps(metadata))


def test_a_pickled_object_in_a_checkpoint_is_refused_not_run(tmp_path, tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model(tokenizer)
    opt = build_optimizer(model, lr=1e-3)
    path = save_checkpoint(tmp_path, 1, model, tokenizer, optimizer=opt)
    torch.save({"optimizer": _Boom(), "scheduler": None}, path / "optimizer.pt")
    _rehash(path, "optimizer.pt")  # hashes that match: the file's content itself is refused
    with pytest.raises(ValueError, match=r"optimizer\.pt.*could run code"):
        load_checkpoint(path, model=model, optimizer=opt, restore_rng=False)
    assert not (tmp_path / "PWNED").exists()
    # an old checkpoint's RNG file (numpy state pickled as objects) gets the same clear refusal
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               path / "rng_state.pt")
    _rehash(path, "rng_state.pt")
    with pytest.raises(ValueError, match=r"rng_state\.pt.*restore_rng=False"):
        load_checkpoint(path)
    assert load_checkpoint(path, restore_rng=False).step == 1  # the weights still load


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_tied_model_can_name_its_lm_head_for_vllm_servers(tmp_path, tokenizer, shard, monkeypatch):
    from rlpipe.training.checkpoint_io import LM_HEAD_FILE
    from safetensors.torch import load_file

    model = _model(tokenizer).eval()  # tied, like Qwen3-0.6B
    if shard:  # a sharded checkpoint: vLLM reads only the files its index names
        save = type(model).save_pretrained
        monkeypatch.setattr(type(model), "save_pretrained",
                            lambda self, folder, **kw: save(self, folder, max_shard_size=shard, **kw))
    plain = save_checkpoint(tmp_path / "plain", 1, model, tokenizer, options=CheckpointOptions(explicit_lm_head=False))
    path = save_checkpoint(tmp_path / "named", 1, model, tokenizer, options=CheckpointOptions(explicit_lm_head=True))
    assert not (plain / LM_HEAD_FILE).exists()
    head = load_file(str(path / LM_HEAD_FILE))
    assert list(head) == ["lm_head.weight"] and torch.equal(head["lm_head.weight"], model.lm_head.weight)
    meta, plain_meta = (json.loads((p / "metadata.json").read_text()) for p in (path, plain))
    assert LM_HEAD_FILE in meta["weight_files"]  # sha-checked
    # the checkpoints table's one hash covers the lm_head file too
    assert meta["sha256"] != plain_meta["sha256"] and meta["sha256"] not in meta["weight_files"].values()
    index = path / "model.safetensors.index.json"
    assert index.is_file() == bool(shard)
    if shard:
        assert json.loads(index.read_text())["weight_map"]["lm_head.weight"] == LM_HEAD_FILE
    back = load_checkpoint(path, restore_rng=False).model  # Transformers still loads it tied, same weights
    assert back.lm_head.weight is back.get_input_embeddings().weight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values(), strict=True))
    untied = build_model("tiny-dense", vocab_size=len(tokenizer), seed=0, tie_word_embeddings=False)
    assert not (save_checkpoint(tmp_path / "untied", 1, untied, tokenizer, options=CheckpointOptions(explicit_lm_head=True))
                / LM_HEAD_FILE).exists()  # its files hold its own lm_head already
