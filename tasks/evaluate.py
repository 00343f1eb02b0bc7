"""Stage `eval`: greedy completions on held-out prompts, and with `eval.samples = k` k sampled
completions of each (pass@k, maj@k: tasks/pass_at_k.py) → the `evals` table.

Step 0 measures the starting weights (for RL, the SFT checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.core import metric_names as m
from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.envs.base import Environment, Example
from rlpipe.envs.mixture import mixture_of
from rlpipe.models.chat import think_tags
from rlpipe.rollouts.generation import encode_prompts, thinking_budget, thinking_fields
from rlpipe.rollouts.scoring import reward_of
from rlpipe.storage.stage_tables import StageTable, stage
from rlpipe.tasks import pass_at_k


@dataclass(frozen=True)
class EvalOptions:
    """`[eval]`: sampled evals beside the greedy one (tasks/config.py EvalConfig)."""

    samples: int = 0
    """Sampled completions per held-out prompt (0: the greedy eval only)."""
    temperature: float = 1.0
    """Sampling temperature of the sampled evals."""


def evaluate_greedy(
    engine: Engine, tokenizer, env: Environment, examples: list[Example], *, run_id: str, step: int,
    max_new_tokens: int, stop_token_ids: tuple[int, ...], max_context: int,
    template_kwargs: Mapping[str, Any] | None = None, max_thinking_tokens: int = 0,
    sampled: EvalOptions = EvalOptions(),
) -> tuple[list[dict], dict[str, float]]:
    """Greedy completions of `examples`, rendered and sampled as RL's (template_kwargs, thinking
    budget), each judged by the env on its answer (the text after `</think>`); with
    `sampled.samples = k`, then k sampled completions of each at `sampled.temperature`, one row
    each (`sample` 0..k-1; the greedy row has none)."""
    budget = thinking_budget(tokenizer, max_thinking_tokens)
    runs = [(SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                            seed=0, **budget), False)]
    if sampled.samples:  # seeded by the step: a resumed or replayed eval draws the same samples
        runs.append((SamplingParams(n=sampled.samples, temperature=sampled.temperature,
                                    max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                    seed=step, **budget), True))
    rows = []
    for params, numbered in runs:
        if getattr(env, "max_turns", 1) > 1:
            judged = _episodes(engine, tokenizer, env, examples, params, max_context, template_kwargs)
        else:
            judged = _completions(engine, tokenizer, env, examples, params, max_context, template_kwargs)
        for example, group in zip(examples, judged, strict=True):
            for index, (result, fields, answer) in enumerate(group):
                correct = result.components.get("correct", 1.0 if result.reward >= 1.0 else 0.0)
                rows.append({
                    "run_id": run_id, "step": step, "env": example.env, "example_id": example.example_id,
                    "reward": float(result.reward), "correct": bool(correct >= 1.0), **fields,
                    "sample": index if numbered else None, "answer": answer,
                })
    return rows, eval_metrics(rows)


def _completions(engine, tokenizer, env, examples, params, max_context, template_kwargs):
    """Per example, (reward result, texts, comparable answer) of each of its `params.n` completions."""
    prompts = encode_prompts(tokenizer, env, examples, max_context,
                             params.max_new_tokens, template_kwargs)
    tags = think_tags(tokenizer)
    judged = []
    for example, prompt, completions in zip(examples, prompts, engine.generate(prompts, params), strict=True):
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
        group = []
        for completion in completions:
            answer_text = thinking_fields(tokenizer, prompt, list(completion.tokens), tags)["answer_text"]
            fields = {"prompt_text": prompt_text,
                      "completion_text": tokenizer.decode(completion.tokens, skip_special_tokens=True)}
            group.append((reward_of(env, example, answer_text), fields, answer_key(env, example, answer_text)))
        judged.append(group)
    return judged


def _episodes(engine, tokenizer, env, examples, params, max_context, template_kwargs):
    """Per example, its `params.n` multi-turn episodes (envs/multiturn.py), judged on their transcripts."""
    from rlpipe.envs.multiturn import episode_fields, run_episodes, with_turn_rewards

    groups = run_episodes(engine, tokenizer, env, examples, params, max_turns=env.max_turns,
                          max_tokens=max_context, context=getattr(env, "rollout_context", "tokens"),
                          template_kwargs=template_kwargs)
    judged = []
    for example, episodes in zip(examples, groups, strict=True):
        group = []
        for episode in episodes:
            result = with_turn_rewards(reward_of(env, example, episode.messages), [t.reward for t in episode.turns])
            fields = episode_fields(episode, tokenizer)
            group.append((result, {"prompt_text": fields["prompt_text"],
                                   "completion_text": fields["completion_text"]}, None))
        judged.append(group)
    return judged


def answer_key(env: Environment, example: Example, text: str) -> str | None:
    """The comparable answer a completion states (maj@k votes on it), where the environment, or a
    mixture's entry, has one (`answer_key(example, text)`); None otherwise."""
    mixture = mixture_of(env)
    if mixture is not None:
        env, example = mixture.entry(example)
    key = getattr(env, "answer_key", None)
    return key(example, text) if callable(key) else None


