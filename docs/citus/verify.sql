\echo == after tally migrate --distribute: what is where
SELECT citus_table_type, count(*) FROM citus_tables GROUP BY 1 ORDER BY 1;
\echo == the rows and the counters, as before distribution
SELECT (SELECT count(*) FROM usage_events) AS events, (SELECT count(*) FROM usage_event_keys) AS keys, (SELECT count(*) FROM outbox_item_states) AS items, (SELECT count(*) FROM outbox_attempts) AS attempts;
SELECT sum(ingested_events) ie, sum(unstaged_events) ue, sum(pending_events) pe, sum(accepted_events) ae, sum(cancelled_events) ce, sum(items) it, sum(ingested_value) iv FROM completeness_counters;
\echo == ingest (two tenants, two workers, one statement)
INSERT INTO usage_events (tenant, bucket, event_id, feature, value, occurred_at, timestamp_given)
VALUES ('ten1', tally_bucket('ten1'), 'post1', 'api_calls', 5, '2026-12-05T10:00:00Z', true), ('ten2', tally_bucket('ten2'), 'post1', 'api_calls', 7, '2026-12-05T10:00:00Z', true);
SELECT sum(ingested_events) ie, sum(unstaged_events) ue, sum(ingested_value) iv FROM completeness_counters;
\echo == staging ten1 event: the item, its state, the marking UPDATE, one transaction
SELECT id AS ev, occurred_at AS evat FROM usage_events WHERE tenant = 'ten1' AND event_id = 'post1' \gset
BEGIN;
INSERT INTO outbox_item_bodies (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
VALUES ('ten1', 'usage_window', 'w-post1', 'stripe_meter_event_stream', 'acct_1', 'test', 1,
        jsonb_build_object('identifier', 'tly_' || encode(sha256(tally_utf8('ten1|usage_window|w-post1|stripe_meter_event_stream|acct_1|test|1')), 'hex'),
                           'value', 5, 'timestamp', 1765000000, 'customer', 'cus_ten1', 'event_name', 'api_calls', 'period', '2026-12-01T00:00:00Z'), 193)
RETURNING id AS item \gset
INSERT INTO outbox_item_states (id, bucket, exporter, mode, ordering_key, state, created_at)
SELECT id, bucket, exporter, mode, ordering_key, 'pending', created_at FROM outbox_item_bodies WHERE bucket = 193 AND id = :item;
UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
FROM unnest(ARRAY[:ev]::bigint[], ARRAY[:item]::bigint[]) AS m(row_id, item)
WHERE u.bucket = ANY('{193}'::smallint[]) AND u.id = m.row_id AND u.item_id IS NULL;
COMMIT;
SELECT sum(unstaged_events) ue, sum(pending_events) pe, sum(items) it FROM completeness_counters;
\echo == lease then accept that item
UPDATE outbox_item_states SET state = 'leased', lease_owner = 'probe', leased_at = statement_timestamp(), lease_expires_at = statement_timestamp() + interval '1 minute', lease_token = lease_token + 1, attempts = attempts + 1, first_attempt_at = least(first_attempt_at, statement_timestamp()) WHERE bucket = 193 AND id = :item AND state = 'pending';
UPDATE outbox_item_states SET state = 'accepted', accepted_at = statement_timestamp(), lease_expires_at = NULL WHERE bucket = 193 AND id = :item AND state = 'leased';
SELECT sum(pending_events) pe, sum(accepted_events) ae FROM completeness_counters;
\echo == an edge the state machine refuses, on the shard
UPDATE outbox_item_states SET state = 'pending' WHERE bucket = 193 AND id = :item;
\echo == withdrawing a staged event of ten2 (its item loses it)
SELECT id AS ev2, occurred_at AS ev2at, event_id AS ev2id FROM usage_events WHERE tenant = 'ten2' AND item_id IS NOT NULL ORDER BY id LIMIT 1 \gset
SELECT sum(pending_events) pe, sum(accepted_events) ae, sum(cancelled_events) ce FROM completeness_counters WHERE tenant = 'ten2';
BEGIN;
UPDATE usage_events SET cancelled_at = statement_timestamp() WHERE bucket = tally_bucket('ten2') AND id = :ev2 AND occurred_at = :'ev2at';
INSERT INTO usage_cancellations (tenant, bucket, event_id, event_row, outcome, requested_by) VALUES ('ten2', tally_bucket('ten2'), :'ev2id', :ev2, 'withdrawn', 'probe');
COMMIT;
SELECT sum(pending_events) pe, sum(accepted_events) ae, sum(cancelled_events) ce FROM completeness_counters WHERE tenant = 'ten2';
\echo == a new month, and a shard move of the staged item group
SELECT usage_events_ensure_months('2027-06-01');
SELECT get_shard_id_for_distribution_column('outbox_item_states', 193) AS shard \gset
SELECT nodeport AS from_port FROM pg_dist_shard_placement WHERE shardid = :shard \gset
SELECT citus_move_shard_placement(:shard, '127.0.0.1', :from_port, '127.0.0.1', CASE WHEN :from_port = 26431 THEN 26432 ELSE 26431 END);
SELECT :from_port AS was_on, nodeport AS now_on FROM pg_dist_shard_placement WHERE shardid = :shard;
SELECT sum(ingested_events) ie, sum(unstaged_events) ue, sum(pending_events) pe, sum(accepted_events) ae, sum(cancelled_events) ce, sum(items) it FROM completeness_counters;
