\echo == sqlBatchBuckets, the groups of one shard, bucket added
EXPLAIN (COSTS OFF)
SELECT g.n, b.wbucket, b.rows, b.wbucket + g.width + interval '5 minutes' <= statement_timestamp()
FROM unnest('{ten1,ten2}'::text[], '{193,11}'::smallint[], '{api_calls,api_calls}'::text[], '{1 hour,1 hour}'::interval[]) WITH ORDINALITY AS g(tenant, bucket, feature, width, n)
CROSS JOIN LATERAL (
    SELECT date_bin(g.width, u.occurred_at, '2000-01-01'::timestamptz) AS wbucket, count(*) AS rows
    FROM usage_events u
    WHERE u.bucket = ANY('{193,11}'::smallint[]) AND u.bucket = g.bucket
      AND u.tenant = g.tenant AND u.feature = g.feature AND u.item_id IS NULL
      AND u.occurred_at < statement_timestamp() - interval '5 minutes'
    GROUP BY 1
) b
ORDER BY g.n, b.wbucket;
\echo == sqlBatchRows, bucket added
EXPLAIN (COSTS OFF)
WITH locked AS (
    SELECT w.n, u.id, u.value, u.occurred_at
    FROM unnest('{ten1}'::text[], '{193}'::smallint[], '{api_calls}'::text[], '{2026-12-01}'::timestamptz[], '{2026-12-02}'::timestamptz[])
         WITH ORDINALITY AS w(tenant, bucket, feature, wfrom, wto, n)
    CROSS JOIN LATERAL (
        SELECT id, value, occurred_at FROM usage_events
        WHERE bucket = ANY('{193}'::smallint[]) AND bucket = w.bucket AND tenant = w.tenant AND feature = w.feature AND item_id IS NULL
          AND occurred_at >= w.wfrom AND occurred_at < w.wto
          AND w.wto + interval '5 minutes' <= statement_timestamp()
        FOR UPDATE SKIP LOCKED
    ) u
)
SELECT n, array_agg(id ORDER BY occurred_at, id), sum(value)::numeric,
       (array_agg(value ORDER BY occurred_at DESC, id DESC))[1], max(occurred_at)
FROM locked GROUP BY n ORDER BY n;
\echo == sqlEventRows, bucket added
EXPLAIN (COSTS OFF)
SELECT id, event_id, value, occurred_at FROM usage_events
WHERE bucket = 193 AND tenant = 'ten1' AND feature = 'api_calls' AND item_id IS NULL
  AND (NOT true OR date_bin(interval '1 hour', occurred_at, '2000-01-01'::timestamptz) + interval '1 hour' + interval '5 minutes' <= statement_timestamp())
  AND occurred_at <= statement_timestamp() + interval '5 minutes'
ORDER BY id LIMIT 500
FOR UPDATE SKIP LOCKED;
\echo == sqlWindowRows, bucket added
EXPLAIN (COSTS OFF)
WITH locked AS (
    SELECT id, value, occurred_at FROM usage_events
    WHERE bucket = 193 AND tenant = 'ten1' AND feature = 'api_calls' AND item_id IS NULL
      AND occurred_at >= '2026-12-01' AND occurred_at < '2026-12-02'
      AND '2026-12-02'::timestamptz + interval '5 minutes' <= statement_timestamp()
    FOR UPDATE SKIP LOCKED
)
SELECT coalesce(array_agg(id ORDER BY occurred_at, id), '{}'), coalesce(sum(value), 0)::numeric,
       (array_agg(value ORDER BY occurred_at DESC, id DESC))[1], max(occurred_at)
FROM locked;
\echo == marking the rows: UPDATE ... FROM unnest, bucket added, the window closure re-stated
EXPLAIN (COSTS OFF)
UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
FROM unnest('{1,2}'::bigint[], '{7,7}'::bigint[]) AS m(row_id, item)
WHERE u.bucket = ANY('{193}'::smallint[]) AND u.id = m.row_id AND u.item_id IS NULL
  AND u.occurred_at >= '2026-12-01' AND u.occurred_at < '2026-12-02'
  AND '2026-12-02'::timestamptz + interval '5 minutes' <= statement_timestamp();
