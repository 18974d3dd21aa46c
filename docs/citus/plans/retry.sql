\set B '''{27,95,114,199,300,325,332,349,370,404,423,482,491,513,540,552,555,613,669,846,887,890,894,898,905,941,976,983,992}''::smallint[]'
SET citus.log_remote_commands = on;
\echo == retry rewritten: the clock read once in the FROM list (UTC timestamp), the CASE and SET do immutable arithmetic on it
EXPLAIN (COSTS OFF)
WITH locked AS MATERIALIZED (SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE),
t AS (
    UPDATE outbox_item_states o SET
        state = CASE WHEN o.attempts - o.attempts_base >= 10 THEN 'uncertain'
                     WHEN o.refused_attempts + b.refused::int < o.attempts
                          AND b.now_utc + b.delay_us * interval '1 microsecond' > (o.first_attempt_at AT TIME ZONE 'UTC') + interval '24 hours' THEN 'uncertain'
                     ELSE 'pending' END,
        next_attempt_at = (b.now_utc + b.delay_us * interval '1 microsecond') AT TIME ZONE 'UTC',
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM (SELECT u.*, statement_timestamp() AT TIME ZONE 'UTC' AS now_utc
          FROM unnest('{29}'::bigint[], '{1}'::bigint[], '{1000000}'::bigint[], '{false}'::bool[]) AS u(id, token, delay_us, refused)) b
    WHERE o.bucket = ANY(:B) AND o.id = b.id AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.bucket, o.lease_token, o.lease_owner, o.leased_at, o.state)
SELECT * FROM t;
