-- Completion length per run and step: mean, quantiles and truncation of tokens per completion.
-- source: rollouts. One row per (run_id, step), ordered by run_id, step.
-- columns:
--   run_id              VARCHAR  run
--   step                BIGINT   step the completions were generated for
--   n                   BIGINT   completions
--   tokens_mean         DOUBLE   mean completion length (tokens)
--   tokens_min          BIGINT   shortest completion (tokens)
--   tokens_p10, tokens_p25, tokens_p50, tokens_p75, tokens_p90
--                       DOUBLE   quantiles of the length (linear interpolation, quantile_cont)
--   tokens_max          BIGINT   longest completion (tokens)
--   truncated_fraction  DOUBLE   share of completions with finish_reason = 'length'
SELECT
    run_id,
    step,
    count(*) AS n,
    avg(n_completion_tokens) AS tokens_mean,
    CAST(min(n_completion_tokens) AS BIGINT) AS tokens_min,
    quantile_cont(CAST(n_completion_tokens AS DOUBLE), 0.10) AS tokens_p10,
    quantile_cont(CAST(n_completion_tokens AS DOUBLE), 0.25) AS tokens_p25,
    quantile_cont(CAST(n_completion_tokens AS DOUBLE), 0.50) AS tokens_p50,
    quantile_cont(CAST(n_completion_tokens AS DOUBLE), 0.75) AS tokens_p75,
    quantile_cont(CAST(n_completion_tokens AS DOUBLE), 0.90) AS tokens_p90,
    CAST(max(n_completion_tokens) AS BIGINT) AS tokens_max,
    avg(CASE WHEN finish_reason = 'length' THEN 1.0 ELSE 0.0 END) AS truncated_fraction
FROM rollouts
GROUP BY run_id, step
ORDER BY run_id, step
