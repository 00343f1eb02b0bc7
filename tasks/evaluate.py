"""Stage `eval`: greedy completions on held-out prompts → the `evals` table.

Step 0 measures the starting weights (for RL, the SFT checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from engines.base import Engine, SamplingParams
from envs.base import Environment, Example
from tasks._prefect import stage
from tasks.generate import encode_prompts
from tasks.record import load_rows, persist
from tasks.score import reward_of
from training import metric_names as m


def evaluate_greedy(
    engine: Engine, tokenizer, env: Environment, examples: list[Example], *, run_id: str, step: int,
    max_new_tokens: int, stop_token_ids: tuple[int, ...], max_context: int,
) -> tuple[list[dict], dict[str, float]]:
    params = SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids, seed=0)
    if getattr(env, "max_turns", 1) > 1:
        return _evaluate_episodes(engine, tokenizer, env, examples, params, run_id, step, max_context)
    prompts = encode_prompts(tokenizer, env, examples, max_context, max_new_tokens)
    completions = engine.generate(prompts, params)
    rows = []
    for example, prompt, (completion,) in zip(examples, prompts, completions, strict=True):
        text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
        result = reward_of(env, example, text)
        correct = result.components.get("correct", 1.0 if result.reward >= 1.0 else 0.0)
        rows.append({
            "run_id": run_id, "step": step, "env": example.env, "example_id": example.example_id,
            "reward": float(result.reward), "correct": bool(correct >= 1.0),
            "prompt_text": tokenizer.decode(prompt, skip_special_tokens=False),
            "completion_text": text,
        })
    return rows, eval_metrics(rows)


def _evaluate_episodes(engine, tokenizer, env, examples, params, run_id, step, max_context):
    """Greedy multi-turn episodes (envs/multiturn.py), judged on their transcripts."""
    from envs.multiturn import episode_fields, run_episodes, with_turn_rewards

    groups = run_episodes(engine, tokenizer, env, examples, params, max_turns=env.max_turns,
                          max_tokens=max_context, context=getattr(env, "rollout_context", "tokens"))
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


@stage("eval")
def eval_task(engine, tokenizer, env, examples, **kwargs):
    return evaluate_greedy(engine, tokenizer, env, examples, **kwargs)


def eval_metrics(rows: list[dict]) -> dict[str, float]:
    n = max(len(rows), 1)
    return {m.EVAL_ACCURACY: sum(bool(r["correct"]) for r in rows) / n,
            m.EVAL_REWARD: sum(r["reward"] for r in rows) / n}


def eval_step(engine, tokenizer, env, examples, *, run_dir: Path, run_id: str, step: int,
              **kwargs) -> dict[str, float]:
    """Evaluate at `step` and write the `evals` table; a resumed step reads its rows back."""
    rows = load_rows(run_dir, "evals", step)
    if rows is None:
        rows, _ = eval_task(engine, tokenizer, env, examples, run_id=run_id, step=step, **kwargs)
        persist(run_dir, "evals", step, rows, run_id)
    return eval_metrics(rows)
