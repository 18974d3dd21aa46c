\echo == reconcile: a key items, by the buckets of the tenants mapped to its customer
EXPLAIN (COSTS OFF)
SELECT b.id, s.state, (b.payload ->> 'value')::bigint, (b.payload ->> 'timestamp')::bigint,
       s.state = 'accepted' AND s.accepted_at < statement_timestamp() - interval '1 hour', b.identifier, b.tenant_key, coalesce(s.meter, '')
FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id AND s.bucket = b.bucket
WHERE b.bucket = ANY('{193}'::smallint[]) AND b.ordering_key = 'acct_1|cus_ten1|api_calls' AND b.mode = 'test'
  AND (b.payload ->> 'timestamp')::bigint >= 0 AND (b.payload ->> 'timestamp')::bigint < 2000000000
  AND s.state IN ('accepted', 'confirmed', 'uncertain', 'pending', 'leased')
ORDER BY 4, 1;
\echo == reconcile: a key items as written (no bucket): every shard
EXPLAIN (COSTS OFF)
SELECT b.id FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id
WHERE b.ordering_key = 'acct_1|cus_ten1|api_calls' AND b.mode = 'test';
\echo == reconcile: the settled keys of a destination (multi-shard by nature), joined on the bucket
EXPLAIN (COSTS OFF)
SELECT b.ordering_key, b.payload ->> 'customer', b.payload ->> 'event_name', b.destination_account,
       min((b.payload ->> 'timestamp')::bigint), max((b.payload ->> 'timestamp')::bigint)
FROM outbox_item_states s JOIN outbox_item_bodies b ON b.id = s.id AND b.bucket = s.bucket
WHERE b.destination_account = ANY('{acct_1}'::text[]) AND s.mode = 'test'
  AND ((s.state = 'accepted' AND s.accepted_at < statement_timestamp() - interval '1 hour') OR s.state = 'uncertain')
  AND s.ordering_key COLLATE "C" > ''
GROUP BY 1, 2, 3, 4 ORDER BY b.ordering_key COLLATE "C";
\echo == the provider report: lock items by identifier, as written (no bucket)
EXPLAIN (COSTS OFF)
SELECT b.identifier, s.id FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id AND s.bucket = b.bucket
WHERE b.identifier = ANY('{tly_x}'::text[]) ORDER BY s.id FOR NO KEY UPDATE OF s;
\echo == the provider report: find the buckets first (no lock, every shard), then lock per shard
EXPLAIN (COSTS OFF) SELECT identifier, id, bucket FROM outbox_item_bodies WHERE identifier = ANY('{tly_x}'::text[]);
EXPLAIN (COSTS OFF)
SELECT b.identifier, s.id FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id AND s.bucket = b.bucket
WHERE b.bucket = ANY('{193}'::smallint[]) AND b.identifier = ANY('{tly_x}'::text[]) ORDER BY s.id FOR NO KEY UPDATE OF s;
\echo == discrepancies: a local table with a LATERAL read of the distributed view
EXPLAIN (COSTS OFF)
SELECT d.id, w.tenants FROM reconcile_discrepancies d
LEFT JOIN LATERAL (SELECT array_agg(DISTINCT o.tenant_key) AS tenants FROM outbox_items o WHERE o.id = ANY(d.expected_items || d.uncertain_items)) w ON true;
\echo == the completeness report: a month counters (every shard, grouped)
EXPLAIN (COSTS OFF)
SELECT tenant, feature, period, account, sum(ingested_events)::bigint, sum(ingested_value)::text, sum(items)::bigint
FROM completeness_counters
WHERE period >= '2026-12-01' AND period < '2027-01-01'
GROUP BY tenant, feature, period, account ORDER BY tenant, feature, period, account;
\echo == the completeness report for one tenant
EXPLAIN (COSTS OFF)
SELECT tenant, feature, period, account, sum(ingested_events)::bigint
FROM completeness_counters
WHERE period >= '2026-12-01' AND period < '2027-01-01' AND bucket = 193 AND tenant = 'ten1'
GROUP BY tenant, feature, period, account;
\echo == cancellation: the event and its key (by tenant)
EXPLAIN (COSTS OFF)
SELECT e.id, e.occurred_at, e.item_id FROM usage_event_keys k JOIN usage_events e ON e.id = k.event_row AND e.occurred_at = k.occurred_at AND e.bucket = k.bucket
WHERE k.bucket = 193 AND k.tenant = 'ten1' AND k.event_key = md5('ev1')::uuid FOR UPDATE OF e;
\echo == cancellation: mark the event
EXPLAIN (COSTS OFF)
UPDATE usage_events SET cancelled_at = statement_timestamp() WHERE bucket = 193 AND id = 1 AND occurred_at = '2026-12-01T00:01:00Z';
\echo == cancellation: record it
EXPLAIN (COSTS OFF)
INSERT INTO usage_cancellations (tenant, bucket, event_id, event_row, outcome, requested_by)
VALUES ('ten1', 193, 'ev1', 1, 'withdrawn', 'probe') RETURNING id;
\echo == cancellation: count the root item events (tally_root_item inlined as a recursive CTE with the bucket)
EXPLAIN (COSTS OFF)
WITH RECURSIVE chain (id, depth) AS (
    SELECT 7::bigint, 0
    UNION ALL
    SELECT o.id, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.superseded_by = c.id WHERE o.bucket = 193 AND c.depth < 1000)
SELECT count(*) FROM usage_events WHERE bucket = 193 AND item_id = (SELECT id FROM chain ORDER BY depth DESC LIMIT 1) AND cancelled_at IS NULL;
\echo == ingest, rewritten: the keys from unnest (closed months a reference table), then the rows
EXPLAIN (COSTS OFF)
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
SELECT nextval('usage_events_id_seq'), u.at, md5(u.e)::uuid, u.t, u.b
FROM unnest('{ten1,ten1}'::text[], '{193,193}'::smallint[], '{n1,n2}'::text[], '{2026-12-05T00:00:00Z,2026-12-05T00:00:00Z}'::timestamptz[]) AS u(t, b, e, at)
ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
RETURNING event_row, tenant, event_key;
EXPLAIN (COSTS OFF)
INSERT INTO usage_events (id, tenant, bucket, event_id, feature, value, occurred_at, timestamp_given) OVERRIDING SYSTEM VALUE
VALUES (100001, 'ten1', 193, 'n1', 'api_calls', 1, '2026-12-05T00:00:00Z', true), (100002, 'ten1', 193, 'n2', 'api_calls', 1, '2026-12-05T00:00:00Z', true)
RETURNING id, tenant, event_id, occurred_at;
