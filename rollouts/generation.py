"""Stage `generate`: prompts → n completions each → the `rollouts` table.

One row per completion. `group_id` and `sample_id` derive from (run, step, attempt, group,
index) and never from a clock, so a resumed stage rewrites the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.envs.base import Environment, Example
from rlpipe.models.chat import (
    ThinkTags,
    split_thinking_tokens,
    template_ids,
    think_tags,
)
from rlpipe.rollouts.distill import with_teacher
from rlpipe.rollouts.records import Rollout
from rlpipe.storage.stage_tables import StageTable, stage


class PromptTooLongError(ValueError):
    """A prompt that cannot fit the model's context together with its completion."""


def group_id_for(run_id: str, step: int, attempt: int, index: int) -> str:
    """The id of a round's `index`-th group (prompt)."""
    return f"{run_id}:s{step:06d}:a{attempt}:g{index:04d}"


def step_of_group(group_id: str) -> int:
    """The step that sampled a group, read back from its id (`group_id_for`)."""
    return int(group_id.rsplit(":", 3)[1][1:])


def sample_id_for(group_id: str, index: int) -> str:
    """The id of a group's `index`-th completion."""
    return f"{group_id}:{index:03d}"


def sample_seed(seed: int, step: int, attempt: int) -> int:
    """A seed for one sampling round, independent of wall clock and process."""
    return (seed * 1_000_003 + step * 1_009 + attempt) % (2**31 - 1)


@dataclass(frozen=True)
class GenerateOptions:
    """How a run samples its rollouts (built once per run from rl.sampling and the model)."""

    sampling: SamplingParams
    """Completions per prompt, temperature, top-p/k, max_new_tokens, stop tokens, seed."""
    max_context: int
    """The model's context: a prompt plus its completion must fit."""
    seed: int = 0
    """The run's seed; each sampling round's seed derives from it (`for_round`)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """model.chat_template_kwargs: given to every rendering of a prompt."""
    teacher: Any = None
    """On-policy distillation (rl.teacher): scores every sampled token (rollouts/distill.py `Teacher`)."""

    def for_round(self, step: int, attempt: int) -> GenerateOptions:
        """These options with the sampling seed of one round (`sample_seed`)."""
        return replace(self, sampling=sampling_for_step(self.sampling, self.seed, step, attempt))


@dataclass(frozen=True)
class SampleRound:
    """Which sampling round the rows are of: their run, step, attempt and policy version."""

    run_id: str
    step: int
    attempt: int
    policy_version: int
    first_group_index: int = 0
    """The index of the round's first group (prompt) within the round's ids."""

    def group_id(self, index: int) -> str:
        """The id of this round's `index`-th group, counted from `first_group_index`."""
        return group_id_for(self.run_id, self.step, self.attempt, self.first_group_index + index)


