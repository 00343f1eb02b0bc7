"""Derived views over a run's tables, created beside the table views in `catalog.duckdb` and in
every `connect([...])` connection (storage/catalog.py), so `rlpipe sql` and the multi-run catalog
see them too. Each is plain SQL over the table views (`run_id` keeps runs apart).

- `fates`: one row per sampled completion (every `rollouts` row) with its fate: the newest
  `decisions` row of the sample (rollouts/fates.py lists the statuses and where each is decided).
  `step` is the step that sampled it, `decided_step` the step that gave it its fate,
  `trained_step` is set only for `trained`, `reward` is null on `reward_error`. A completion of a
  step still being filled has no decision yet: its status is null.
"""

from __future__ import annotations

FATES = """
SELECT r.run_id, r.sample_id, r.group_id, r.step, r.policy_version,
       d.status, d.reason,
       CASE WHEN d.status = 'trained' THEN d.step END AS trained_step,
       d.step AS decided_step,
       CASE WHEN s.error IS NULL AND d.status IS DISTINCT FROM 'reward_error'
            THEN CAST(s.reward AS DOUBLE) END AS reward,
       r.env, r.example_id, r.attempt, r.finish_reason, r.n_completion_tokens
FROM rollouts r
LEFT JOIN (SELECT * FROM decisions
           QUALIFY row_number() OVER (PARTITION BY run_id, sample_id ORDER BY step DESC) = 1) d
       ON d.run_id = r.run_id AND d.sample_id = r.sample_id
LEFT JOIN scores s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
"""

TOKENS = """
SELECT t.run_id, t.step, t.batch_id, split_part(t.sample_ids[t.segment + 1], '#', 1) AS sample_id,
       t.position, t.token_id, t.generator_logprob, t.trainer_logprob, t.weight, a.advantage
FROM (SELECT run_id, step, batch_id, sample_ids,
             unnest(token_sample) AS segment, unnest(token_position) AS position, unnest(labels) AS token_id,
             unnest(log_probs) AS generator_logprob, unnest(trainer_logprobs) AS trainer_logprob,
             unnest(token_weights) AS weight
      FROM train_tokens) t
LEFT JOIN advantages a
       ON a.run_id = t.run_id AND a.step = t.step AND a.sample_id = split_part(t.sample_ids[t.segment + 1], '#', 1)
WHERE t.segment >= 0
"""

VIEWS: dict[str, str] = {"fates": FATES, "tokens": TOKENS}
"""View name -> its SELECT over the table views (created after them, in this order)."""
