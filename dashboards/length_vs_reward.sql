-- Completion length against reward per run and step: means, correlation, truncation.
-- source: rollouts joined with scores on (run_id, sample_id). One row per (run_id, step).
-- columns:
--   run_id                  VARCHAR  run
--   step                    BIGINT   step
--   n                       BIGINT   scored completions
--   completion_tokens_mean  DOUBLE   mean completion length (tokens)
--   completion_tokens_max   BIGINT   longest completion (tokens)
--   reward_mean             DOUBLE   mean reward
--   length_reward_corr      DOUBLE   Pearson correlation of length and reward (NULL/NaN when either is constant)
--   truncated_fraction      DOUBLE   share of completions with finish_reason = 'length'
SELECT
    r.run_id,
    r.step,
    count(*) AS n,
    avg(r.n_completion_tokens) AS completion_tokens_mean,
    CAST(max(r.n_completion_tokens) AS BIGINT) AS completion_tokens_max,
    avg(s.reward) AS reward_mean,
    corr(CAST(r.n_completion_tokens AS DOUBLE), CAST(s.reward AS DOUBLE)) AS length_reward_corr,
    avg(CASE WHEN r.finish_reason = 'length' THEN 1.0 ELSE 0.0 END) AS truncated_fraction
FROM rollouts AS r
JOIN scores AS s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
GROUP BY r.run_id, r.step
ORDER BY r.run_id, r.step
