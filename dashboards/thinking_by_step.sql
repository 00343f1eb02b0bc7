-- Reasoning and answer per run and step: tokens of the <think> block and after it, for runs whose
-- completions have reasoning blocks (thinking models). source: rollouts (single-turn rows: the
-- thinking_tokens / answer_tokens columns; null for episodes and for rows of older runs).
-- One row per (run_id, step) with any reasoning, ordered by run_id, step.
-- columns:
--   run_id                   VARCHAR  run
--   step                     BIGINT   step the completions were generated for
--   n                        BIGINT   completions with the split recorded
--   thinking_tokens_mean     DOUBLE   mean tokens of the reasoning block (tags included)
--   answer_tokens_mean       DOUBLE   mean tokens after </think>
--   cut_in_thinking_fraction DOUBLE   share cut at max_new_tokens inside the block (no answer)
SELECT
    run_id,
    step,
    count(*) AS n,
    avg(thinking_tokens) AS thinking_tokens_mean,
    avg(answer_tokens) AS answer_tokens_mean,
    avg(CASE WHEN finish_reason = 'length' AND thinking_tokens > 0 AND answer_tokens = 0
        THEN 1.0 ELSE 0.0 END) AS cut_in_thinking_fraction
FROM rollouts
WHERE thinking_tokens IS NOT NULL
GROUP BY run_id, step
HAVING max(thinking_tokens) > 0
ORDER BY run_id, step
