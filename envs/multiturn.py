"""The multi-turn rollout loop: reset → generate → env.step → observation appended → ... → done.

    episodes = run_episodes(engine, tokenizer, env, examples, params, max_turns=4, max_tokens=512)

A pure function over an engine (engines/base.py) and an environment (envs/base.py); every
active episode's next turn is sampled in one `engine.generate` call per turn.

Token fidelity (the bug reports of every multi-turn trainer are about this):
- The episode's token stream is the first prompt, then each turn's *sampled* token ids, then the
  environment's tokens. Model output is decoded only to show it to the environment; it is never
  re-encoded, so the trained tokens are exactly the sampled ones, with the engine's log-probs.
- Environment tokens are what the chat template renders after the assistant's end-of-turn token
  for the appended messages, up to the next generation prompt (found by counting end-of-turn
  tokens, so a template that re-renders earlier turns — Qwen3 dropping old `<think>` blocks —
  still yields the right suffix). They carry loss weight 0.
- The context of turn k (`context="tokens"`, the default) is the stream so far: the tokens the
  model actually saw and wrote.
- `context="template"` builds each turn's context the way the chat template renders the
  conversation at that point, as the SFT data does (models/chat.py): for Qwen3, earlier `<think>`
  blocks are dropped once a new user query arrives. Where that rendering extends the stream, the
  difference is the environment's span; where it rewrites earlier tokens, a "context" span holds
  the whole new rendering and a new segment starts there (weight 0; the packer trains each segment
  as its own sequence, tasks/pack.py), so every sampled token is trained in the context it was
  sampled in.

An episode ends when the environment says done ("stop"), at `max_turns` ("max_turns"), when a
turn is cut by max_new_tokens, or when the next turn would pass `max_tokens` ("length").
An environment with a `tools` attribute (OpenAI's `tools` shape; envs/mcp_tools.py) has them
rendered by the chat template (`tools=`) in every turn's context.
`turns` records who produced which span of the completion (turn index, producer, start, length,
optional per-turn reward from `StepResult.reward`), so DuckDB answers per-turn questions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.envs.base import Environment, Example, RewardResult
from rlpipe.models.chat import end_of_turn_id, template_ids


@dataclass(frozen=True)
class TurnSpan:
    """A span of an episode's completion tokens (offsets exclude the first prompt).

    turn:     the assistant turn it belongs to (an env span: the turn it answers)
    producer: "model" (sampled, trained), "env" (tool/user reply, weight 0) or "context" (a
              re-rendered context that starts a new segment, weight 0; context="template")
    reward:   per-turn reward the environment gave for that turn (env spans), else None
    """

    turn: int
    producer: str
    start: int
    length: int
    reward: float | None = None


@dataclass
class Episode:
    """One multi-turn rollout."""

    example: Example
    messages: list[dict[str, Any]]
    prompt_tokens: list[int]
    completion_tokens: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    finish_reason: str = "stop"
    done: bool = False
    versions: list[int] = field(default_factory=list)
    """Policy versions of the sampled tokens, where the engine tells (partial rollouts)."""

    @property
    def n_turns(self) -> int:
        return sum(span.producer == "model" for span in self.turns)

    def context(self) -> list[int]:
        """The tokens the next turn is sampled after: the current segment."""
        starts = [span.start for span in self.turns if span.producer == "context"]
        if not starts:
            return self.prompt_tokens + self.completion_tokens
        return self.completion_tokens[starts[-1]:]

    def add(self, producer: str, tokens: list[int], logprobs: list[float] | None,
            reward: float | None = None) -> None:
        turn = self.n_turns - (producer != "model")
        self.turns.append(TurnSpan(turn, producer, len(self.completion_tokens), len(tokens), reward))
        self.completion_tokens += tokens
        self.completion_logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def env_tokens(tokenizer: Any, messages: list[dict], appended: list[dict],
               template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Tokens the template renders for `appended` after the last assistant turn of `messages`,
    through the next generation prompt (the assistant's own end-of-turn token excluded);
    `template_kwargs` (model.chat_template_kwargs) reach every rendering."""
    kwargs = dict(template_kwargs or {})
    end_id = end_of_turn_id(tokenizer)
    if end_id is None:
        raise ValueError("the tokenizer has neither <|im_end|> nor an eos token: cannot find turn ends")
    ends = template_ids(tokenizer, messages, **kwargs).count(end_id)
    full = template_ids(tokenizer, messages + appended, add_generation_prompt=True, **kwargs)
    positions = [i for i, t in enumerate(full) if t == end_id]
    if len(positions) < ends:
        raise ValueError("the chat template renders fewer turn ends once the environment's messages "
                         "are appended; cannot locate the environment's tokens")
    return full[positions[ends - 1] + 1:]


