"""What `rlpipe serve` accepts: the request models of its routes, their translation into
SamplingParams, prompt token ids, checkpoint paths for reloads, and the batcher calls of a
request under its deadline. Every POST route first reads its body through engines/
request_pipeline.py `read_request` (content type, size, JSON, depth and text checks) into one of
these models; nothing here knows FastAPI routes, so a new route calls the same functions.

Every refusal is a `RequestError` (engines/request_pipeline.py) carrying its HTTP status. Nothing
a client sends gives a 500: a seed outside [0, 2**64), a temperature so small the log-probs
overflow, an unknown field, are all 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.request_pipeline import RequestError, until_answered

# Below this, logits / temperature overflow float32 for ordinary logits (NaN log-probs).
MIN_TEMPERATURE = 1e-3
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


async def sample(request: Any, state: Any, prompts: list[list[int]], params: SamplingParams):
    """The batcher's (`state` is engines/serve_app.py's ServerState) completions for `prompts` and the model that made them, under the request's
    deadline and dropped when the client goes away."""
    try:
        return await until_answered(request, state.batcher.submit(prompts, params), state.limits.request_timeout_s)
    except RequestError:
        raise
    except ValueError as err:  # the engine refused the prompts (e.g. a reload changed vocab)
        raise RequestError(str(err)) from err


async def top_of(request: Any, state: Any, served: Any,
                 sequences: list[tuple[list[int], list[int]]], k: int, params: SamplingParams):
    """`ModelSlot.top_logprobs` off the event loop, under the request's deadline."""
    temperature = 1.0 if params.greedy else params.temperature
    work = asyncio.to_thread(state.slot.top_logprobs, served, sequences, k, temperature)
    return await until_answered(request, work, state.limits.request_timeout_s)


def check_model(name: str | None, state: Any) -> str:
    """The served name a request asked for (404 for another one); the first when it names none."""
    if name is None:
        return state.served_names[0]
    if name not in state.served_names:
        raise RequestError(f"the model {name!r} does not exist; serving {', '.join(map(repr, state.served_names))}",
                           404)
    return name


class OpenAIRequest(BaseModel):
    """Fields and refusals both OpenAI routes share; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = 1
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | int = 0
    presence_penalty: float | int = 0
    repetition_penalty: float | int = 1

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """A null where the field has a default means the default (clients send
        `"max_tokens": null`, `"temperature": null`)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None and not fields[k].is_required())}
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("echo", check_fields=False)
    @classmethod
    def _not_supported(cls, value: bool, info) -> bool:
        if value:
            raise ValueError(f"{info.field_name}=true is not supported by rlpipe serve")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, value):
        if value != 1:
            raise ValueError("repetition_penalty is not supported (only 1)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stops)} strings, at most {MAX_STOP_STRINGS}")
        for i, stop in enumerate(stops):
            if not 0 < len(stop) <= MAX_STOP_CHARS:
                raise ValueError(f"stop[{i}] must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (empty when unset)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_ids(self, end_of_turn: tuple[int, ...]) -> list[int]:
        """stop_token_ids, plus the model's end-of-turn / EOS tokens unless ignore_eos."""
        stops = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else end_of_turn)
        return list(dict.fromkeys(stops))


class CompletionRequest(OpenAIRequest):
    """The accepted fields of POST /v1/completions (unknown fields are refused by name)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float | int = 1.0
    top_p: float | int = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's log-prob given the tokens before it, and the k most likely there."""
    echo: bool = False

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs_range(cls, value: int | None, info) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"{info.field_name} must be in [0, 20], got {value}")
        return value

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream: true")
        return self

    def sampling_params(self, end_of_turn: tuple[int, ...] = ()) -> SamplingParams:
        """Our SamplingParams (ValueError names the bad field); stops at `end_of_turn` (the
        model's EOS tokens) unless ignore_eos."""
        return sampling_params(n=self.n, max_tokens=self.max_tokens, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                               stop_token_ids=self.stop_ids(end_of_turn))


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): the served tokenizer's ids of a text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


async def prompt_logprobs_of(request: Any, state: Any, served: Any, prompts: list[list[int]], k: int):
    """`ModelSlot.prompt_logprobs` off the event loop, under the request's deadline."""
    work = asyncio.to_thread(state.slot.prompt_logprobs, served, prompts, k)
    return await until_answered(request, work, state.limits.request_timeout_s)


class ReloadRequest(BaseModel):
    """POST /update_weights_from_disk (SGLang's shape; its other fields are accepted, unused)."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    weight_version: str | None = None
    """The policy version the loaded weights answer as (an integer, as text, SGLang's field): the
    trainer's count, which a checkpoint of another phase (SFT's step 100 synced as RL's version 0)
    does not hold. Unset: the checkpoint's own `policy_version`."""


def weight_version(text: str | None) -> int | None:
    """`weight_version` as a policy version; RequestError (a 400) for text that is not a whole
    number >= 0 in ASCII digits, at most 18 of them ("²" passes str.isdigit and a 5,000-digit
    number int's limit: both were a 500)."""
    if text is None:
        return None
    if not re.fullmatch(r"[0-9]{1,18}", text.strip()):
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        raise RequestError(f"weight_version must be a whole number >= 0 of at most 18 digits, got {shown!r}")
    return int(text)


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """`<|im_end|>` and the eos token, where the tokenizer has them: where generation stops
    unless a request sets ignore_eos (vLLM stops at the model's EOS tokens likewise)."""
    ids = [tokenizer.get_vocab().get("<|im_end|>"), tokenizer.eos_token_id]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))


def sampling_params(*, n: int, max_tokens: int, temperature: float, top_p: float, top_k: int,
                    seed: int | None, stop_token_ids: list[int] | None) -> SamplingParams:
    """OpenAI sampling fields as SamplingParams; ValueError naming the field for values the
    engine cannot sample with (temperature 0 = greedy)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}: "
                         "smaller ones overflow the log-probs")
    if top_k < -1:
        raise ValueError(f"top_k must be -1, 0 (off) or positive, got {top_k}")
    if seed is not None and not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    greedy = temperature == 0
    return SamplingParams(
        n=n,
        temperature=1.0 if greedy else float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        max_new_tokens=max_tokens,
        stop_token_ids=tuple(stop_token_ids or ()),
        seed=seed,
        greedy=greedy,
    )


def prompt_token_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt of a request; RequestError for empty or out-of-vocabulary ones."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt is empty")
    out = []
    for i, p in enumerate(prompts):
        ids = tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise RequestError(f"prompt[{i}] is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def resolve_model_path(model_path: Any, allow_root: Path) -> Path:
    """The resolved checkpoint folder, if inside `allow_root` (symlinks resolved first).

    RequestError 403 for any path outside the root, whether it exists or not (the answer must
    not tell a client what exists outside); 400 for a missing or non-folder path inside it.
    """
    if not isinstance(model_path, str) or not model_path or "\x00" in model_path:
        raise RequestError("model_path must be a non-empty string")
    try:
        resolved = Path(model_path).resolve(strict=False)  # follows the symlinks that exist
    except (OSError, RuntimeError):
        resolved = None
    if resolved is None or not resolved.is_relative_to(allow_root):
        raise RequestError(f"model_path {model_path!r} is outside the allowed root {str(allow_root)!r}", 403)
    if not resolved.exists():
        raise RequestError(f"model_path {model_path!r} does not exist")
    if not resolved.is_dir():
        raise RequestError(f"model_path {model_path!r} is not a directory")
    return resolved
