-- Time and throughput per run and step: seconds per phase, training and generation tokens per second.
-- source: train_steps, left-joined with rollouts counted per step. One row per train_steps row, ordered by run_id, step.
-- columns:
--   run_id                      VARCHAR  run
--   step                        BIGINT   optimizer step
--   mode                        VARCHAR  pretrain | sft | rl
--   train_tokens                BIGINT   tokens trained on (train_steps.tokens)
--   train_tokens_per_second     DOUBLE   train_steps.tokens_per_second
--   n_completions               BIGINT   rollouts generated for this step (NULL without rollouts)
--   completion_tokens           BIGINT   completion tokens generated (NULL without rollouts)
--   generate_tokens_per_second  DOUBLE   completion_tokens / seconds_generate
--   seconds_generate, seconds_score, seconds_filter, seconds_pack, seconds_train,
--   seconds_checkpoint, seconds_sync, seconds_eval, seconds_total
--                               DOUBLE   wall seconds per phase (NULL where the phase did not run)
WITH generated AS (
    SELECT run_id, step, count(*) AS n_completions, CAST(sum(n_completion_tokens) AS BIGINT) AS completion_tokens
    FROM rollouts
    GROUP BY run_id, step
)
SELECT
    t.run_id,
    t.step,
    t.mode,
    t.tokens AS train_tokens,
    t.tokens_per_second AS train_tokens_per_second,
    g.n_completions,
    g.completion_tokens,
    g.completion_tokens / nullif(t.seconds_generate, 0) AS generate_tokens_per_second,
    t.seconds_generate,
    t.seconds_score,
    t.seconds_filter,
    t.seconds_pack,
    t.seconds_train,
    t.seconds_checkpoint,
    t.seconds_sync,
    t.seconds_eval,
    t.seconds_total
FROM train_steps AS t
LEFT JOIN generated AS g ON g.run_id = t.run_id AND g.step = t.step
ORDER BY t.run_id, t.step
