-- Every sampled completion with its fate, reward, advantage, length and texts: the report's rollout browser.
-- source: the fates view joined with rollouts on (run_id, sample_id), and advantages (trained completions only).
-- One row per completion, ordered by run_id, step, sample_id.
-- columns:
--   run_id               VARCHAR  run
--   step                 BIGINT   the step that sampled it
--   policy_version       BIGINT   the weights that generated it
--   group_id             VARCHAR  its group (one prompt, one policy version)
--   sample_id            VARCHAR  the completion's id
--   env                  VARCHAR  environment
--   example_id           VARCHAR  example (prompt) id
--   status               VARCHAR  its fate (fates.status; 'pending' when not decided yet)
--   reason               VARCHAR  why (fates.reason)
--   trained_step         BIGINT   the step that trained it (NULL unless trained)
--   reward               DOUBLE   its reward (NULL on reward_error)
--   advantage            DOUBLE   its advantage (NULL unless trained)
--   n_completion_tokens  BIGINT   completion length (tokens)
--   finish_reason        VARCHAR  why generation stopped
--   prompt_text          VARCHAR  the prompt
--   completion_text      VARCHAR  the completion (all turns of a multi-turn episode)
--   n_turns              BIGINT   turns of a multi-turn episode (NULL for single-turn)
--   turns                VARCHAR  the turns' spans as JSON [{turn, producer, start, length, reward}] (NULL for single-turn)
--   messages             VARCHAR  a multi-turn transcript as JSON chat messages (NULL for single-turn)
WITH adv AS (
    SELECT run_id, sample_id, any_value(advantage) AS advantage
    FROM advantages
    GROUP BY ALL
)
SELECT
    f.run_id,
    CAST(f.step AS BIGINT) AS step,
    CAST(f.policy_version AS BIGINT) AS policy_version,
    f.group_id,
    f.sample_id,
    r.env,
    r.example_id,
    coalesce(f.status, 'pending') AS status,
    f.reason,
    CAST(f.trained_step AS BIGINT) AS trained_step,
    CAST(f.reward AS DOUBLE) AS reward,
    CAST(a.advantage AS DOUBLE) AS advantage,
    CAST(r.n_completion_tokens AS BIGINT) AS n_completion_tokens,
    r.finish_reason,
    r.prompt_text,
    r.completion_text,
    CAST(r.n_turns AS BIGINT) AS n_turns,
    CAST(to_json(r.turns) AS VARCHAR) AS turns,
    r.messages
FROM fates AS f
JOIN rollouts AS r ON r.run_id = f.run_id AND r.sample_id = f.sample_id
LEFT JOIN adv AS a ON a.run_id = f.run_id AND a.sample_id = f.sample_id
ORDER BY f.run_id, f.step, f.sample_id