@dataclass(frozen=True)
class StepEvals:
    """A step's evals: its `evals` rows, and whether the eval stage read them back (stored by an
    earlier run of the step, which logged their metrics) instead of evaluating."""

    rows: list[dict]
    stored: bool = False

    @property
    def metrics(self) -> dict[str, float]:
        """eval/accuracy and eval/reward of the rows (`eval_metrics`)."""
        return eval_metrics(self.rows)


EVALS = StageTable("evals", rows=lambda evals, a: evals.rows, read_back=lambda rows, a: StepEvals(rows, stored=True))
"""A resumed step's stored evals are its result."""


@stage("eval", tables=(EVALS,))
def eval_task(engine, tokenizer, env, examples, *, run_dir: Path, run_id: str, step: int, **kwargs) -> StepEvals:
    """The evals of greedy completions on `examples` at `step` (read back on resume)."""
    rows, _ = evaluate_greedy(engine, tokenizer, env, examples, run_id=run_id, step=step, **kwargs)
    return StepEvals(rows)


def eval_metrics(rows: list[dict]) -> dict[str, float]:
    """eval/accuracy and eval/reward of a step's greedy `evals` rows; rows of several environments
    (a mixture) add eval/<env>/accuracy and eval/<env>/reward_mean per environment. Sampled rows
    (`eval.samples`) add eval/pass_at_<k> for k = 1..samples and, where the environment states a
    comparable answer, eval/maj_at_<samples> (tasks/pass_at_k.py)."""
    sampled = pass_at_k.sampled_rows(rows)
    rows = [r for r in rows if r.get("sample") is None]
    n = max(len(rows), 1)
    out = {m.EVAL_ACCURACY: sum(bool(r["correct"]) for r in rows) / n,
           m.EVAL_REWARD: sum(r["reward"] for r in rows) / n}
    envs = sorted({str(r["env"]) for r in rows})
    if len(envs) > 1:
        for env in envs:
            mine = [r for r in rows if str(r["env"]) == env]
            out[m.eval_env(env, "accuracy")] = sum(bool(r["correct"]) for r in mine) / len(mine)
            out[m.eval_env(env, "reward_mean")] = sum(r["reward"] for r in mine) / len(mine)
    out |= {m.pass_at(k): value for k, value in pass_at_k.pass_at_ks(sampled).items()}
    if (majority := pass_at_k.maj_at_k(sampled)) is not None:
        out[m.maj_at(majority[0])] = majority[1]
    return out


def eval_step(engine, tokenizer, env, examples, *, run_dir: Path, run_id: str, step: int,
              **kwargs) -> StepEvals:
    """Evaluate at `step` and write the `evals` table; a resumed step reads its rows back."""
    return eval_task(engine, tokenizer, env, examples, run_dir=run_dir, run_id=run_id, step=step, **kwargs)


def best_accuracy_before(run_dir, step: int, checkpointed: set[int]) -> float:
    """The `best` a run had after `step`, rebuilt from its `evals` table so that a resumed run
    moves the `best` alias only for a better eval: the step-0 accuracy, raised by every eval at a
    checkpointed step up to `step` (the alias only ever pointed at checkpoints). -inf if none."""
    import duckdb
    from rlpipe.storage.writer import read_table

    evals = read_table(run_dir, "evals")
    if not evals.num_rows:
        return float("-inf")
    accuracy = dict(duckdb.sql("select step, avg(correct::int) from evals where sample is null group by step").fetchall())
    steps = [s for s in accuracy if s == 0 or (s <= step and s in checkpointed)]
    return max((float(accuracy[s]) for s in steps), default=float("-inf"))


def step_accuracy(run_dir, step: int) -> float | None:
    """The held-out accuracy of the evals stored at `step`; None when it has none."""
    from rlpipe.storage.stage_tables import load_rows

    rows = load_rows(Path(run_dir), "evals", step)
    return eval_metrics(rows)[m.EVAL_ACCURACY] if rows else None
