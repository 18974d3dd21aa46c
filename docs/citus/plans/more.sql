\set B '''{27,95,114,199,300,325,332,349,370,404,423,482,491,513,540,552,555,613,669,846,887,890,894,898,905,941,976,983,992}''::smallint[]'
\echo == supersede
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states o SET state = 'superseded', superseded_by = 30, updated_at = statement_timestamp()
FROM outbox_item_bodies b
WHERE o.bucket = 95 AND b.bucket = 95 AND o.id = 29 AND b.id = o.id AND o.state = 'quarantined' AND b.mapping_version = 1 AND o.refused_attempts = o.attempts;
\echo == withdraw
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states SET state = 'withdrawn', quarantine_reason = NULL, updated_at = statement_timestamp()
WHERE bucket = 95 AND id = 29 AND state IN ('pending', 'quarantined') AND refused_attempts = attempts;
\echo == fail_accepted
EXPLAIN (COSTS OFF)
WITH b AS (SELECT * FROM unnest('{29}'::bigint[], '{rejected}'::text[], '{x}'::text[], '{c}'::text[], '{400}'::int[], '{m}'::text[]) AS b(id, target, reason, code, status, message)),
locked AS MATERIALIZED (SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE)
UPDATE outbox_item_states o SET state = b.target, quarantine_reason = nullif(b.reason, ''),
    refused_attempts = CASE WHEN o.attempts - o.refused_attempts <= 1 THEN o.attempts ELSE o.refused_attempts END,
    last_error_code = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''), updated_at = statement_timestamp()
FROM b WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked) AND o.state = 'accepted'
RETURNING o.id, o.state;
\echo == the error report note on an item in flight
EXPLAIN (COSTS OFF)
WITH b AS (SELECT * FROM unnest('{29}'::bigint[], '{rejected}'::text[], '{x}'::text[], '{c}'::text[], '{m}'::text[]) AS b(id, target, reason, code, message)),
locked AS MATERIALIZED (SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE)
UPDATE outbox_item_states o SET reported_state = b.target, reported_reason = nullif(b.reason, ''), reported_code = b.code, reported_message = nullif(b.message, '')
FROM b WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked)
  AND o.state IN ('pending', 'leased', 'uncertain') RETURNING o.id;
\echo == unpark
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states o SET next_attempt_at = statement_timestamp(), updated_at = statement_timestamp()
WHERE o.bucket = ANY(:B) AND o.id IN (
    SELECT p.id FROM unnest('{acct_1|cus_x}'::text[]) AS k(key)
    JOIN LATERAL (
        SELECT p.id FROM outbox_item_states p
        WHERE p.bucket = ANY(:B) AND p.state = 'pending' AND p.ordering_key >= split_part(k.key, '|', 1) || '|'
          AND p.exporter = 'stripe_meter_event_stream' AND p.next_attempt_at > statement_timestamp()
          AND p.next_attempt_at <= statement_timestamp() + interval '1 minute'
        FOR UPDATE SKIP LOCKED) p ON true)
  AND o.state = 'pending';
\echo == ingest sqlExisting with the bucket
EXPLAIN (COSTS OFF)
SELECT u.t, u.i, e.event_id, e.feature, e.value, e.occurred_at, e.timestamp_given, k.occurred_at, u.at
FROM unnest('{ten1}'::text[], '{193}'::smallint[], '{ev1}'::text[], '{2026-12-05}'::timestamptz[]) AS u(t, b, i, at)
LEFT JOIN usage_event_keys k ON k.bucket = u.b AND k.tenant = u.t AND k.event_key = md5(u.i)::uuid AND k.bucket = ANY('{193}'::smallint[])
LEFT JOIN usage_events e ON e.bucket = k.bucket AND e.id = k.event_row AND e.occurred_at = k.occurred_at AND e.bucket = ANY('{193}'::smallint[]);
