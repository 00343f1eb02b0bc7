"""The teacher of on-policy distillation (`rl.teacher`): where its files are, whether it can teach
this student, and the in-process engine that scores every sampled token (rollouts/distill.py).

    folder = teacher_folder(spec, runs_root)              # a folder, models:/NAME@alias, a hub id
    check_teacher(folder, student_tokenizer, vocab_size)  # ValueError, one line, when it cannot
    teacher = load_teacher(spec, runs_root, device)       # rollouts.distill.ModelTeacher
    teacher = served_teacher(rl, student_tokenizer)       # [rl.distill] url: engines/http_teacher.py,
                                                          # checked against the student's tokenizer
    teacher = teacher_for(spec_or_url, config)            # either, checked (rlpipe rescore --teacher)

Not a stage: pre-flight (tasks/preflight.py) checks it before a run writes anything, and the RL
setup (tasks/rl_setup.py) loads it once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def teacher_folder(spec: str, runs_root: str | os.PathLike) -> Path:
    """The local folder of the teacher `spec` names: a checkpoint folder, a registered version
    (`models:/NAME@alias`, `models:/NAME/VERSION`) or a hub id ORG/NAME[@REVISION]."""
    from rlpipe.models.loading import resolve_model_path

    if spec.startswith("models:/"):
        from rlpipe.storage.model_versions import model_folder, registry_uri

        return model_folder(registry_uri(runs_root, "a models:/ teacher"), spec)  # in place on a local store
    return resolve_model_path(spec)


def model_vocab_size(folder: Path) -> int | None:
    """The vocab_size of a model folder's config.json (its output layer's width), None if unstated."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))


def check_teacher(folder: Path, student_tokenizer: Any, student_vocab: int) -> None:
    """ValueError in one line when the teacher in `folder` cannot teach a student with this
    tokenizer and output vocabulary: its tokens must be the student's, id for id, and its logits
    as wide, or its log-prob of a sampled token would be another token's."""
    from rlpipe.models.loading import check_model
    from rlpipe.models.tokenizer import load_tokenizer

    check_model(folder)
    ours, theirs = student_tokenizer.get_vocab(), load_tokenizer(folder).get_vocab()
    if ours != theirs:
        moved = sum(theirs.get(token) != index for token, index in ours.items())
        raise ValueError(f"the teacher's tokenizer is not the student's ({len(theirs)} tokens against "
                         f"{len(ours)}, {moved} of the student's map to another id or are missing)")
    vocab = model_vocab_size(folder)
    if vocab is not None and vocab != student_vocab:
        raise ValueError(f"the teacher's vocabulary has {vocab} entries, the student's {student_vocab}")


def student_tokenizer(config: Any) -> tuple[Any, int]:
    """The tokenizer and output vocabulary size of the student a run config trains (model.path,
    else the preset's tokenizer and vocabulary)."""
    from rlpipe.models.loading import resolve_model_path
    from rlpipe.models.tokenizer import build_tokenizer, load_tokenizer

    if config.model.path:
        folder = resolve_model_path(config.model.path)
        tokenizer = load_tokenizer(folder)
        return tokenizer, model_vocab_size(folder) or len(tokenizer)
    tokenizer = build_tokenizer()
    return tokenizer, config.model.overrides.get("vocab_size", len(tokenizer))


def teacher_for(spec: str, config: Any, device: Any = "cpu"):
    """The teacher `spec` names for the student of run config `config`, checked against its
    tokenizer (ValueError in one line): a server URL (http://, vllm+http://; served_teacher, with
    the config's [rl.distill] token variable, timeout and retries), else a folder, models:/NAME@alias
    or hub id loaded in process on `device`."""
    tokenizer, vocab = student_tokenizer(config)
    if "://" in spec:
        rl = config.rl.model_copy(update={"teacher": "", "distill": config.rl.distill.model_copy(update={"url": spec})})
        return served_teacher(rl, tokenizer)
    check_teacher(teacher_folder(spec, config.runs_root), tokenizer, vocab)
    return load_teacher(spec, config.runs_root, device)


def load_teacher(spec: str, runs_root: str | os.PathLike, device: Any):
    """The teacher `spec` names on `device`, frozen, as an in-process scorer (rollouts/distill.py)."""
    from rlpipe.models.loading import load_model
    from rlpipe.rollouts.distill import ModelTeacher

    folder = teacher_folder(spec, runs_root)
    return ModelTeacher(load_model(folder).to(device), {"teacher": spec, "teacher_checkpoint": str(folder)})


def served_teacher(rl: Any, tokenizer: Any, client: Any = None):
    """The teacher `rl.distill.url` serves (engines/http_teacher.py), named `rl.teacher` in lineage
    (else the served model's name), after checking its tokenizer is the student's: ValueError in
    one line when it is not, or when the server cannot be reached or cannot score."""
    from rlpipe.engines.http import HttpOptions, read_token
    from rlpipe.engines.http_teacher import HttpTeacher
    from rlpipe.engines.http_wire import (
        EngineResponseError,
        EngineTimeoutError,
        EngineUnavailableError,
    )

    distill = rl.distill
    options = HttpOptions(timeout_s=distill.timeout_s, retries=distill.retries,
                          api_token=read_token("", distill.api_token_env))
    teacher = HttpTeacher(distill.url, options, name=rl.teacher, client=client)
    try:
        teacher.check(tokenizer)
        teacher.lineage()
    except (EngineUnavailableError, EngineTimeoutError, EngineResponseError) as err:
        teacher.close()
        raise ValueError(f"the teacher at {distill.url} cannot teach: {err}") from err
    except ValueError:
        teacher.close()
        raise
    return teacher
