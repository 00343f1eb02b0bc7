-- Reward of scored completions per run and step: count, errors, mean, std, min, max.
-- source: scores. One row per (run_id, step), ordered by run_id, step.
-- columns:
--   run_id        VARCHAR  run
--   step          BIGINT   step the completions were generated and scored for
--   n             BIGINT   scored completions
--   n_errors      BIGINT   completions whose reward function raised (scores.error not null)
--   reward_mean   DOUBLE   mean reward
--   reward_std    DOUBLE   population standard deviation of the reward (0 for one completion)
--   reward_min    DOUBLE   lowest reward
--   reward_max    DOUBLE   highest reward
SELECT
    run_id,
    step,
    count(*) AS n,
    count(error) AS n_errors,
    avg(reward) AS reward_mean,
    coalesce(stddev_pop(reward), 0) AS reward_std,
    CAST(min(reward) AS DOUBLE) AS reward_min,
    CAST(max(reward) AS DOUBLE) AS reward_max
FROM scores
GROUP BY run_id, step
ORDER BY run_id, step
