"""`model.path` as a hub id: resolved through huggingface_hub's cache (a hub-layout cache built
here, HF_HUB_OFFLINE=1 as tests/conftest.py sets it), the same folder for every reader."""

import os

import pytest
import torch
from rlpipe.models.loading import hub_id, load_model, model_source, resolve_model_path
from rlpipe.models.tokenizer import load_tokenizer
from rlpipe.tasks.origin import origin_task
from rlpipe.tasks.setup import make_model_and_tokenizer

from tests.hub_cache import tiny_hub_model, use_hub_cache


@pytest.fixture
def hub(tmp_path, monkeypatch):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    use_hub_cache(monkeypatch, tmp_path / "hf")
    return tiny_hub_model(tmp_path / "hf", "tiny-org/Tiny-Qwen3")


def test_hub_id_parsing(tmp_path):
    assert hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert hub_id("Qwen/Qwen3-0.6B@refs/pr/1") == ("Qwen/Qwen3-0.6B", "refs/pr/1")
    assert hub_id(str(tmp_path)) is None and hub_id("./runs/x") is None and hub_id("/models/q") is None
    assert hub_id("a/b/c") is None and hub_id("single") is None


def test_a_hub_id_resolves_to_its_cached_snapshot(hub):
    commit = hub.name
    assert resolve_model_path("tiny-org/Tiny-Qwen3") == hub
    assert resolve_model_path(f"tiny-org/Tiny-Qwen3@{commit}") == hub
    assert resolve_model_path(str(hub)) == hub  # a local folder as is
    assert model_source("tiny-org/Tiny-Qwen3") == f"tiny-org/Tiny-Qwen3@{commit}"
    model, tokenizer = make_model_and_tokenizer("tiny-dense", "tiny-org/Tiny-Qwen3", {}, seed=1)
    reference = load_model(hub)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                  strict=True))
    # the model's own tokenizer and chat template
    assert tokenizer.chat_template == load_tokenizer(hub).chat_template
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False)


def test_the_origin_records_the_hub_id_and_commit(hub, tmp_path):
    class Tags:
        def set_lineage_tags(self, tags):
            self.tags = tags

    tracker = Tags()
    row = origin_task.fn("tiny-org/Tiny-Qwen3", tracker, run_dir=tmp_path / "run", run_id="r")
    assert row["parent_checkpoint"] == f"tiny-org/Tiny-Qwen3@{hub.name}"
    assert tracker.tags == {"parent_checkpoint": f"tiny-org/Tiny-Qwen3@{hub.name}"}
    assert resolve_model_path(row["parent_checkpoint"]) == hub  # replay loads the same commit


def test_unknown_hub_ids_and_missing_folders_fail_in_one_line(hub, tmp_path):
    for spec, says in [("tiny-org/Nope", "no such local folder, and as a hub id it is not in the Hugging Face cache"),
                       (f"tiny-org/Tiny-Qwen3@{'0' * 40}", "tiny-org/Tiny-Qwen3@"),
                       (str(tmp_path / "nope"), "does not exist")]:
        with pytest.raises(ValueError, match=says) as error:
            load_model(spec)
        assert "\n" not in str(error.value)
        with pytest.raises(ValueError, match="tokenizer: "):
            load_tokenizer(spec)


def test_rlpipe_leaves_hub_access_to_the_users_environment():
    """quiet_defaults (every CLI command's first step) sets no HF_HUB_OFFLINE: a hub id downloads
    where the network allows, and HF_HUB_OFFLINE=1 stays the user's choice."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    code = ("import os; from rlpipe.core.environment import quiet_defaults; quiet_defaults(); "
            "print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('HF_DATASETS_OFFLINE'))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["None", "None"], done.stderr[-2000:]
