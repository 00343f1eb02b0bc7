-- Pass rate by prompt over time: each prompt's completions per step, how many passed, and its pass rate so far.
-- source: rollouts joined with scores on (run_id, sample_id); a completion passes when its reward is at least 1
-- (rl.curriculum.pass_reward's default); completions whose reward function raised are left out.
-- One row per (run_id, env, example_id, step) the prompt was sampled at, ordered by run_id, env, example_id, step.
-- columns:
--   run_id               VARCHAR  run
--   env                  VARCHAR  environment
--   example_id           VARCHAR  example (prompt) id within the environment
--   step                 BIGINT   step that sampled it
--   n_samples            BIGINT   its scored completions at this step
--   n_passed             BIGINT   of them, those with reward >= 1
--   pass_rate            DOUBLE   n_passed / n_samples
--   cumulative_samples   BIGINT   its scored completions up to and including this step
--   cumulative_pass_rate DOUBLE   its pass rate over all those completions
WITH per_step AS (
    SELECT
        r.run_id,
        r.env,
        r.example_id,
        r.step,
        count(*) AS n_samples,
        count(*) FILTER (WHERE s.reward >= 1) AS n_passed
    FROM rollouts AS r
    JOIN scores AS s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
    WHERE s.error IS NULL
    GROUP BY r.run_id, r.env, r.example_id, r.step
)
SELECT
    run_id,
    env,
    example_id,
    step,
    n_samples,
    n_passed,
    CAST(n_passed AS DOUBLE) / n_samples AS pass_rate,
    CAST(sum(n_samples) OVER w AS BIGINT) AS cumulative_samples,
    CAST(sum(n_passed) OVER w AS DOUBLE) / sum(n_samples) OVER w AS cumulative_pass_rate
FROM per_step
WINDOW w AS (PARTITION BY run_id, env, example_id ORDER BY step ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
ORDER BY run_id, env, example_id, step
