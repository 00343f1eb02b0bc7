-- Eval results per run, step and environment: mean reward and accuracy.
-- source: evals, the greedy rows (`sample` null; sampled evals: pass_at_k_by_step). One row per (run_id, step, env), ordered by run_id, step, env. Step 0 = starting weights.
-- columns:
--   run_id       VARCHAR  run
--   step         BIGINT   step whose weights were evaluated
--   env          VARCHAR  environment
--   n            BIGINT   eval samples
--   reward_mean  DOUBLE   mean reward
--   accuracy     DOUBLE   share of samples with correct = true (NULL when correct is never set)
SELECT
    run_id,
    step,
    env,
    count(*) AS n,
    avg(reward) AS reward_mean,
    avg(CAST(correct AS DOUBLE)) AS accuracy
FROM (SELECT * FROM evals UNION ALL BY NAME SELECT NULL::INTEGER AS sample WHERE false)
WHERE sample IS NULL
GROUP BY run_id, step, env
ORDER BY run_id, step, env
