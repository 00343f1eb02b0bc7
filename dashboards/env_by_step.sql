-- Per environment (a mixture's [[task.envs]] entries) per run and step: completions, reward, accuracy, zero-variance groups, trained.
-- source: rollouts, scores, advantages, groups. One row per (run_id, env, step), ordered by run_id, env, step.
-- A run of one environment has one env. `reward_mean`, `accuracy` and `zero_variance_fraction` are
-- what MLflow logs for a mixture as rollout/<env>/reward_mean, /accuracy and /zero_var_fraction.
-- columns:
--   run_id                  VARCHAR  run
--   env                     VARCHAR  environment (the mixture entry's name)
--   step                    BIGINT   step the completions were sampled at
--   n_samples               BIGINT   completions sampled
--   reward_mean             DOUBLE   mean reward (scores.reward: a reward that raised counts 0)
--   accuracy                DOUBLE   share whose `correct` reward component is 1 (else: reward > 0)
--   n_groups                BIGINT   groups decided at the step (groups table)
--   zero_variance_fraction  DOUBLE   share of those groups whose rewards were all equal
--   n_trained               BIGINT   completions sampled at the step and trained (then or later: advantages)
WITH sampled AS (
    SELECT
        r.run_id,
        r.env,
        r.step,
        count(*) AS n_samples,
        avg(CAST(s.reward AS DOUBLE)) AS reward_mean,
        avg(CASE WHEN s.components['correct'] IS NOT NULL THEN CAST(s.components['correct'] = 1 AS DOUBLE)
                 ELSE CAST(s.reward > 0 AS DOUBLE) END) AS accuracy,
        count(a.sample_id) AS n_trained
    FROM rollouts r
    LEFT JOIN scores s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
    LEFT JOIN (SELECT DISTINCT run_id, sample_id FROM advantages) a
           ON a.run_id = r.run_id AND a.sample_id = r.sample_id
    GROUP BY r.run_id, r.env, r.step
),
grouped AS (
    SELECT
        run_id,
        env,
        step,
        count(*) AS n_groups,
        CAST(count(*) FILTER (WHERE zero_variance) AS DOUBLE) / count(*) AS zero_variance_fraction
    FROM groups
    GROUP BY run_id, env, step
)
SELECT
    sampled.run_id,
    sampled.env,
    CAST(sampled.step AS BIGINT) AS step,
    sampled.n_samples,
    sampled.reward_mean,
    sampled.accuracy,
    coalesce(grouped.n_groups, 0) AS n_groups,
    grouped.zero_variance_fraction,
    sampled.n_trained
FROM sampled
LEFT JOIN grouped USING (run_id, env, step)
ORDER BY sampled.run_id, sampled.env, sampled.step