def encode_messages(tokenizer: Any, messages: list[dict],
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Prompt token ids of a chat, ending with the assistant generation prompt: exactly the
    context SFT trains an assistant turn in (models/chat.py `chat_segments`), same kwargs."""
    return template_ids(tokenizer, messages, add_generation_prompt=True, **(template_kwargs or {}))


def encode_prompts(
    tokenizer: Any, env: Environment, examples: list[Example], max_context: int, max_new_tokens: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of each example's first turn; refuses prompts that leave no room to answer."""
    prompts = []
    for example in examples:
        tokens = encode_messages(tokenizer, env.reset(example), template_kwargs)
        if len(tokens) + max_new_tokens > max_context:
            raise PromptTooLongError(
                f"prompt of example {example.env}/{example.example_id} has {len(tokens)} tokens; "
                f"with max_new_tokens={max_new_tokens} it exceeds the model context of {max_context}"
            )
        prompts.append(tokens)
    return prompts


def generate_rollouts(
    engine: Engine | list[Engine],
    tokenizer: Any,
    env: Environment,
    examples: list[Example],
    options: GenerateOptions,
    sample_round: SampleRound,
) -> list[Rollout]:
    """Sample `options.sampling.n` completions per example (with `options.sampling` as given, its
    seed included); one row per completion (per episode when the environment is multi-turn:
    envs/multiturn.py)."""
    if getattr(env, "max_turns", 1) > 1:
        return _episode_rows(engine, tokenizer, env, examples, options, sample_round)
    params, ids = options.sampling, sample_round
    prompts = encode_prompts(tokenizer, env, examples, options.max_context, params.max_new_tokens,
                             options.template_kwargs)
    completions = generate_spread(engine if isinstance(engine, list) else [engine], prompts, params)
    tags = think_tags(tokenizer)
    rows = []
    for index, (example, prompt, group) in enumerate(zip(examples, prompts, completions, strict=True)):
        group_id = ids.group_id(index)
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
        for j, completion in enumerate(group):
            rows.append(
                Rollout(
                    run_id=ids.run_id, step=ids.step, policy_version=ids.policy_version, env=example.env,
                    example_id=example.example_id, group_id=group_id, sample_id=sample_id_for(group_id, j),
                    attempt=ids.attempt, prompt_tokens=prompt, completion_tokens=list(completion.tokens),
                    completion_logprobs=[float(x) for x in completion.logprobs],
                    finish_reason=completion.finish_reason, prompt_text=prompt_text,
                    completion_text=tokenizer.decode(completion.tokens, skip_special_tokens=True),
                    n_prompt_tokens=len(prompt), n_completion_tokens=len(completion.tokens),
                    **thinking_fields(tokenizer, prompt, list(completion.tokens), tags),
                    **version_span(completion.versions, ids.policy_version),
                )
            )
    return rows


def version_span(versions: list[int] | None, policy_version: int) -> dict[str, int]:
    """`first_policy_version` and `last_policy_version` of a completion whose tokens were sampled
    by `versions` (partial rollouts); the round's `policy_version` for both when the engine does
    not tell (one version sampled it all) or it has no token."""
    if not versions:
        return {"first_policy_version": policy_version, "last_policy_version": policy_version}
    return {"first_policy_version": min(versions), "last_policy_version": max(versions)}


def thinking_budget(tokenizer: Any, max_thinking_tokens: int) -> dict[str, Any]:
    """The SamplingParams fields of rl.sampling.max_thinking_tokens (none when 0); ValueError
    when the tokenizer has no `<think>` / `</think>` tokens to keep a budget with."""
    if not max_thinking_tokens:
        return {}
    tags = think_tags(tokenizer)
    if tags is None:
        raise ValueError("rl.sampling.max_thinking_tokens needs a tokenizer with <think> and </think> "
                         "tokens; this model's tokenizer has none")
    return {"max_thinking_tokens": max_thinking_tokens, "think_ids": (tags.start, tags.end)}


def thinking_fields(tokenizer: Any, prompt: list[int], completion: list[int],
                    tags: ThinkTags | None) -> dict[str, Any]:
    """A completion's reasoning and answer told apart (models/chat.py `split_thinking_tokens`):
    `thinking_tokens`, `answer_tokens` and `answer_text`, the text its reward sees (what follows
    `</think>`; '' when cut inside its reasoning; the whole completion without a reasoning block)."""
    split = split_thinking_tokens(prompt, completion, tags)
    answer = tokenizer.decode(completion[split.thinking_tokens:], skip_special_tokens=True)
    return {"thinking_tokens": split.thinking_tokens, "answer_tokens": split.answer_tokens,
            "answer_text": answer.strip()}


def _episode_rows(engine, tokenizer, env, examples, options: GenerateOptions, ids: SampleRound) -> list[Rollout]:
    from rlpipe.envs.multiturn import episode_fields, run_episodes

    engines = engine if isinstance(engine, list) else [engine]
    share = -(-len(examples) // len(engines))  # contiguous shares, as generate_spread
    chunks = [examples[i:i + share] for i in range(0, len(examples), share)]

    def episodes(one: Engine, chunk: list[Example]):
        return run_episodes(one, tokenizer, env, chunk, options.sampling, max_turns=env.max_turns,
                            max_tokens=options.max_context, context=getattr(env, "rollout_context", "tokens"),
                            template_kwargs=options.template_kwargs)

    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        groups = [g for part in pool.map(episodes, engines, chunks) for g in part]
    rows = []
    for index, (example, group) in enumerate(zip(examples, groups, strict=True)):
        group_id = ids.group_id(index)
        for j, episode in enumerate(group):
            rows.append(Rollout(run_id=ids.run_id, step=ids.step, policy_version=ids.policy_version, env=example.env,
                                example_id=example.example_id, group_id=group_id,
                                sample_id=sample_id_for(group_id, j), attempt=ids.attempt,
                                **episode_fields(episode, tokenizer),
                                **version_span(episode.versions, ids.policy_version)))
    return rows


def sampling_for_step(params: SamplingParams, seed: int, step: int, attempt: int) -> SamplingParams:
    """`params` with the seed of one sampling round (`sample_seed`)."""
    return replace(params, seed=sample_seed(seed, step, attempt))


def generate_spread(engines: list[Engine], prompts: list[list[int]], params: SamplingParams):
    """Spread prompts over engines in contiguous shares, generated in parallel, order kept."""
    if len(engines) == 1:
        return engines[0].generate(prompts, params)
    share = -(-len(prompts) // len(engines))
    chunks = [prompts[i:i + share] for i in range(0, len(prompts), share)]
    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        # map stops at the shorter list: with fewer prompts than engines, some engines rest
        parts = list(pool.map(lambda engine, chunk: engine.generate(chunk, params), engines, chunks))
    return [group for part in parts for group in part]


def _stored_round(rows: list[dict], arguments: dict) -> list[Rollout] | None:
    """The round's rollouts when a resumed step's partition already holds them, for every
    prompt of the round (a step split by environment is written one file per environment: a
    kill between them leaves a round some environments lack, which is sampled again)."""
    done = [Rollout.from_row(row) for row in rows if row["attempt"] == arguments["attempt"]]
    if {(r.env, r.example_id) for r in done} != {(e.env, e.example_id) for e in arguments["examples"]}:
        return None
    return done


ROLLOUTS = StageTable(
    "rollouts", rows=lambda new, a: [r.row() for r in a["previous"] + new], read_back=_stored_round,
    known=lambda a: len(a["previous"]))
"""The step's partition holds every round so far: the earlier ones (`previous`) and this one."""


@stage("generate", tables=(ROLLOUTS,))
def generate_stage(
    engines: list[Engine], tokenizer: Any, env: Environment, examples: list[Example],
    options: GenerateOptions, *, previous: list[Rollout], run_dir: Path, run_id: str, step: int,
    attempt: int, policy_version: int,
) -> list[Rollout]:
    """Rollouts of one sampling round; the table holds every round of the step so far.

    A round already in the table (a resumed step) is read back, not sampled again. With a
    teacher, each row holds its log-prob of every completion token (`teacher_logprobs`).
    """
    rows = generate_rollouts(engines, tokenizer, env, examples, options.for_round(step, attempt),
                             SampleRound(run_id, step, attempt, policy_version))
    return rows if options.teacher is None else with_teacher(rows, options.teacher)