\echo == marking the rows of per-event items (no window): as above without the range
EXPLAIN (COSTS OFF)
UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
FROM unnest('{1,2}'::bigint[], '{7,7}'::bigint[]) AS m(row_id, item)
WHERE u.bucket = ANY('{193}'::smallint[]) AND u.id = m.row_id AND u.item_id IS NULL;
\echo == enqueue as written (bodies INSERT CTE, states INSERT ... SELECT FROM body), bucket added
EXPLAIN (COSTS OFF)
WITH body AS (
    INSERT INTO outbox_item_bodies
        (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
    VALUES ('ten1', 'usage_window', 'w9', 'stripe_meter_event_stream', 'acct_1', 'test', 1,
            jsonb_build_object('identifier', 'x', 'value', 1, 'timestamp', 1), 193)
    ON CONFLICT ON CONSTRAINT outbox_items_identity_key DO NOTHING
    RETURNING id, bucket, identifier, exporter, mode, ordering_key, created_at
),
state AS (
    INSERT INTO outbox_item_states (id, bucket, exporter, mode, ordering_key, created_at, state, quarantine_reason)
    SELECT id, bucket, exporter, mode, ordering_key, created_at, 'pending', NULL FROM body
    RETURNING id, state
)
SELECT body.id, body.identifier, coalesce(state.state, '') FROM body LEFT JOIN state ON state.id = body.id;
\echo == enqueue, the bodies alone (VALUES, one tenant)
EXPLAIN (COSTS OFF)
INSERT INTO outbox_item_bodies
    (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
VALUES ('ten1', 'usage_window', 'w9', 'stripe_meter_event_stream', 'acct_1', 'test', 1,
        jsonb_build_object('identifier', 'x', 'value', 1, 'timestamp', 1), 193)
ON CONFLICT ON CONSTRAINT outbox_items_identity_key DO NOTHING
RETURNING id, bucket, identifier, exporter, mode, ordering_key, created_at;
\echo == enqueue for a batch, the bodies from unnest
EXPLAIN (COSTS OFF)
INSERT INTO outbox_item_bodies
    (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
SELECT * FROM unnest('{ten1}'::text[], '{usage_event}'::text[], '{e1}'::text[], '{stripe_meter_event_stream}'::text[], '{acct_1}'::text[],
                     '{test}'::text[], '{1}'::integer[], ARRAY['{}'::jsonb], '{193}'::smallint[])
ON CONFLICT ON CONSTRAINT outbox_items_identity_key DO NOTHING
RETURNING id, bucket, identifier, exporter, mode, ordering_key, created_at;
\echo == enqueue, the states from the bodies returned (unnest of their columns)
EXPLAIN (COSTS OFF)
INSERT INTO outbox_item_states (id, bucket, exporter, mode, ordering_key, created_at, state, quarantine_reason)
SELECT * FROM unnest('{1}'::bigint[], '{193}'::smallint[], '{stripe_meter_event_stream}'::text[], '{test}'::text[], '{k}'::text[],
                     '{2026-12-06}'::timestamptz[], '{pending}'::text[], '{NULL}'::text[]);
\echo == enqueue, the states from the co-located bodies by id (INSERT ... SELECT)
EXPLAIN (COSTS OFF)
INSERT INTO outbox_item_states (id, bucket, exporter, mode, ordering_key, created_at, state)
SELECT b.id, b.bucket, b.exporter, b.mode, b.ordering_key, b.created_at, 'pending' FROM outbox_item_bodies b
WHERE b.bucket = ANY('{193}'::smallint[]) AND b.id = ANY('{1}'::bigint[]);
\echo == stage, on conflict: the existing row through the view
EXPLAIN (COSTS OFF)
SELECT id, identifier, state, payload = '{}'::jsonb FROM outbox_items
WHERE bucket = 193 AND tenant_key = 'ten1' AND subject_kind = 'usage_window' AND subject_ref = 'w1' AND exporter = 'stripe_meter_event_stream'
  AND destination_account = 'acct_1' AND mode = 'test' AND mapping_version = 1;
