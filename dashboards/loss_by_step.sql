-- Optimizer metrics per run and step: loss, gradient norm, learning rate, RL ratio statistics.
-- source: train_steps. One row per train_steps row, ordered by run_id, step.
-- columns:
--   run_id             VARCHAR  run
--   step               BIGINT   optimizer step
--   mode               VARCHAR  pretrain | sft | rl
--   loss               DOUBLE   training loss
--   grad_norm          DOUBLE   gradient norm before clipping
--   lr                 DOUBLE   learning rate used
--   tokens             BIGINT   tokens trained on
--   tokens_per_second  DOUBLE   training throughput
--   clip_fraction      DOUBLE   share of tokens whose ratio was clipped (RL with clipping, else NULL)
--   ratio_mean         DOUBLE   mean importance ratio (RL, else NULL)
--   logprob_gap        DOUBLE   mean |trainer - generator| log-prob (RL, else NULL)
--   entropy            DOUBLE   mean policy entropy over loss tokens, nats (NULL if not measured)
--   kl                 DOUBLE   mean KL estimate to the reference policy (RL with rl.loss.kl_coef > 0, else NULL)
SELECT
    run_id,
    step,
    mode,
    loss,
    grad_norm,
    lr,
    tokens,
    tokens_per_second,
    clip_fraction,
    ratio_mean,
    logprob_gap,
    entropy,
    kl
FROM train_steps
ORDER BY run_id, step
