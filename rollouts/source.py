"""The rollout source: one call per training step returns that step's batch of scored, selected
rollouts with their advantages.

    source = RolloutSource(options, prompts, buffer, stages, start_step=0, published_version=0)
    with source:
        batch = source.batch(step)       # StepBatch: samples to pack, metrics, data_state
        ...train...
        with source.syncing(version):    # engines take new weights between sampling rounds
            sync(engines)                # (the producer waits; later rounds record `version`)

Behind it: sampling rounds (generate and score stages, injected as `RolloutStages`), the
over-sampling buffer (rollouts.group_buffer: zero-variance filter, carry-over, max-attempts guard,
partial batches; its batch maker, rollouts.batch_makers, keeps the valid groups and makes the batch) and the filter/advantages stage, which decides each group and completion once
(rollouts/fates.py `select_step`: trained, carried or dropped and why), computes the advantages
and records them. `options` are the `[rl]` fields it reads (rollouts/options.py).

`rl.off_policy.max_steps = k`:
- k = 0: `batch(step)` fills the step's batch inline from the current weights (on-policy).
- k >= 1: a producer thread fills the batches of the next steps while the trainer trains. It fills
  step t only once the engines sample from a policy version >= t - 1 - k (`publish`), so every
  fresh sample trained at step t lags at most k versions; carried groups are bounded by the buffer
  (rollouts.group_buffer.staleness_limit). The producer writes its tables (rollouts, scores,
  groups, advantages) for steps ahead of the trainer; after a kill, resume replays those steps
  from the checkpoint's data_state and reads the sampled rounds back from the tables.
- `partial_rollouts` (k >= 1): `syncing` does not wait for the round in flight; the engine
  (engines/snapshot.py) continues it with the new weights. A round's rows keep the version it
  started from as `policy_version` (<= the version of every token, so the bound holds for the
  oldest token) and record `first_policy_version` / `last_policy_version`.

Nothing here imports Prefect: the stages come in as plain callables.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlpipe.core import metric_names as m
from rlpipe.core.timing import Stopwatch
from rlpipe.rollouts.advantages import AdvantageOptions, Group, make_groups
from rlpipe.rollouts.curriculum import Curriculum, CurriculumOptions, curriculum_metrics
from rlpipe.rollouts.env_metrics import env_metrics
from rlpipe.rollouts.fates import (
    DropOptions,
    Fill,
    Selection,
    cut_in_thinking,
    fate_metrics,
    over_cap,
    sample_drop,
    user_filter,
)
from rlpipe.rollouts.group_buffer import BatchFillError, GroupBuffer
from rlpipe.rollouts.records import Rollout, Score, TrainSample

if TYPE_CHECKING:
    from rlpipe.envs.base import Example
    from rlpipe.envs.prompts import PromptSource
    from rlpipe.rollouts.options import RolloutOptions


@dataclass
class StepBatch:
    """What a training step gets from the source."""

    step: int
    samples: list[TrainSample]
    """The completions to train on (groups taken from the buffer), in order."""
    metrics: dict[str, float]
    """rollout/* metrics of the batch (names from core.metric_names)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of the generate, score and filter stages that filled it."""
    state: dict[str, Any] = field(default_factory=dict)
    """Prompt order and buffer right after this batch: the checkpoint's data_state."""


class RolloutStages(Protocol):
    """The stages a sampling round and the selection run (tasks/, bound to the run)."""

    def generate(self, examples: list[Example], *, step: int, attempt: int, policy_version: int,
                 previous: list[Rollout]) -> list[Rollout]: ...

    def score(self, examples: dict[str, Example], rollouts: list[Rollout], *, step: int,
              previous: list[Score]) -> list[Score]: ...

    def select(self, fill: Fill, rows: dict[str, Rollout], options: AdvantageOptions, *, step: int,
               empty: bool) -> Selection:
        """The filter/advantages stage: decide the step (rollouts/fates.py `select_step`; `rows`
        may lack the rows of groups carried across a resume) and record the decision; `empty`:
        no sampling round ran at the step."""


class RolloutSource:
    """Fills each step's batch (see the module docstring); `with` starts and stops the producer."""

    def __init__(self, options: RolloutOptions, prompts: PromptSource, buffer: GroupBuffer,
                 stages: RolloutStages, *, start_step: int, published_version: int,
                 curriculum: Curriculum | None = None) -> None:
        self.options, self.prompts, self.buffer, self.stages = options, prompts, buffer, stages
        # which prompts a round samples (rollouts/curriculum.py); off: the stream as it comes
        self.curriculum = curriculum if curriculum is not None else Curriculum(CurriculumOptions())
        if options.drops.sample_filter:
            user_filter(options.drops.sample_filter)  # a bad spec fails here, before any sampling
        self.ahead = options.max_off_policy_steps
        self._examples: dict[str, Example] = {}
        self._rows: dict[str, Rollout] = {}
        self._next = start_step + 1
        self._ready: dict[int, StepBatch | BaseException] = {}
        self._published = published_version
        self._cond = threading.Condition()
        # held by each sampling round and by `syncing`: a round samples from one policy version,
        # the one it records (an HTTP server reloaded mid-round mixed versions in a completion)
        self._round = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the consumer side
    def __enter__(self) -> RolloutSource:
        if self.ahead > 0:
            run = contextvars.copy_context().run  # stages see the flow's writer and task-run choice
            self._thread = threading.Thread(target=run, args=(self._produce_ahead,), name="rollouts",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def batch(self, step: int) -> StepBatch:
        """The batch that trains `step` (blocks until the producer has it when running ahead)."""
        if self._thread is None:
            return self._produce(step)
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready)
            result = self._ready.pop(step)
        if isinstance(result, BaseException):
            raise result
        return result

    def publish(self, version: int) -> None:
        """The engines now sample from `version` (after a sync)."""
        with self._cond:
            self._published = version
            self._cond.notify_all()

    @contextlib.contextmanager
    def syncing(self, version: int):
        """Change the engines' weights inside: it waits for a sampling round in flight, none
        starts meanwhile, and `version` is published before the next one does. With partial
        rollouts it does not wait: the engine takes the weights between two decode steps of the
        round in flight, whose completions record each token's version."""
        with contextlib.nullcontext() if self.options.partial_rollouts else self._round:
            yield
            self.publish(version)

    # ------------------------------------------------------------------ the producer side
    def _produce_ahead(self) -> None:
        step = self._next
        while step <= self.options.steps:
            with self._cond:
                # at most `ahead` batches waiting, and weights recent enough for the bound
                self._cond.wait_for(lambda: self._stop or (
                    len(self._ready) <= self.ahead and self._published >= step - 1 - self.ahead))  # noqa: B023
                if self._stop:
                    return
            try:
                result: StepBatch | BaseException = self._produce(step)
            except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
                result = error
            with self._cond:
                self._ready[step] = result
                self._cond.notify_all()
            if isinstance(result, BaseException):
                return
            step += 1

    def _produce(self, step: int) -> StepBatch:
        """Fill the batch of `step` from the engines' current weights (the one fill path, both
        modes); each round records the version it sampled from."""
        watch = Stopwatch()
        sampled: list[Rollout] = []
        scored: list[Score] = []
        drops: list[tuple[Rollout, str, str]] = []  # left out before grouping: (rollout, status, reason)
        rested: list[dict] = []  # the curriculum's rows: resting prompts skipped or re-tested

        def sample_round(attempt: int, n_prompts: int) -> list[Group]:
            examples, rows = self.curriculum.choose(self.prompts.next_batch, n_prompts, step=step, attempt=attempt)
            rested.extend(rows)
            self._examples.update({e.example_id: e for e in examples})
            with self._round, watch("generate"):
                new = self.stages.generate(examples, step=step, attempt=attempt,
                                           policy_version=self._published, previous=sampled)
            with watch("score"):
                new_scores = self.stages.score(self._examples, new, step=step, previous=scored)
            sampled.extend(new)
            scored.extend(new_scores)
            self.curriculum.observe(new, new_scores)
            self._rows.update({r.sample_id: r for r in new})
            return _groups(new, new_scores, self.options.drops, attempt, drops)

        train_version = (step - 1) * self.options.ppo_epochs
        try:
            decisions = self.buffer.fill(train_version, sample_round)
        except BatchFillError as error:  # record what the failed rounds sampled, then fail the step
            buffer = self.options.buffer
            failed = over_cap(getattr(error, "decisions", []),
                              f"step {step} used rl.buffer.max_attempts={buffer.max_attempts} sampling rounds without "
                              f"filling its batch of {buffer.prompts_per_step} groups; the run stopped")
            selection = self.stages.select(Fill([], failed, drops, rested), self._rows, self.options.advantages,
                                           step=step, empty=not sampled)
            error.metrics = fate_metrics(selection.decisions, self.buffer.pending)
            cut = all_cut_message(sampled, self.options.drops.max_new_tokens)
            if cut is None:
                raise
            plain = BatchFillError(f"step {step} could not fill its batch: {cut}")
            plain.decisions, plain.metrics = getattr(error, "decisions", []), error.metrics
            raise plain from None
        with watch("filter"):
            batch, metrics = self.buffer.take()
            selection = self.stages.select(Fill(batch, decisions, drops, rested), self._rows, self.options.advantages,
                                           step=step, empty=not sampled)
            metrics |= fate_metrics(selection.decisions, self.buffer.pending)
        keep = {sid for group in self.buffer.pending for sid in group.sample_ids}
        self._rows = {sid: row for sid, row in self._rows.items() if sid in keep}
        metrics |= _sampling_metrics(sampled, scored, batch, train_version)
        if self.curriculum.options.enabled:
            metrics |= curriculum_metrics(rested)
        if getattr(self.prompts, "names", None):  # a mixture: rollout/<env>/* (rollouts/env_metrics.py)
            metrics |= env_metrics(sampled, scored)
        return StepBatch(step=step, samples=selection.samples, metrics=metrics, seconds=watch.seconds,
                         state={"prompts": self.prompts.state_dict(), "buffer": self.buffer.state_dict()})


def all_cut_message(sampled: list[Rollout], max_new_tokens: int) -> str | None:
    """Why a batch could not fill when most of its completions (half or more) were cut at the
    token limit, None otherwise: their rewards are those of missing answers, so easier or harder
    prompts cannot help; the budget, counted in the model's tokens, is what is short."""
    cut = [r for r in sampled if r.finish_reason == "length"]
    if not cut or 2 * len(cut) < len(sampled):
        return None
    answered = sum(r.finish_reason != "length" and bool(r.completion_text if r.answer_text is None else r.answer_text)
                   for r in sampled)
    thinking = sum(bool(r.thinking_tokens) for r in cut)
    return (f"{len(cut)} of {len(sampled)} completions were cut at rl.sampling.max_new_tokens={max_new_tokens} "
            f"tokens ({thinking} of them after spending tokens on a <think> block); {answered} finished with an "
            "answer. Raise rl.sampling.max_new_tokens (it counts the model's tokens, reasoning included; a budget "
            "set for the character tokenizer is far too small for a BPE one), set rl.sampling.max_thinking_tokens, "
            "or turn thinking off (model.chat_template_kwargs = { enable_thinking = false })")


def _groups(rollouts: list[Rollout], scores: list[Score], options: DropOptions, attempt: int,
            drops: list[tuple[Rollout, str, str]]) -> list[Group]:
    """A round's groups of scored completions; those left out first (reward errors, truncation,
    the user filter: rollouts/fates.py) are appended to `drops` as (rollout, status, reason)."""
    kept = []
    for r, score in zip(rollouts, scores, strict=True):
        drop = sample_drop(r, score, options)
        if drop is not None:
            drops.append((r, *drop))
            continue
        kept.append({"group_id": r.group_id, "env": r.env, "example_id": r.example_id,
                     "policy_version": r.policy_version, "sample_id": r.sample_id, "reward": score.reward})
    return make_groups(kept, attempt)


def _sampling_metrics(sampled: list[Rollout], scored: list[Score], batch: list[Group],
                      train_version: int) -> dict[str, float]:
    out: dict[str, float] = {m.KEPT_GROUPS: float(len(batch))}
    rewards = [r for g in batch for r in g.rewards]
    out[m.REWARD_MEAN] = sum(rewards) / max(len(rewards), 1)
    lags = [train_version - g.policy_version for g in batch]
    out[m.LAG_MEAN] = sum(lags) / max(len(lags), 1)
    out[m.LAG_MAX] = float(max(lags, default=0))
    out[m.REWARD_ERRORS] = float(sum(s.error is not None for s in scored))  # 0 in a step served from carry
    if sampled:  # means of what this step sampled: none when carried groups filled the batch
        out[m.COMPLETION_LENGTH] = sum(r.n_completion_tokens for r in sampled) / len(sampled)
        split = [r for r in sampled if r.thinking_tokens is not None]  # single-turn rollouts
        if split:
            out[m.THINKING_LENGTH] = sum(r.thinking_tokens for r in split) / len(split)
            out[m.ANSWER_LENGTH] = sum(r.answer_tokens for r in split) / len(split)
            out[m.CUT_IN_THINKING] = float(sum(cut_in_thinking(r) for r in split))
        out[m.REWARD_MEAN_ALL] = sum(s.reward for s in scored) / len(scored)
    return out

