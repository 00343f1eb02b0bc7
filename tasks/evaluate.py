"""Stage `eval`: greedy completions on held-out prompts → the `evals` table.

Step 0 measures the starting weights (for RL, the SFT checkpoint).
"""

from __future__ import annotations

from engines.base import Engine, SamplingParams
from envs.base import Environment, Example
from tasks._prefect import stage
from tasks.generate import encode_prompts


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
        result = env.reward(example, text)
        correct = result.components.get("correct", 1.0 if result.reward >= 1.0 else 0.0)
        rows.append({
            "run_id": run_id, "step": step, "env": example.env, "example_id": example.example_id,
            "reward": float(result.reward), "correct": bool(correct >= 1.0),
            "prompt_text": tokenizer.decode(prompt, skip_special_tokens=False),
            "completion_text": text,
        })
    return rows, _metrics(rows)


def _evaluate_episodes(engine, tokenizer, env, examples, params, run_id, step, max_context):
    """Greedy multi-turn episodes (envs/multiturn.py), judged on their transcripts."""
    from envs.multiturn import episode_fields, episode_reward, run_episodes

    groups = run_episodes(engine, tokenizer, env, examples, params, max_turns=env.max_turns,
                          max_tokens=max_context, context=getattr(env, "rollout_context", "tokens"))
    rows = []
    for example, (episode,) in zip(examples, groups, strict=True):
        result = episode_reward(env, episode, example)
        correct = result.components.get("correct", 1.0 if result.reward >= 1.0 else 0.0)
        fields = episode_fields(episode, tokenizer)
        rows.append({
            "run_id": run_id, "step": step, "env": example.env, "example_id": example.example_id,
            "reward": float(result.reward), "correct": bool(correct >= 1.0),
            "prompt_text": fields["prompt_text"], "completion_text": fields["completion_text"],
        })
    return rows, _metrics(rows)


def _metrics(rows: list[dict]) -> dict[str, float]:
    n = max(len(rows), 1)
    metrics = {
        "eval/reward_mean": sum(r["reward"] for r in rows) / n,
        "eval/accuracy": sum(r["correct"] for r in rows) / n,
    }
    return metrics


@stage("eval")
def eval_task(engine, tokenizer, env, examples, **kwargs):
    return evaluate_greedy(engine, tokenizer, env, examples, **kwargs)
