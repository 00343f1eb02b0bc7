-- What became of the completions each step sampled: how many were trained, dropped (by reason) or carried.
-- source: the fates view (one row per sampled completion, its final status). One row per (run_id, step, status).
-- step is the step whose rollouts produced the completions, not the step that trained them (trained_step).
-- columns:
--   run_id   VARCHAR  run
--   step     BIGINT   the step that sampled the completions
--   status   VARCHAR  trained | zero_variance | stale | carried | over_cap | reward_error | truncated |
--                     cut_in_thinking | filtered,
--                     or pending: no decision yet (the run stopped while that step was being filled)
--   n        BIGINT   completions of that step with that final status
SELECT run_id, CAST(step AS BIGINT) AS step, coalesce(status, 'pending') AS status, count(*) AS n
FROM fates
GROUP BY ALL
ORDER BY run_id, step, status
