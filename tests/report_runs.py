"""Small synthetic runs for the report's tests: `write_run` (tables only, RL or SFT) and
`write_fated_run` (an RL run with recorded fates, `decisions`); `embedded_data` reads a written
report's data back.

For the fated run, tests/synthetic_runs.py gives rollouts, scores and groups; this adds what the report's fate chart and
rollout browser read: advantages of the trained completions and a `decisions` row for every decided
completion, covering every kind of fate the view shows: trained, zero_variance, a group carried at
one step and trained at the next, reward_error, truncated, stale, and completions not yet decided
(pending). Step 2 also holds a multi-turn episode, a completion that could end a <script> early
and one too long to inline whole.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlpipe.storage.queries import run_sql
from rlpipe.storage.writer import write_table

from tests.synthetic_runs import synthetic_step

NASTY = 'ends a script early? </script><script>document.title="pwned"</script> <!-- ünïcode'
EPISODE = {"n_turns": 2, "completion_text": "calc 51*92<|im_end|>\n<|im_start|>tool\n4692<|im_end|>\nans 4692",
           "turns": [{"turn": 0, "producer": "model", "start": 0, "length": 11, "reward": None},
                     {"turn": 0, "producer": "env", "start": 11, "length": 24, "reward": 0.5},
                     {"turn": 1, "producer": "model", "start": 35, "length": 9, "reward": None}],
           "messages": json.dumps([{"role": "user", "content": "51*92"}, {"role": "assistant", "content": "calc 51*92"},
                                   {"role": "tool", "content": "4692"}, {"role": "assistant", "content": "ans 4692"}])}
LONG = 9000  # characters of step 2's third completion
RL_STEPS = (0, 1, 2, 3)
SFT_STEPS = (0, 1, 2)


def write_run(run_dir, run_id, steps, *, rl, seed=0):
    """A tiny run: RL runs get rollouts, scores and groups (tests/synthetic_runs.py); both get train_steps, evals."""
    for step in steps:
        if rl:
            tables = synthetic_step(step, run_id=run_id, n_groups=5, group_size=4, n_token_rows=2, seed=seed,
                                    n_examples=6, zero_variance_share=0.4)
            rollouts = tables["rollouts"].to_pylist()
            rollouts[0]["completion_text"] = NASTY
            tables["rollouts"] = rollouts
            for name, data in tables.items():
                write_table(run_dir, name, step, data, run_id=run_id, durable=False)
        write_table(run_dir, "train_steps", step, [dict(
            mode="rl" if rl else "sft", loss=1.0 / (step + 1) + seed, grad_norm=0.5 + step, lr=1e-3 * (step + 1),
            tokens=100, tokens_per_second=200.0 + step, seconds_generate=1.5 if rl else None,
            seconds_train=2.0, seconds_total=4.0)], run_id=run_id, durable=False)
        write_table(run_dir, "evals", step, [dict(env=env, example_id=str(i), reward=float(i % 2),
                                                   correct=(i + step) % 3 == 0)
                                              for env in ("arithmetic", "countdown") for i in range(6)],
                    run_id=run_id, durable=False)


def embedded_data(html_text: str) -> dict:
    """The JSON data a written report.html embeds."""
    match = re.search(r'<script type="application/json" id="rlpipe-data">(.*?)</script>', html_text, re.S)
    return json.loads(match.group(1))


def write_fated_run(run_dir: Path, run_id: str, steps: tuple[int, ...] = (1, 2, 3, 4), *, n_groups: int = 6,
                    group_size: int = 4) -> None:
    """Write the run's tables (see the module docstring); the last step's last group stays undecided."""
    for step in steps:
        tables = synthetic_step(step, run_id=run_id, n_groups=n_groups, group_size=group_size, n_token_rows=0,
                                n_examples=8, zero_variance_share=0.4)
        rollouts, scores = tables["rollouts"].to_pylist(), tables["scores"].to_pylist()
        for row in scores:
            row["error"] = None
        if step == steps[1]:
            rollouts[0]["completion_text"] = NASTY
            rollouts[1] |= EPISODE
            rollouts[2]["completion_text"] = "y" * LONG
            scores[5]["error"] = "ZeroDivisionError: division by zero\n  (traceback)"
        for name, data in (("rollouts", rollouts), ("scores", scores), ("groups", tables["groups"])):
            write_table(run_dir, name, step, data, run_id=run_id, durable=False)
        write_table(run_dir, "train_steps", step, [dict(mode="rl", loss=1.0 / step, grad_norm=1.0, lr=1e-3, tokens=100,
                                                        seconds_total=1.0)], run_id=run_id, durable=False)
    _write_decisions(run_dir, run_id, steps, group_size)


def _write_decisions(run_dir: Path, run_id: str, steps: tuple[int, ...], group_size: int) -> None:
    rows = run_sql([run_dir], """select r.step, r.sample_id, r.group_id, g.status, s.error, s.reward, g.reward_mean
        from rollouts r join scores s on s.run_id = r.run_id and s.sample_id = r.sample_id
        join groups g on g.run_id = r.run_id and g.group_id = r.group_id
        order by r.step, r.sample_id""").to_pylist()
    decisions: dict[int, list[dict]] = {step: [] for step in steps}
    advantages: dict[int, list[dict]] = {step: [] for step in steps}
    first_group = {step: min(r["group_id"] for r in rows if r["step"] == step) for step in steps}
    last_group = max(r["group_id"] for r in rows if r["step"] == steps[-1])
    carried = min(r["group_id"] for r in rows if r["step"] == steps[0] and r["status"] == "trained")
    for i, r in enumerate(rows):
        step, status = r["step"], r["status"]
        reason = {"trained": f"trained at step {step}", "zero_variance": "group reward std 0.000 <= eps 1e-06"}[status]
        if r["group_id"] == last_group:
            continue  # pending: its step was still being filled
        if r["error"]:
            status, reason = "reward_error", "reward function raised: " + r["error"].splitlines()[0]
        elif step == steps[2] and r["group_id"] == first_group[step]:
            status, reason = "stale", "sampled by policy version 1, older than rl.off_policy.max_steps allows"
        elif step == steps[2] and status == "trained" and i % group_size == 1:
            status, reason = "truncated", "cut at max_new_tokens and rl.filter.drop_truncated is on"
        elif r["group_id"] == carried:
            # carried at its own step, trained at the next one: the newest row is its fate
            decisions[step].append(_decision(r, "carried", "valid surplus, waits for a later step"))
            step, reason = steps[1], f"trained at step {steps[1]}"
        decisions[step].append(_decision(r, status, reason))
        if status == "trained":
            advantages[step].append({"sample_id": r["sample_id"], "group_id": r["group_id"],
                                     "advantage": r["reward"] - r["reward_mean"]})
    for step in steps:
        write_table(run_dir, "decisions", step, decisions[step], run_id=run_id, durable=False)
        write_table(run_dir, "advantages", step, advantages[step], run_id=run_id, durable=False)


def _decision(row: dict, status: str, reason: str) -> dict:
    return {"sample_id": row["sample_id"], "group_id": row["group_id"], "status": status, "reason": reason}
