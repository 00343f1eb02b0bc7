-- Which teacher shaped each step (on-policy distillation: rl.teacher, rl.distill.url), and how far
-- the student's samples were from it. source: rollouts rows the teacher scored (`teacher_logprobs`
-- set; `teacher`, `teacher_checkpoint` and `teacher_url` name it, null in rows of older runs). One
-- row per (run_id, step, teacher, teacher_checkpoint, teacher_url), ordered by those.
-- columns:
--   run_id             VARCHAR  run
--   step               BIGINT   step the completions were generated for
--   teacher            VARCHAR  the teacher's name (rl.teacher, else the served model's)
--   teacher_checkpoint VARCHAR  its checkpoint folder (in process) or the server's model root
--   teacher_url        VARCHAR  its server (null in process)
--   samples            BIGINT   completions it scored (with at least one token)
--   tokens             BIGINT   completion tokens it scored
--   reverse_kl         DOUBLE   mean per token of log p_student - log p_teacher (the sampled reverse KL)
WITH rows AS (
    SELECT * FROM rollouts UNION ALL BY NAME
    SELECT NULL::FLOAT[] AS teacher_logprobs, NULL::VARCHAR AS teacher, NULL::VARCHAR AS teacher_checkpoint,
           NULL::VARCHAR AS teacher_url WHERE false
),
scored AS (
    SELECT run_id, step, teacher, teacher_checkpoint, teacher_url, sample_id,
           unnest(completion_logprobs) AS student, unnest(teacher_logprobs) AS teacher_logprob
    FROM rows WHERE teacher_logprobs IS NOT NULL
)
SELECT
    run_id,
    step,
    teacher,
    teacher_checkpoint,
    teacher_url,
    count(DISTINCT sample_id) AS samples,
    count(*) AS tokens,
    avg(student - teacher_logprob) AS reverse_kl
FROM scored
GROUP BY run_id, step, teacher, teacher_checkpoint, teacher_url
ORDER BY run_id, step, teacher, teacher_checkpoint, teacher_url
