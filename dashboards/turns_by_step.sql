-- Multi-turn episodes per run, step and turn: who wrote how many tokens, and the episodes' reward.
-- source: rollouts (turns, the spans of each episode) and scores. One row per (run_id, step, turn)
-- of multi-turn rollouts (none for single-turn runs), ordered by run_id, step, turn.
-- columns:
--   run_id         VARCHAR  run
--   step           BIGINT   step the episodes were generated for
--   turn           INTEGER  assistant turn (0 = the first); env spans count with the turn they answer
--   episodes       BIGINT   episodes that reached this turn
--   model_tokens   BIGINT   tokens the policy sampled in this turn (trained)
--   env_tokens     BIGINT   tokens the environment appended after it (weight 0), re-rendered
--                           contexts included
--   reward_mean    DOUBLE   mean reward of the episodes that reached this turn
WITH spans AS (
    SELECT run_id, step, sample_id, unnest(turns) AS t
    FROM rollouts
    WHERE turns IS NOT NULL
)
SELECT
    s.run_id,
    s.step,
    s.t.turn AS turn,
    count(DISTINCT s.sample_id) AS episodes,
    CAST(sum(CASE WHEN s.t.producer = 'model' THEN s.t.length ELSE 0 END) AS BIGINT) AS model_tokens,
    CAST(sum(CASE WHEN s.t.producer <> 'model' THEN s.t.length ELSE 0 END) AS BIGINT) AS env_tokens,
    avg(sc.reward) FILTER (WHERE s.t.producer = 'model') AS reward_mean
FROM spans s
LEFT JOIN scores sc ON sc.run_id = s.run_id AND sc.sample_id = s.sample_id
GROUP BY s.run_id, s.step, s.t.turn
ORDER BY s.run_id, s.step, turn
