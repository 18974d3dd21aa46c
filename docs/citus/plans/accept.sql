-- accept, as written (the attempts INSERT in a CTE), with the bucket added
EXPLAIN (COSTS OFF)
WITH b AS (SELECT * FROM unnest('{29}'::bigint[], '{95}'::smallint[], '{1}'::bigint[], '{mev_1}'::text[], '{m}'::text[]) AS b(id, bucket, token, ref, meter)),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY('{95}'::smallint[]) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_item_states o SET
        state = coalesce(o.reported_state, 'accepted'), quarantine_reason = o.reported_reason,
        provider_ref = nullif(b.ref, ''), meter = nullif(b.meter, ''), accepted_at = statement_timestamp(),
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM b
    WHERE o.bucket = ANY('{95}'::smallint[]) AND o.id = b.id AND o.bucket = b.bucket AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased' COLLATE "C"
    RETURNING o.id, o.bucket, o.lease_token, o.lease_owner, o.leased_at, o.state, o.provider_ref, o.quarantine_reason
),
log AS (
    INSERT INTO outbox_attempts (item_id, bucket, lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref)
    SELECT id, bucket, lease_token, lease_owner, leased_at, 'accepted', state, false, provider_ref FROM t
)
SELECT id, state, coalesce(quarantine_reason, '') FROM t;
\echo -- accept, the transition alone (the attempts in a second statement)
EXPLAIN (COSTS OFF)
WITH b AS (SELECT * FROM unnest('{29}'::bigint[], '{95}'::smallint[], '{1}'::bigint[], '{mev_1}'::text[], '{m}'::text[]) AS b(id, bucket, token, ref, meter)),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY('{95}'::smallint[]) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_item_states o SET
        state = coalesce(o.reported_state, 'accepted'), quarantine_reason = o.reported_reason,
        provider_ref = nullif(b.ref, ''), meter = nullif(b.meter, ''), accepted_at = statement_timestamp(),
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM b
    WHERE o.bucket = ANY('{95}'::smallint[]) AND o.id = b.id AND o.bucket = b.bucket AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased' COLLATE "C"
    RETURNING o.id, o.bucket, o.lease_token, o.lease_owner, o.leased_at, o.state, o.provider_ref, o.quarantine_reason
)
SELECT id, bucket, lease_token, lease_owner, leased_at, state, provider_ref, coalesce(quarantine_reason, '') FROM t;
\echo -- the attempts of the accepted items: INSERT ... SELECT from the co-located state rows
EXPLAIN (COSTS OFF)
INSERT INTO outbox_attempts (item_id, bucket, lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref)
SELECT o.id, o.bucket, o.lease_token, o.lease_owner, o.leased_at, 'accepted', o.state, false, o.provider_ref
FROM outbox_item_states o JOIN unnest('{29}'::bigint[], '{1}'::bigint[]) AS b(id, token) ON o.id = b.id AND o.lease_token = b.token
WHERE o.bucket = ANY('{95}'::smallint[]);
\echo -- the same without the unnest join
EXPLAIN (COSTS OFF)
INSERT INTO outbox_attempts (item_id, bucket, lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref)
SELECT o.id, o.bucket, o.lease_token, o.lease_owner, o.leased_at, 'accepted', o.state, false, o.provider_ref
FROM outbox_item_states o WHERE o.bucket = ANY('{95}'::smallint[]) AND o.id = ANY('{29}'::bigint[]);