def _turn_seed(params: SamplingParams, turn: int, budget: int) -> int | None:
    if params.seed is None:
        return None
    return (params.seed + 7_919 * turn + 104_729 * budget) % (2**31 - 1)


def _sample_turn(engine: Engine, active: list[Episode], params: SamplingParams, turn: int,
                 max_tokens: int) -> list:
    """One completion per active episode, batched by the room each has left."""
    by_budget: dict[int, list[int]] = {}
    for i, episode in enumerate(active):
        room = min(params.max_new_tokens, max_tokens - len(episode.context()))
        by_budget.setdefault(room, []).append(i)
    out: list = [None] * len(active)
    for budget, members in by_budget.items():
        turn_params = replace(params, n=1, max_new_tokens=budget, seed=_turn_seed(params, turn, budget))
        groups = engine.generate([active[i].context() for i in members], turn_params)
        for i, (completion,) in zip(members, groups, strict=True):
            out[i] = completion
    return out


def _next_context(episode: Episode, tokenizer: Any, appended: list[dict], context: str,
                  template_kwargs: Mapping[str, Any]) -> tuple[str, list[int]]:
    """("env", tokens to append) or ("context", a whole new segment's context)."""
    if context == "tokens":
        return "env", env_tokens(tokenizer, episode.messages, appended, template_kwargs)
    rendered = template_ids(tokenizer, episode.messages + appended, add_generation_prompt=True, **template_kwargs)
    stream = episode.context()
    if rendered[: len(stream)] == stream:
        return "env", rendered[len(stream):]
    return "context", rendered


def _advance(episode: Episode, completion, tokenizer, env: Environment, max_turns: int,
             max_tokens: int, context: str = "tokens", template_kwargs: Mapping[str, Any] | None = None) -> None:
    """Append a sampled turn, let the environment answer, decide whether the episode goes on."""
    episode.add("model", list(completion.tokens), [float(x) for x in completion.logprobs])
    episode.versions.extend(getattr(completion, "versions", None) or [])
    text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
    episode.messages.append({"role": "assistant", "content": text})
    if completion.finish_reason == "length":
        episode.done, episode.finish_reason = True, "length"
        return
    result = env.step(episode.example, episode.messages, text)
    reward = getattr(result, "reward", None)
    if result.done or not result.messages_to_append:
        if reward is not None:  # a last per-turn reward with nothing to append: an empty env span
            episode.add("env", [], None, reward)
        episode.done, episode.finish_reason = True, "stop"
        return
    producer, observation = _next_context(episode, tokenizer, list(result.messages_to_append), context,
                                          dict(template_kwargs or {}))
    episode.messages += list(result.messages_to_append)
    room = max_tokens - (len(observation) if producer == "context" else len(episode.context()) + len(observation))
    if episode.n_turns >= max_turns:
        episode.done, episode.finish_reason = True, "max_turns"
    elif room <= 0:
        episode.done, episode.finish_reason = True, "length"
    if episode.done:
        if reward is not None:
            episode.add("env", [], None, reward)
        return
    if producer == "context" and reward is not None:  # the reward rides on a span of its own
        episode.add("env", [], None, reward)
        reward = None
    episode.add(producer, observation, None, reward)


