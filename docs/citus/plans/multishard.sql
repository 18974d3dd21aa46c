\echo == a group commit of two tenants on two workers: keys then rows, one transaction (two-phase commit), the triggers firing on both
SELECT tally_bucket('ten1') b1, tally_bucket('ten4') b4 \gset
SELECT (SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = get_shard_id_for_distribution_column('usage_events', :b1)) AS n1,
       (SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = get_shard_id_for_distribution_column('usage_events', :b4)) AS n4;
SELECT sum(ingested_events) ie FROM completeness_counters;
BEGIN;
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
SELECT nextval('usage_events_id_seq'), u.at, md5(u.e)::uuid, u.t, u.b
FROM unnest(ARRAY['ten1','ten4'], ARRAY[:b1, :b4]::smallint[], '{gc2,gc2}'::text[], '{2026-12-05T00:00:00Z,2026-12-05T00:00:00Z}'::timestamptz[]) AS u(t, b, e, at)
ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
RETURNING event_row, tenant;
INSERT INTO usage_events (id, tenant, bucket, event_id, feature, value, occurred_at, timestamp_given) OVERRIDING SYSTEM VALUE
SELECT k.event_row, k.tenant, k.bucket, 'gc2', 'api_calls', 3, k.occurred_at, true FROM usage_event_keys k
WHERE k.bucket = ANY(ARRAY[:b1]::smallint[]) AND k.tenant = 'ten1' AND k.event_key = md5('gc2')::uuid;
INSERT INTO usage_events (id, tenant, bucket, event_id, feature, value, occurred_at, timestamp_given) OVERRIDING SYSTEM VALUE
SELECT k.event_row, k.tenant, k.bucket, 'gc2', 'api_calls', 3, k.occurred_at, true FROM usage_event_keys k
WHERE k.bucket = ANY(ARRAY[:b4]::smallint[]) AND k.tenant = 'ten4' AND k.event_key = md5('gc2')::uuid;
COMMIT;
SELECT sum(ingested_events) ie FROM completeness_counters;
\echo == the enqueue form that warned before: INSERT INTO states SELECT FROM bodies over two workers
INSERT INTO outbox_item_bodies (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
SELECT t, 'usage_window', 'gcw2', 'stripe_meter_event_stream', 'acct_1', 'test', 1,
  jsonb_build_object('identifier', 'tly_' || encode(sha256(tally_utf8(t || '|usage_window|gcw2|stripe_meter_event_stream|acct_1|test|1')), 'hex'),
                     'value', 3, 'timestamp', 1765000000, 'customer', 'cus_' || t, 'event_name', 'api_calls', 'period', '2026-12-01T00:00:00Z'),
  tally_bucket(t)
FROM (VALUES ('ten1'), ('ten4')) v(t);
INSERT INTO outbox_item_states (id, bucket, exporter, mode, ordering_key, state, created_at)
SELECT id, bucket, exporter, mode, ordering_key, 'pending', created_at FROM outbox_item_bodies WHERE subject_ref = 'gcw2';
SELECT count(*) FROM outbox_item_states s JOIN outbox_item_bodies b ON b.id = s.id AND b.bucket = s.bucket WHERE b.subject_ref = 'gcw2';
\echo == and a multi-row UPDATE of ledger rows on two workers (staging two tenants at once, which the design avoids)
UPDATE usage_events u SET item_id = b.id, staged_at = statement_timestamp()
FROM outbox_item_bodies b WHERE b.subject_ref = 'gcw2' AND b.bucket = u.bucket AND u.tenant = b.tenant_key AND u.event_id = 'gc2' AND u.item_id IS NULL;
