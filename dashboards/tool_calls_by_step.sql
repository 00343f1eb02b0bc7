-- Tool calls of multi-turn episodes per run, step and tool: how many, how many failed, their time.
-- source: rollouts (messages: the `tool_call` record each tool message carries, envs/mcp_tools.py).
-- One row per (run_id, step, server, tool) called (none for runs without tool calls), ordered by
-- run_id, step, server, tool.
-- columns:
--   run_id        VARCHAR  run
--   step          BIGINT   step the episodes were generated for
--   server        VARCHAR  MCP server owning the tool ('' for an unknown tool or a malformed call)
--   tool          VARCHAR  the tool's name as the model wrote it ('' for a malformed call)
--   calls         BIGINT   calls
--   errors        BIGINT   calls answered with an error (any kind)
--   timeouts      BIGINT   calls over the server's call_timeout_s
--   seconds_mean  DOUBLE   mean wall time of a call
WITH messages AS (
    SELECT run_id, step, unnest(from_json(messages, '["json"]')) AS m
    FROM rollouts
    WHERE messages IS NOT NULL
), records AS (
    SELECT run_id, step, m -> '$.tool_call' AS c
    FROM messages
    WHERE (m ->> '$.role') = 'tool' AND (m -> '$.tool_call') IS NOT NULL
)
SELECT
    run_id,
    step,
    c ->> '$.server' AS server,
    c ->> '$.name' AS tool,
    count(*) AS calls,
    count(*) FILTER (WHERE (c ->> '$.error') IS NOT NULL) AS errors,
    count(*) FILTER (WHERE (c ->> '$.error') = 'timeout') AS timeouts,
    avg(CAST(c ->> '$.seconds' AS DOUBLE)) AS seconds_mean
FROM records
GROUP BY ALL
ORDER BY run_id, step, server, tool
