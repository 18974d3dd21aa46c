-- seed.sql: a small Tally database on one server, before any bucket: 40 tenants,
-- 2,000 events, one item per tenant staged, a third of them leased and accepted.
BEGIN;
INSERT INTO tenant_mappings (tenant, stripe_customer_id, period_anchor, version, updated_by)
SELECT 'ten' || g, 'cus_ten' || g, CASE WHEN g % 2 = 0 THEN '2026-01-15T00:00:00Z'::timestamptz END, g, 'seed' FROM generate_series(1, 40) g;
INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given)
SELECT 'ten' || (g % 40 + 1), 'ev' || g, 'api_calls', g % 7 + 1, '2026-12-01T00:00:00Z'::timestamptz + g * interval '1 minute', true
FROM generate_series(1, 2000) g;
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant)
SELECT id, occurred_at, md5(event_id)::uuid, tenant FROM usage_events;
INSERT INTO outbox_item_bodies (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload)
SELECT t, 'usage_window', 'w1', 'stripe_meter_event_stream', 'acct_1', 'test', 1,
  jsonb_build_object('identifier', 'tly_' || encode(sha256(tally_utf8(t || '|usage_window|w1|stripe_meter_event_stream|acct_1|test|1')), 'hex'),
                     'value', s.v, 'timestamp', 1765000000, 'customer', 'cus_' || t, 'event_name', 'api_calls', 'period', '2026-12-01T00:00:00Z')
FROM (SELECT tenant AS t, sum(value) AS v FROM usage_events GROUP BY tenant) s;
INSERT INTO outbox_item_states (id, exporter, mode, ordering_key, state, created_at)
SELECT id, exporter, mode, ordering_key, 'pending', created_at FROM outbox_item_bodies;
UPDATE usage_events e SET item_id = b.id, staged_at = clock_timestamp() FROM outbox_item_bodies b WHERE b.tenant_key = e.tenant;
UPDATE outbox_item_states SET state = 'leased', lease_owner = 'seed', leased_at = clock_timestamp(),
    lease_expires_at = clock_timestamp() + interval '1 minute', lease_token = 1, attempts = 1, first_attempt_at = clock_timestamp()
WHERE id % 3 = 0;
INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused)
SELECT id, 1, 'seed', leased_at, 'accepted', 'accepted', false FROM outbox_item_states WHERE state = 'leased' AND id % 6 = 0;
UPDATE outbox_item_states SET state = 'accepted', accepted_at = clock_timestamp(), lease_expires_at = NULL
WHERE state = 'leased' AND id % 6 = 0;
COMMIT;
