-- Groups per run and step: how many had zero reward variance, how many were kept, sampling attempts.
-- source: groups. One row per (run_id, step), ordered by run_id, step.
-- columns:
--   run_id                  VARCHAR  run
--   step                    BIGINT   step
--   n_groups                BIGINT   groups (one prompt's completions under one policy version)
--   n_zero_variance         BIGINT   groups whose rewards were all equal (no learning signal)
--   zero_variance_fraction  DOUBLE   n_zero_variance / n_groups
--   n_kept                  BIGINT   groups kept for training
--   attempts_total          BIGINT   sum of groups.attempts (sampling attempts spent)
--   attempts_max            BIGINT   most attempts any group needed
SELECT
    run_id,
    step,
    count(*) AS n_groups,
    count(*) FILTER (WHERE zero_variance) AS n_zero_variance,
    CAST(count(*) FILTER (WHERE zero_variance) AS DOUBLE) / count(*) AS zero_variance_fraction,
    count(*) FILTER (WHERE kept) AS n_kept,
    CAST(sum(attempts) AS BIGINT) AS attempts_total,
    CAST(max(attempts) AS BIGINT) AS attempts_max
FROM groups
GROUP BY run_id, step
ORDER BY run_id, step
