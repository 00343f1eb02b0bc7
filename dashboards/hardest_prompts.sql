-- The 20 prompts of each run with the lowest mean reward over all steps.
-- source: rollouts joined with scores on (run_id, sample_id). Up to 20 rows per run, ordered by run_id, rank.
-- columns:
--   run_id       VARCHAR  run
--   rank         BIGINT   1 = hardest (lowest reward_mean; ties: more samples first, then env, example_id)
--   env          VARCHAR  environment
--   example_id   VARCHAR  example (prompt) id within the environment
--   prompt_text  VARCHAR  the prompt
--   n_samples    BIGINT   scored completions of this prompt
--   n_steps      BIGINT   distinct steps it was sampled at
--   reward_mean  DOUBLE   mean reward over all its completions
--   first_step   BIGINT   first step it was sampled at
--   last_step    BIGINT   last step it was sampled at
WITH per_prompt AS (
    SELECT
        r.run_id,
        r.env,
        r.example_id,
        min(r.prompt_text) AS prompt_text,
        count(*) AS n_samples,
        count(DISTINCT r.step) AS n_steps,
        avg(s.reward) AS reward_mean,
        min(r.step) AS first_step,
        max(r.step) AS last_step
    FROM rollouts AS r
    JOIN scores AS s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
    GROUP BY r.run_id, r.env, r.example_id
),
ranked AS (
    SELECT
        *,
        row_number() OVER (
            PARTITION BY run_id ORDER BY reward_mean, n_samples DESC, env, example_id
        ) AS rank
    FROM per_prompt
)
SELECT run_id, rank, env, example_id, prompt_text, n_samples, n_steps, reward_mean, first_step, last_step
FROM ranked
WHERE rank <= 20
ORDER BY run_id, rank
