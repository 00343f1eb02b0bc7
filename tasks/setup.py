"""Building the trainer's state: tokenizer, model, optimizer, scheduler, environment, data.

Not stages (nothing is persisted): flows call these once and keep the results in local
variables for the whole run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.envs.base import Environment, Example
from rlpipe.envs.dataset import jsonl_records, read_dataset, read_utf8
from rlpipe.envs.registry import build_env
from rlpipe.models.device import resolve_device
from rlpipe.models.loading import load_model
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer, load_tokenizer
from rlpipe.training.batch import Sequence
from rlpipe.training.data import sft_sequences
from rlpipe.training.lora import LoraOptions, with_lora
from rlpipe.training.step import build_optimizer, build_scheduler


def make_env(env_name: str, options: dict[str, Any], reward_models: list[Any] | tuple = (),
             env_reward_weight: float = 1.0, template_kwargs: dict[str, Any] | None = None) -> Environment:
    """The environment, its reward composed with `task.reward_models` when any are configured
    (a judge renders its chats with its own chat_template_kwargs, else `template_kwargs`). A run's
    whole `[task]` (mixtures, MCP tools, reward deadline) is `task_env`."""
    env = build_env(env_name, **options)
    if not reward_models:
        return env
    from rlpipe.envs.reward_models import WithModelRewards, build_scorer

    scorers = {rm.name: (build_scorer(rm, template_kwargs), rm.weight) for rm in reward_models}
    return WithModelRewards(env, scorers, env_weight=env_reward_weight)


def task_env(task, template_kwargs: dict[str, Any] | None = None, reward_models: bool = True,
             tools: bool = False) -> Environment:
    """The environment of a `[task]` section: its one env, or a `MixtureEnv` of its
    `[[task.envs]]` entries; with `tools`, the tools of `task.mcp_servers` (envs/mcp_tools.py: the
    servers start here and the environment's `close()` stops them; RL only); composed with its
    reward models (unless `reward_models` is False) and its reward deadline (envs/timeout.py)."""
    from rlpipe.envs.timeout import with_reward_timeout

    entries = task.entries()
    if task.envs:
        from rlpipe.envs.mixture import MixtureEnv

        env: Environment = MixtureEnv({e.name: build_env(e.env, **e.options) for e in entries},
                                      {e.name: e.weight for e in entries})
    else:
        env = build_env(task.env, **task.options)
    if tools and task.mcp_servers:
        from rlpipe.envs.mcp_tools import with_mcp_tools

        env = with_mcp_tools(env, task.mcp_servers, tool_use_options(task))
    if reward_models and task.reward_models:
        from rlpipe.envs.reward_models import WithModelRewards, build_scorer

        scorers = {rm.name: (build_scorer(rm, template_kwargs), rm.weight) for rm in task.reward_models}
        env = WithModelRewards(env, scorers, env_weight=task.env_reward_weight)
    return with_reward_timeout(env, task.reward_timeout_s)


def tool_use_options(task):
    """The options of episodes with MCP tools (`task.tool_max_turns`, `task.tool_call_parser`),
    None without `task.mcp_servers`."""
    if not task.mcp_servers:
        return None
    from rlpipe.envs.mcp_tools import ToolUseOptions

    return ToolUseOptions(max_turns=task.tool_max_turns, parser=task.tool_call_parser)


def make_model_and_tokenizer(preset: str, path: str, overrides: dict[str, Any], seed: int):
    """A user's checkpoint (its own tokenizer) or a fresh preset with rlpipe's tokenizer."""
    if path:
        return load_model(path), load_tokenizer(path)
    tokenizer = build_tokenizer()
    token_ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "bos_token_id": None,
    }
    model = build_model(preset, vocab_size=len(tokenizer), seed=seed, **{**token_ids, **overrides})
    return model, tokenizer


def place_model(model, device: str, weights_dtype: str = "float32",
                activation_checkpointing: bool = False, compile: bool = False, fused: str = "none"):
    """The model on the configured device and dtype (in place), with activation checkpointing,
    fused kernels (`train.fused`, training/fused.py) and regional compilation (`train.compile`,
    models/compile.py) switched on if asked. Call before building the optimizer: its state
    follows the parameters."""
    import torch

    model.to(device=resolve_device(device), dtype=getattr(torch, weights_dtype))
    if fused != "none":
        from rlpipe.training.fused import apply_fused_kernels

        apply_fused_kernels(model, fused, compiled=compile)
    if activation_checkpointing:
        # non-reentrant: works with the packed-attention keyword arguments and no-grad inputs;
        # transformers >= 5.2x renamed the switch (the old name still works but warns)
        options = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if compile:
        from rlpipe.models.compile import compile_layers

        compile_layers(model)
    return model


@dataclass(frozen=True)
class Placement:
    """Where and how a trained model sits: device, weights dtype, activation checkpointing,
    regional compilation, fused kernels and LoRA adapters (the same on every data-parallel rank)."""

    device: str = "cpu"
    weights_dtype: str = "float32"
    activation_checkpointing: bool = False
    compile: bool = False
    lora: LoraOptions | None = None
    fused: str = "none"


def train_compile(config) -> bool:
    """`train.compile` resolved for the run's device (unset = auto: on CUDA, models/compile.py)."""
    from rlpipe.models.compile import compile_enabled

    return compile_enabled(config.train.compile, resolve_device(config.device).type,
                           config.train.activation_checkpointing)


def with_resolved_compile(config):
    """The run config with `train.compile` set to what this run does (true or false), so that
    config.json and the MLflow params say what was used."""
    value = train_compile(config)
    if config.train.compile is value:
        return config
    return config.model_copy(update={"train": config.train.model_copy(update={"compile": value})})


def placement(config) -> Placement:
    """The run config's placement of its trained model."""
    return Placement(device=config.device, weights_dtype=config.model.weights_dtype,
                     activation_checkpointing=config.train.activation_checkpointing,
                     compile=train_compile(config), lora=config.model.lora.options(),
                     fused=config.train.fused)


def prepare_model(model, where: Placement):
    """`place_model`, then LoRA adapters (only they train, training/lora.py); returns the model."""
    place_model(model, where.device, where.weights_dtype, where.activation_checkpointing, where.compile,
                where.fused)
    return with_lora(model, where.lora)


def engine_dtype(model, bf16_autocast: bool):
    """The dtype the in-process engine samples in: bf16 on CUDA when training autocasts to it
    (what vLLM would do), else the model's own (fp32 decoding is faster than bf16 on CPU)."""
    import torch

    param = next(model.parameters())
    return torch.bfloat16 if param.device.type == "cuda" and bf16_autocast else param.dtype


def make_optimizer(model, optim, total_steps: int):
    """AdamW and its warmup-cosine schedule from an optim section, over `total_steps` steps."""
    optimizer = build_optimizer(model, lr=optim.lr, weight_decay=optim.weight_decay, kind=optim.optimizer)
    scheduler = build_scheduler(optimizer, warmup_steps=optim.warmup_steps,
                                total_steps=max(total_steps, 1), min_lr_ratio=optim.min_lr_ratio)
    return optimizer, scheduler


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Tokens that end an assistant turn: ChatML's <|im_end|> and the tokenizer's eos."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return tuple(sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id))


def max_context(model) -> int:
    """The model's context length (max_position_embeddings, else 4096)."""
    return int(getattr(model.config, "max_position_embeddings", 4096))


def demonstration(env: Environment, example: Example, rng: random.Random) -> str:
    """The assistant text SFT imitates for an example: the env's teacher, else the target."""
    teacher = getattr(env, "demonstration", None)
    if callable(teacher):
        return teacher(example, rng)
    if "target_text" in example.meta:
        return str(example.meta["target_text"])
    return str(example.answer)


def env_conversations(env: Environment, n_examples: int, seed: int) -> list[list[dict]]:
    """SFT chats from the env's train split: the prompt turn(s) and a demonstration."""
    examples = env.examples("train", seed=seed)
    if len(examples) == 0:
        raise ValueError(f"environment {getattr(env, 'name', env)!r} has no train examples")
    rng = random.Random(f"sft/{seed}")
    chats = []
    whole = getattr(env, "demonstration_messages", None)  # a multi-turn env's teacher episodes
    for index in range(n_examples):
        example = examples[index % len(examples)]
        if callable(whole):
            chats.append(whole(example, rng))
            continue
        chats.append(env.reset(example) + [{"role": "assistant",
                                            "content": demonstration(env, example, rng)}])
    return chats


def read_chat_jsonl(path: Path) -> list[list[dict]]:
    """Chats from a JSONL file: one `{"messages": [{role, content}, ...]}` (or a bare list) per line."""
    if not path.is_file():
        raise ValueError(f"SFT data file not found: {path}")
    chats = []
    for number, record in jsonl_records(path):
        messages = record.get("messages") if isinstance(record, dict) else record
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{path}:{number}: expected {{'messages': [{{'role', 'content'}}, ...]}}")
        chats.append(messages)
    if not chats:
        raise ValueError(f"SFT data file {path} holds no conversations")
    return chats


def source_chats(source) -> list[list[dict]]:
    """The conversations of one `[[sft.data]]` source (training/config.py `SftSource`): a row's
    messages column, or its prompt and response columns as one exchange, after the source's
    system prompt. A .jsonl read for its messages keeps `read_chat_jsonl`'s forms."""
    where = f"sft.data {source.path!r}"
    if not source.prompt_column and source.messages_column == "messages" and source.path.endswith(".jsonl"):
        chats = read_chat_jsonl(Path(source.path))
    else:
        try:
            rows = read_dataset(source.path, source.split, source.revision)
        except FileNotFoundError as error:
            raise ValueError(f"{where}: {error}") from None
        chats = [_row_chat(row, number, source, where) for number, row in enumerate(rows)]
    if not chats:
        raise ValueError(f"{where} holds no conversations")
    system = [{"role": "system", "content": source.system_prompt}] if source.system_prompt else []
    return [system + chat for chat in chats]


def _row_chat(row: dict, number: int, source, where: str) -> list[dict]:
    columns = [source.prompt_column, source.response_column] if source.prompt_column else [source.messages_column]
    for column in columns:
        if column not in row:
            raise ValueError(f"{where}: row {number} has no column {column!r}; columns: {', '.join(sorted(row))}")
    if source.prompt_column:
        return [{"role": "user", "content": str(row[source.prompt_column])},
                {"role": "assistant", "content": str(row[source.response_column])}]
    messages = row[source.messages_column]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{where}: row {number} column {source.messages_column!r} is not chat messages "
                         "([{'role', 'content'}, ...])")
    return [{key: value for key, value in m.items() if value is not None} for m in messages]


