\echo -- ingest as written, the bucket added to both inserts (one tenant)
EXPLAIN (COSTS OFF)
WITH u AS (
    SELECT t, b, e, f, v, ts, coalesce(ts, now()) AS at
    FROM unnest('{ten1,ten1}'::text[], '{995,995}'::smallint[], '{n1,n2}'::text[], '{api_calls,api_calls}'::text[], '{1,2}'::bigint[], '{2026-12-05T00:00:00Z,2026-12-05T00:00:00Z}'::timestamptz[])
        AS u(t, b, e, f, v, ts)
), k AS (
    INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
    SELECT nextval('usage_events_id_seq'), at, md5(e)::uuid, t, b FROM u
    WHERE NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = date_trunc('month', at, 'UTC')::date)
    ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
    RETURNING event_row, tenant, event_key, bucket
)
INSERT INTO usage_events (id, tenant, bucket, event_id, feature, value, occurred_at, timestamp_given) OVERRIDING SYSTEM VALUE
SELECT k.event_row, u.t, u.b, u.e, u.f, u.v, u.at, u.ts IS NOT NULL
FROM k JOIN u ON u.t = k.tenant AND md5(u.e)::uuid = k.event_key
RETURNING id, tenant, event_id, occurred_at;
