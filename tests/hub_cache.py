"""Hugging Face hub caches built by the tests: what `snapshot_download` and `datasets` find under
HF_HOME when a repository was downloaded once, so hub ids resolve under HF_HUB_OFFLINE=1 with no
network."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def hub_snapshot(hf_home: Path, repo: str, files_from: Path, kind: str = "model",
                 branch: str = "main") -> Path:
    """Copy the files of `files_from` into `hf_home`'s hub cache as `repo`'s snapshot at a commit
    derived from its content, with refs/`branch` pointing there (huggingface_hub's layout:
    hub/models--ORG--NAME/{refs/main, snapshots/COMMIT/...}); returns the snapshot folder."""
    files = sorted(p for p in files_from.rglob("*") if p.is_file())
    digest = hashlib.sha1()
    for file in files:
        digest.update(str(file.relative_to(files_from)).encode())
        digest.update(file.read_bytes())
    commit = digest.hexdigest()
    root = hf_home / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for file in files:
        target = snapshot / file.relative_to(files_from)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / branch).write_text(commit)
    return snapshot


def tiny_hub_model(hf_home: Path, repo: str, seed: int = 0) -> Path:
    """A tiny Qwen3 (the `tiny-dense` preset, rlpipe's tokenizer and its ChatML template) as hub
    model `repo` in `hf_home`'s cache; returns its snapshot folder."""
    from rlpipe.models.presets import build_model
    from rlpipe.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tokenizer), seed=seed, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None)
    source = hf_home / "source" / repo
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    return hub_snapshot(hf_home, repo, source)


def use_hub_cache(monkeypatch, hf_home: Path) -> None:
    """Point this process's huggingface_hub and `datasets` at `hf_home` (they read HF_HOME once,
    at import) and subprocesses at it through HF_HOME."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")


def gsm8k_rows(n: int, offset: int = 0) -> list[dict]:
    """GSM8K-shaped rows (question, answer = worked solution ending in '#### N'): a + b."""
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 7 + 1, i % 5 + 2
        rows.append({"question": f"{a}+{b}=", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"})
    return rows


def tiny_hub_gsm8k(hf_home: Path, repo: str = "openai/gsm8k", train: int = 40, test: int = 8) -> Path:
    """A GSM8K-shaped hub dataset repository (config `main`, splits train and test, Parquet files
    and the README's `configs` metadata, as the real one is laid out) in `hf_home`'s cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = hf_home / "source" / repo
    (source / "main").mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", gsm8k_rows(train)), ("test", gsm8k_rows(test, offset=1000))):
        pq.write_table(pa.Table.from_pylist(rows), source / "main" / f"{split}-00000-of-00001.parquet")
    (source / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n")
    return hub_snapshot(hf_home, repo, source, kind="dataset")