def mixture_counts(weights: list[float], total: int) -> list[int]:
    """How many of `total` draws each weight gets: proportional, largest remainders rounded up,
    summing to `total`."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mix(sources: list[list], weights: list[float], total: int, seed: int) -> list:
    """`total` items drawn from `sources` in proportion to `weights`: each source's items in a
    seeded shuffle (reshuffled per pass when its share is larger than it), the draws of every
    source interleaved by one more seeded shuffle. A pure function of its arguments: the same
    seed gives the same list, so a resumed run's steps (tasks/supervised_steps.py, by seed and step)
    see the same items."""
    drawn = []
    for index, (items, count) in enumerate(zip(sources, mixture_counts(weights, total), strict=True)):
        taken: list = []
        for epoch in range(-(-count // len(items))):
            order = list(range(len(items)))
            random.Random(f"mix/{seed}/{index}/{epoch}").shuffle(order)
            taken += [items[i] for i in order]
        drawn += taken[:count]
    random.Random(f"mix/{seed}").shuffle(drawn)
    return drawn


def sft_data(env: Environment, tokenizer, n_examples: int, seed: int, max_len: int,
             data_path: str = "", sources: list | tuple = (),
             template_kwargs: dict[str, Any] | None = None) -> list[Sequence]:
    """Training sequences with assistant-only weights: from a mixture of sources (`sft.data`,
    `n_examples` conversations), a JSONL of chats, or the env; rendered with `template_kwargs`
    (model.chat_template_kwargs) as RL's prompts are."""
    if sources:
        chats = mix([source_chats(source) for source in sources], [source.weight for source in sources],
                    n_examples, seed)
    elif data_path:
        chats = read_chat_jsonl(Path(data_path))
    else:
        chats = env_conversations(env, n_examples, seed)
    return sft_sequences(chats, tokenizer, max_len=max_len, template_kwargs=template_kwargs)


