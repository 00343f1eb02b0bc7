-- The best and the worst scored completion of each run and step, with prompt, completion and reward.
-- source: rollouts joined with scores on (run_id, sample_id). Two rows per (run_id, step): kind 'best' then 'worst'.
-- columns:
--   run_id               VARCHAR  run
--   step                 BIGINT   step
--   kind                 VARCHAR  'best' (highest reward) or 'worst' (lowest); ties: smallest sample_id
--   sample_id            VARCHAR  the completion's id
--   env                  VARCHAR  environment
--   example_id           VARCHAR  example id
--   prompt_text          VARCHAR  the prompt
--   completion_text      VARCHAR  the completion
--   reward               DOUBLE   its reward
--   components           VARCHAR  reward components as a JSON object text, e.g. {"correct":1.0} (NULL if none)
--   n_completion_tokens  BIGINT   completion length (tokens)
--   finish_reason        VARCHAR  why generation stopped
WITH joined AS (
    SELECT
        r.run_id,
        r.step,
        r.sample_id,
        r.env,
        r.example_id,
        r.prompt_text,
        r.completion_text,
        CAST(s.reward AS DOUBLE) AS reward,
        CAST(to_json(s.components) AS VARCHAR) AS components,
        CAST(r.n_completion_tokens AS BIGINT) AS n_completion_tokens,
        r.finish_reason
    FROM rollouts AS r
    JOIN scores AS s ON s.run_id = r.run_id AND s.sample_id = r.sample_id
),
ranked AS (
    SELECT
        *,
        row_number() OVER (PARTITION BY run_id, step ORDER BY reward DESC, sample_id) AS best_rank,
        row_number() OVER (PARTITION BY run_id, step ORDER BY reward ASC, sample_id) AS worst_rank
    FROM joined
)
SELECT run_id, step, kind, sample_id, env, example_id, prompt_text, completion_text, reward,
       components, n_completion_tokens, finish_reason
FROM (
    SELECT 'best' AS kind, * FROM ranked WHERE best_rank = 1
    UNION ALL
    SELECT 'worst' AS kind, * FROM ranked WHERE worst_rank = 1
)
ORDER BY run_id, step, kind
