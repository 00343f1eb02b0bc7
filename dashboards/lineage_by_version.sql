-- Per registered checkpoint: what trained it (steps, rollouts sampled and trained) and the version it started from
-- source: checkpoints, origins, train_steps, rollouts, advantages, scores. One row per checkpoint
-- with a model version, ordered by run_id, step. The data of version (model, version) is the run's
-- rows at steps <= its step; `rlpipe lineage models:/NAME/VERSION` prints the same and the samples.
-- columns:
--   run_id                VARCHAR  run that registered the version
--   step                  BIGINT   step of the checkpoint (= the version's last training step)
--   model                 VARCHAR  models:/NAME/VERSION
--   parent_model          VARCHAR  models:/NAME/VERSION it started from (null: not registered, or a preset)
--   parent_checkpoint     VARCHAR  checkpoint folder it started from (null: a fresh preset)
--   steps_trained         BIGINT   optimizer steps up to the checkpoint
--   rollouts_sampled      BIGINT   rollouts sampled for those steps (0 for SFT)
--   samples_trained       BIGINT   rollouts trained on (advantages rows)
--   groups_trained        BIGINT   groups trained on
--   reward_mean_trained   DOUBLE   mean reward of the trained rollouts
WITH versions AS (
    SELECT run_id, step, 'models:/' || mlflow_model_name || '/' || mlflow_model_version AS model
    FROM checkpoints WHERE mlflow_model_version IS NOT NULL
)
SELECT
    v.run_id,
    v.step,
    v.model,
    any_value(CASE WHEN o.parent_model_version IS NOT NULL
                   THEN 'models:/' || o.parent_model_name || '/' || o.parent_model_version END) AS parent_model,
    any_value(o.parent_checkpoint) AS parent_checkpoint,
    (SELECT count(*) FROM train_steps t WHERE t.run_id = v.run_id AND t.step <= v.step) AS steps_trained,
    (SELECT count(*) FROM rollouts r WHERE r.run_id = v.run_id AND r.step <= v.step) AS rollouts_sampled,
    (SELECT count(*) FROM advantages a WHERE a.run_id = v.run_id AND a.step <= v.step) AS samples_trained,
    (SELECT count(DISTINCT a.group_id) FROM advantages a WHERE a.run_id = v.run_id AND a.step <= v.step) AS groups_trained,
    (SELECT avg(s.reward) FROM advantages a JOIN scores s ON s.run_id = a.run_id AND s.sample_id = a.sample_id
      WHERE a.run_id = v.run_id AND a.step <= v.step) AS reward_mean_trained
FROM versions v
LEFT JOIN origins o ON o.run_id = v.run_id
GROUP BY v.run_id, v.step, v.model
ORDER BY v.run_id, v.step