def read_documents(path: Path) -> list[str]:
    """Documents of a text file (one per line) or a JSONL file with a `text` field."""
    if not path.is_file():
        raise ValueError(f"pretrain data file not found: {path}")
    if path.suffix == ".jsonl":
        docs = []
        for number, record in jsonl_records(path):
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: JSONL record is not an object")
            if "text" not in record:
                raise ValueError(f"{path}:{number}: JSONL record has no 'text' field")
            docs.append(str(record["text"]))
        return docs
    return [line for line in read_utf8(path).splitlines() if line.strip()]


def pretrain_data(env: Environment, tokenizer, section, seed: int) -> list[Sequence]:
    """Pretraining sequences (weights 1): a corpus file, or the env's problems with answers."""
    from rlpipe.training.data import pretrain_sequences

    if getattr(section, "data", None):
        raise ValueError("pretrain.data: a mixture of sources is for SFT; pretraining reads pretrain.data_path")
    if section.data_path:
        docs = read_documents(Path(section.data_path))
    else:
        examples = env.examples("train", seed=seed)
        rng = random.Random(f"pretrain/{seed}")
        docs = [f"{examples[i % len(examples)].prompt}{demonstration(env, examples[i % len(examples)], rng)}"
                for i in range(section.examples)]
    if not docs:
        raise ValueError("pretrain data is empty")
    token_docs = [tokenizer.encode(doc, add_special_tokens=False) + [tokenizer.eos_token_id] for doc in docs]
    return pretrain_sequences(token_docs, section.seq_len)