def run_episodes(
    engine: Engine, tokenizer: Any, env: Environment, examples: list[Example], params: SamplingParams,
    *, max_turns: int, max_tokens: int, context: str = "tokens", template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[Episode]]:
    """`params.n` episodes per example (in order), each run until done, max_turns or max_tokens.

    context: "tokens" (the stream so far) or "template" (the template's rendering; see the
    module docstring). template_kwargs: model.chat_template_kwargs, given to every rendering,
    with the environment's `tools` (if it has any) as the template's `tools=`."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if context not in ("tokens", "template"):
        raise ValueError(f"context must be 'tokens' or 'template', got {context!r}")
    template_kwargs = with_env_tools(env, template_kwargs)
    episodes: list[list[Episode]] = []
    for example in examples:
        messages = env.reset(example)
        prompt = template_ids(tokenizer, messages, add_generation_prompt=True, **(template_kwargs or {}))
        if len(prompt) >= max_tokens:
            raise ValueError(f"prompt of example {example.env}/{example.example_id} has {len(prompt)} "
                             f"tokens, no room left under max_tokens={max_tokens}")
        episodes.append([Episode(example, [dict(m) for m in messages], list(prompt))
                         for _ in range(params.n)])
    flat = [e for group in episodes for e in group]
    turn = 0
    while active := [e for e in flat if not e.done]:
        for episode, completion in zip(active, _sample_turn(engine, active, params, turn, max_tokens),
                                       strict=True):
            _advance(episode, completion, tokenizer, env, max_turns, max_tokens, context, template_kwargs)
        turn += 1
    return episodes


def with_env_tools(env: Environment, template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`template_kwargs` with the environment's tools (its `tools` attribute, OpenAI's shape:
    envs/mcp_tools.py) as the chat template's `tools=`, so the model sees what it may call."""
    kwargs = dict(template_kwargs or {})
    tools = getattr(env, "tools", None)
    if tools:
        kwargs["tools"] = list(tools)
    return kwargs


def transcript_of(messages: str | None, completion_text: str, answer_text: str | None = None) -> str | list[dict]:
    """What the environment judges for a rollout: the messages (JSON) of an episode, else the
    answer (the text after `</think>`, rollouts/generation.py `thinking_fields`), else the text."""
    if messages:
        return json.loads(messages)
    return completion_text if answer_text is None else answer_text


def row_transcript(row: dict) -> str | list[dict]:
    """`transcript_of` a rollouts table row."""
    return transcript_of(row.get("messages"), row["completion_text"], row.get("answer_text"))


def with_turn_rewards(result: RewardResult, turn_rewards: list[float | None]) -> RewardResult:
    """The episode's reward: the environment's judgement plus any per-turn rewards (their sum is
    also the component `turn_rewards`)."""
    extra = [float(r) for r in turn_rewards if r is not None]
    if not extra or result.error is not None:
        return result
    return RewardResult(result.reward + sum(extra), {**result.components, "turn_rewards": sum(extra)},
                        result.error)


def episode_reward(env: Environment, episode_or_row: Episode | dict, example: Example) -> RewardResult:
    """`env.reward` of an episode (or a rollouts row of one) with its per-turn rewards added."""
    if isinstance(episode_or_row, Episode):
        messages, turn_rewards = episode_or_row.messages, [t.reward for t in episode_or_row.turns]
    else:
        messages = row_transcript(episode_or_row)
        turn_rewards = [t["reward"] for t in episode_or_row.get("turns") or []]
    return with_turn_rewards(env.reward(example, messages), turn_rewards)


def episode_fields(episode: Episode, tokenizer: Any) -> dict[str, Any]:
    """The `rollouts` columns an episode fills (ids and versions are the caller's)."""
    return {
        "prompt_tokens": episode.prompt_tokens,
        "completion_tokens": episode.completion_tokens,
        "completion_logprobs": episode.completion_logprobs,
        "finish_reason": episode.finish_reason,
        "prompt_text": tokenizer.decode(episode.prompt_tokens, skip_special_tokens=False),
        # special tokens kept: the turn structure stays visible
        "completion_text": tokenizer.decode(episode.completion_tokens, skip_special_tokens=False),
        "n_prompt_tokens": len(episode.prompt_tokens),
        "n_completion_tokens": len(episode.completion_tokens),
        "n_turns": episode.n_turns,
        "turns": [vars(span).copy() for span in episode.turns],
        "messages": json.dumps(episode.messages),
    }


def segment_bounds(turns: list[dict] | None, n_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each segment of the completion: a "context" span starts a new one."""
    starts = [0] + [span["start"] for span in turns or [] if span["producer"] == "context"]
    return list(zip(starts, starts[1:] + [n_tokens], strict=True))


def model_token_mask(turns: list[dict] | None, n_tokens: int) -> list[bool]:
    """Per completion token, whether the policy sampled it (no `turns`: every token)."""
    if not turns:
        return [True] * n_tokens
    mask = [False] * n_tokens
    for span in turns:
        if span["producer"] == "model":
            mask[span["start"]: span["start"] + span["length"]] = [True] * span["length"]
    return mask
