\echo == ingest keys with the closed months local (a reference table refuses the NOT EXISTS), then executed with RETURNING
BEGIN;
-- usage_closed_months stays a local table: as a reference table the NOT EXISTS is refused (correlated subquery with a set-returning FROM)
EXPLAIN (COSTS OFF)
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
SELECT nextval('usage_events_id_seq'), u.at, md5(u.e)::uuid, u.t, u.b
FROM unnest('{ten1,ten2}'::text[], '{193,11}'::smallint[], '{k1,k2}'::text[], '{2026-12-05T00:00:00Z,2026-12-05T00:00:00Z}'::timestamptz[]) AS u(t, b, e, at)
WHERE NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = date_trunc('month', u.at, 'UTC')::date)
ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
RETURNING event_row, tenant, event_key;
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
SELECT nextval('usage_events_id_seq'), u.at, md5(u.e)::uuid, u.t, u.b
FROM unnest('{ten1,ten1}'::text[], '{193,193}'::smallint[], '{k1,k2}'::text[], '{2026-12-05T00:00:00Z,2026-12-05T00:00:00Z}'::timestamptz[]) AS u(t, b, e, at)
WHERE NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = date_trunc('month', u.at, 'UTC')::date)
ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
RETURNING event_row, tenant, event_key;
ROLLBACK;
