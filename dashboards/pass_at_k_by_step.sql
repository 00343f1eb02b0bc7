-- Sampled evals per run, step and environment: unbiased pass@k for k = 1..samples, and maj@k.
-- source: evals rows with `sample` set (eval.samples = k; the greedy row has none). One row per
-- (run_id, step, env, k), ordered by run_id, step, env, k. pass@k is Chen et al. (2021)'s
-- 1 - C(n-c, k)/C(n, k) per prompt (n samples, c correct), as the product
-- 1 - prod_{i=n-c+1..n} (1 - k/i), averaged over prompts; k runs to the fewest samples a prompt has.
-- columns:
--   run_id       VARCHAR  run
--   step         BIGINT   step whose weights were evaluated
--   env          VARCHAR  environment
--   k            BIGINT   samples drawn per prompt
--   prompts      BIGINT   held-out prompts
--   samples      BIGINT   sampled completions per prompt (the fewest any prompt has)
--   pass_at_k    DOUBLE   mean over prompts of the chance that one of k samples is correct
--   maj_at_k     DOUBLE   at k = samples only: share of prompts whose most common answer (ties: the
--                         smallest text) is correct; NULL at other k or where no sample states an answer
WITH rows AS (
    SELECT * FROM evals UNION ALL BY NAME SELECT NULL::INTEGER AS sample, NULL::VARCHAR AS answer WHERE false
),
sampled AS (SELECT * FROM rows WHERE sample IS NOT NULL),
prompts AS (
    SELECT run_id, step, env, example_id, count(*) AS n, CAST(sum(CAST(correct AS INTEGER)) AS BIGINT) AS c
    FROM sampled GROUP BY run_id, step, env, example_id
),
votes AS (
    SELECT run_id, step, env, example_id, answer, count(*) AS votes, bool_or(correct) AS correct
    FROM sampled WHERE answer IS NOT NULL GROUP BY ALL
),
majority AS (
    SELECT run_id, step, env, example_id, correct
    FROM votes
    QUALIFY row_number() OVER (PARTITION BY run_id, step, env, example_id ORDER BY votes DESC, answer) = 1
),
sizes AS (SELECT run_id, step, env, min(n) AS samples, count(*) AS prompts FROM prompts GROUP BY ALL),
maj AS (
    SELECT run_id, step, env, count(*) FILTER (WHERE correct) AS hits FROM majority GROUP BY ALL
),
per_k AS (
    SELECT p.run_id, p.step, p.env, k.k,
           CASE WHEN p.c = 0 THEN 0.0
                WHEN p.n - p.c < k.k THEN 1.0
                ELSE 1.0 - list_reduce(list_transform(range(p.n - p.c + 1, p.n + 1), lambda i: 1.0 - k.k / i),
                                       lambda a, b: a * b)
           END AS pass
    FROM prompts p
    JOIN sizes s USING (run_id, step, env)
    CROSS JOIN LATERAL (SELECT unnest(range(1, s.samples + 1)) AS k) k
)
SELECT
    per_k.run_id,
    per_k.step,
    per_k.env,
    per_k.k,
    s.prompts,
    s.samples,
    avg(per_k.pass) AS pass_at_k,
    CASE WHEN per_k.k = s.samples THEN maj.hits / s.prompts END AS maj_at_k
FROM per_k
JOIN sizes s USING (run_id, step, env)
LEFT JOIN maj USING (run_id, step, env)
GROUP BY per_k.run_id, per_k.step, per_k.env, per_k.k, s.prompts, s.samples, maj.hits
ORDER BY per_k.run_id, per_k.step, per_k.env, per_k.k
