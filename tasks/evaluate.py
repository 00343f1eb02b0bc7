"""Stage `eval`: greedy completions on held-out prompts → the `evals` table.

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
from rlpipe.models.chat import think_tags
from rlpipe.rollouts.generation import encode_prompts, thinking_budget, thinking_fields
from rlpipe.rollouts.scoring import reward_of
from rlpipe.storage.stage_tables import StageTable, stage


def evaluate_greedy(
    engine: Engine, tokenizer, env: Environment, examples: list[Example], *, run_id: str, step: int,
    max_new_tokens: int, stop_token_ids: tuple[int, ...], max_context: int,
    template_kwargs: Mapping[str, Any] | None = None, max_thinking_tokens: int = 0,
) -> tuple[list[dict], dict[str, float]]:
    """Greedy completions of `examples`, rendered and sampled as RL's (template_kwargs, thinking
    budget), each judged by the env on its answer (the text after `</think>`)."""
    params = SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids, seed=0,
                            **thinking_budget(tokenizer, max_thinking_tokens))
    if getattr(env, "max_turns", 1) > 1:
        return _evaluate_episodes(engine, tokenizer, env, examples, params, run_id, step, max_context,
                                  template_kwargs)
    prompts = encode_prompts(tokenizer, env, examples, max_context, max_new_tokens, template_kwargs)
    completions = engine.generate(prompts, params)
    tags = think_tags(tokenizer)
    rows = []
    for example, prompt, (completion,) in zip(examples, prompts, completions, strict=True):
        text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
        result = reward_of(env, example, thinking_fields(tokenizer, prompt, list(completion.tokens), tags)["answer_text"])
        correct = result.components.get("correct", 1.0 if result.reward >= 1.0 else 0.0)
        rows.append({
            "run_id": run_id, "step": step, "env": example.env, "example_id": example.example_id,
            "reward": float(result.reward), "correct": bool(correct >= 1.0),
            "prompt_text": tokenizer.decode(prompt, skip_special_tokens=False),
            "completion_text": text,
        })
    return rows, eval_metrics(rows)


def _evaluate_episodes(engine, tokenizer, env, examples, params, run_id, step, max_context, template_kwargs):
    """Greedy multi-turn episodes (envs/multiturn.py), judged on their transcripts."""
    from rlpipe.envs.multiturn import episode_fields, run_episodes, with_turn_rewards

    groups = run_episodes(engine, tokenizer, env, examples, params, max_turns=env.max_turns,
                          max_tokens=max_context, context=getattr(env, "rollout_context", "tokens"),
                          template_kwargs=template_kwargs)
    rows = []
    for example, (episode,) in zip(examples, groups, strict=True):
        result = with_turn_rewards(reward_of(env, example, episode.messages), [t.reward for t in episode.turns])
        correct = result.components.get("correct", 1.0 if result.reward >= 1.0 else 0.0)
        fields = episode_fields(episode, tokenizer)
        rows.append({
            "run_id": run_id, "step": step, "env": example.env, "example_id": example.example_id,
            "reward": float(result.reward), "correct": bool(correct >= 1.0),
            "prompt_text": fields["prompt_text"], "completion_text": fields["completion_text"],
        })
    return rows, eval_metrics(rows)


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
    """eval/accuracy and eval/reward of a step's `evals` rows; rows of several environments (a
    mixture) add eval/<env>/accuracy and eval/<env>/reward_mean per environment."""
    n = max(len(rows), 1)
    out = {m.EVAL_ACCURACY: sum(bool(r["correct"]) for r in rows) / n,
           m.EVAL_REWARD: sum(r["reward"] for r in rows) / n}
    envs = sorted({str(r["env"]) for r in rows})
    if len(envs) > 1:
        for env in envs:
            mine = [r for r in rows if str(r["env"]) == env]
            out[m.eval_env(env, "accuracy")] = sum(bool(r["correct"]) for r in mine) / len(mine)
            out[m.eval_env(env, "reward_mean")] = sum(r["reward"] for r in mine) / len(mine)
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
    accuracy = dict(duckdb.sql("select step, avg(correct::int) from evals group by step").fetchall())
    steps = [s for s in accuracy if s == 0 or (s <= step and s in checkpointed)]
    return max((float(accuracy[s]) for s in steps), default=float("-inf"))


def step_accuracy(run_dir, step: int) -> float | None:
    """The held-out accuracy of the evals stored at `step`; None when it has none."""
    from rlpipe.storage.stage_tables import load_rows

    rows = load_rows(Path(run_dir), "evals", step)
    return eval_metrics(rows)[m.EVAL_ACCURACY] if rows else None
