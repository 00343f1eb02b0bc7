"""Model-based rewards: a sequence-classification reward model, or an LLM judge through an engine,
composed with an environment's own (function) reward.

    scorer = ClassifierReward.from_dir("rm/")                          # AutoModelForSequenceClassification
    judge = JudgeReward(engine, tokenizer)                             # any engines/base.py Engine
    env = WithModelRewards(base_env, {"rm": (scorer, 0.5), "judge": (judge, 1.0)}, env_weight=1.0)
    results = env.reward_batch(examples, transcripts)                  # one forward / generate per batch

A model reward is a `BatchScorer`: `score(examples, transcripts) -> list[float]`, called once per
batch (the score stage passes all of a round's rollouts). The composed reward is
`env_weight * env.reward + sum(weight * model score)`; every part is a named component
(`scores.components`: the env's own components, plus one per model reward), so SQL can compare
them. A scorer that raises marks each row of the batch with the error (reward 0), like a
function reward that raises (envs/rewards.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.envs.base import Environment, Example, Messages, RewardResult, prompt_messages
from rlpipe.envs.rewards import format_traceback


class BatchScorer(Protocol):
    def score(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[float]: ...


def transcript_messages(example: Example, transcript: str | Messages) -> Messages:
    """The whole conversation: a multi-turn transcript as is, else the prompt and the completion."""
    if isinstance(transcript, list):
        return [dict(m) for m in transcript]
    return prompt_messages(example) + [{"role": "assistant", "content": transcript}]


def render_plain(messages: Messages) -> str:
    """"role: content" lines, for tokenizers without a chat template."""
    return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in messages)


@dataclass
class ClassifierReward:
    """A Hugging Face sequence-classification model as a reward.

    num_labels == 1: the score is the logit (a Bradley-Terry reward model). Otherwise the
    probability of `label` (an index or a name in config.label2id).
    """

    model: Any
    tokenizer: Any
    label: int | str | None = None
    batch_size: int = 16
    max_length: int = 1024
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra variables of the classifier's chat template (envs/config.py `chat_template_kwargs`)."""

    @classmethod
    def from_dir(cls, path: str | Path, **options: Any) -> ClassifierReward:
        from rlpipe.models.loading import resolve_model_path  # a folder or a hub id, as model.path
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_model_path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"reward model directory {str(path)!r} has no config.json")
        model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        return cls(model, AutoTokenizer.from_pretrained(str(path)), **options)

    def _label_index(self) -> int | None:
        n = int(self.model.config.num_labels)
        if n == 1:
            return None
        if isinstance(self.label, str):
            mapping = self.model.config.label2id or {}
            if self.label not in mapping:
                raise ValueError(f"reward model has no label {self.label!r}; labels: {sorted(mapping)}")
            return int(mapping[self.label])
        index = n - 1 if self.label is None else int(self.label)
        if not 0 <= index < n:
            raise ValueError(f"label index {index} outside the model's {n} labels")
        return index

    def texts(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[str]:
        out = []
        for example, transcript in zip(examples, transcripts, strict=True):
            messages = transcript_messages(example, transcript)
            if getattr(self.tokenizer, "chat_template", None):
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False, **self.template_kwargs))
            else:
                out.append(render_plain(messages))
        return out

    def score(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[float]:
        texts = self.texts(examples, transcripts)
        index = self._label_index()
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length, add_special_tokens=False)
                enc = {k: v.to(self.model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
                logits = self.model(**enc).logits.float()
                values = logits[:, 0] if index is None else logits.softmax(-1)[:, index]
                scores += [float(v) for v in values]
        return scores


JUDGE_PROMPT = (
    "Rate the assistant's last reply from 0 (useless or wrong) to 10 (perfect). Answer with the "
    "number only.\n\n{conversation}"
)
_FIRST_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass
class JudgeReward:
    """An LLM judge: a greedy reply to `prompt` per transcript, its first number / `scale`.

    A reply without a number, or with one above `scale`, scores 0 (the judge's fault is the
    policy's zero, as with a malformed completion). One `engine.generate` call per batch.
    """

    engine: Engine
    tokenizer: Any
    prompt: str = JUDGE_PROMPT
    scale: float = 10.0
    max_new_tokens: int = 8
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra variables of the judge's chat template (envs/config.py `chat_template_kwargs`)."""

    def judge_prompts(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[list[int]]:
        from rlpipe.models.chat import template_ids

        prompts = []
        for example, transcript in zip(examples, transcripts, strict=True):
            text = self.prompt.format(conversation=render_plain(transcript_messages(example, transcript)))
            prompts.append(template_ids(self.tokenizer, [{"role": "user", "content": text}],
                                        add_generation_prompt=True, **self.template_kwargs))
        return prompts

    def parse(self, text: str) -> float:
        found = _FIRST_NUMBER.search(text)
        value = float(found.group()) if found else 0.0
        return value / self.scale if value <= self.scale else 0.0

    def score(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[float]:
        ends = tuple(i for i in {self.tokenizer.eos_token_id, self.tokenizer.get_vocab().get("<|im_end|>")}
                     if isinstance(i, int))
        params = SamplingParams(n=1, greedy=True, max_new_tokens=self.max_new_tokens, stop_token_ids=ends, seed=0)
        replies = self.engine.generate(self.judge_prompts(examples, transcripts), params)
        return [self.parse(self.tokenizer.decode(c.tokens, skip_special_tokens=True)) for (c,) in replies]


class WithModelRewards:
    """An environment whose reward adds weighted model rewards to its own (see module docstring).

    Everything but the reward is the wrapped environment's (examples, reset, step, max_turns...).
    """

    def __init__(self, env: Environment, scorers: dict[str, tuple[BatchScorer, float]],
                 env_weight: float = 1.0) -> None:
        if not scorers:
            raise ValueError("WithModelRewards needs at least one model reward")
        self.env, self.scorers, self.env_weight = env, dict(scorers), float(env_weight)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        return self.reward_batch([example], [transcript])[0]

    def reward_batch(self, examples: Sequence[Example], transcripts: Sequence[str | Messages]) -> list[RewardResult]:
        """One RewardResult per (example, transcript); each model scores the batch once."""
        base = []
        for example, transcript in zip(examples, transcripts, strict=True):
            try:
                base.append(self.env.reward(example, transcript))
            except Exception as exc:  # noqa: BLE001 - recorded like a function reward that raised
                base.append(RewardResult(0.0, {}, format_traceback(exc)))
        parts: dict[str, list[float]] = {}
        error = None
        for name, (scorer, _weight) in self.scorers.items():
            try:
                values = scorer.score(examples, transcripts)
            except Exception as exc:  # noqa: BLE001 - a failing reward model fails its rows, by name
                error = f"model reward {name!r} raised:\n{format_traceback(exc)}"
                break
            if len(values) != len(examples):
                raise ValueError(f"model reward {name!r} returned {len(values)} scores for {len(examples)}")
            parts[name] = values
        out = []
        for i, result in enumerate(base):
            if error is not None or result.error is not None:
                out.append(RewardResult(0.0, result.components, result.error or error))
                continue
            components = {**result.components, "env": float(result.reward)}
            total = self.env_weight * float(result.reward)
            for name, (_scorer, weight) in self.scorers.items():
                components[name] = parts[name][i]
                total += weight * parts[name][i]
            out.append(RewardResult(total, components))
        return out


def build_scorer(spec: Any, template_kwargs: Mapping[str, Any] | None = None) -> BatchScorer:
    """A scorer from a `task.reward_models` entry (envs/config.py RewardModelConfig); its chats
    render with its own chat_template_kwargs, else `template_kwargs` (model.chat_template_kwargs)."""
    own = getattr(spec, "chat_template_kwargs", None)
    kwargs = dict(own if own is not None else template_kwargs or {})
    if spec.type == "classifier":
        return ClassifierReward.from_dir(spec.path, label=spec.label, batch_size=spec.batch_size,
                                         template_kwargs=kwargs)
    if spec.type == "judge":
        from rlpipe.engines.torch_engine import TorchEngine
        from rlpipe.models.loading import load_model
        from rlpipe.models.tokenizer import load_tokenizer

        try:
            model = load_model(spec.path)  # a folder or a hub id, resolved as model.path is
        except ValueError as error:
            raise ValueError(f"judge model: {error}") from None
        engine = TorchEngine(model.eval())
        return JudgeReward(engine, load_tokenizer(spec.path), prompt=spec.prompt or JUDGE_PROMPT,
                           template_kwargs=kwargs)
    raise ValueError(f"unknown reward model type {spec.type!r}; expected classifier or judge")
