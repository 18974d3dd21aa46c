-- claim, BestEffort, over one shard's buckets; generic plans forced (pgx prepares statements).
SET plan_cache_mode = auto;

SELECT array_agg(b ORDER BY b)::text AS shard_buckets FROM generate_series(0, 1023) b
WHERE get_shard_id_for_distribution_column('outbox_item_states', b) = get_shard_id_for_distribution_column('outbox_item_states', 555) \gset
PREPARE claim_be2(smallint[], int, interval, int, text, bool, interval) AS
WITH picked AS (
    SELECT id, bucket, state AS prev_state, lease_token AS prev_token, lease_owner AS prev_owner, leased_at AS prev_leased_at
    FROM (
        SELECT * FROM (
            SELECT o.id, o.bucket, o.state, o.lease_token, o.lease_owner, o.leased_at FROM outbox_item_states o
            WHERE o.bucket = ANY($1) AND o.state = 'leased' AND o.lease_expires_at < statement_timestamp() AND o.attempts - o.attempts_base < $2
              AND (o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - $3)
            ORDER BY o.lease_expires_at, o.id LIMIT $4 FOR UPDATE SKIP LOCKED) expired
        UNION ALL
        SELECT * FROM (
            SELECT o.id, o.bucket, o.state, o.lease_token, o.lease_owner, o.leased_at FROM outbox_item_states o
            WHERE o.bucket = ANY($1) AND o.state = 'pending' AND o.next_attempt_at IS NOT NULL AND o.next_attempt_at <= statement_timestamp() AND o.attempts - o.attempts_base < $2
              AND (o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - $3)
            ORDER BY o.next_attempt_at, o.id LIMIT $4 FOR UPDATE SKIP LOCKED) due
        LIMIT $4
    ) c
),
claimed AS (
    UPDATE outbox_item_states o SET
        state = 'leased', lease_token = o.lease_token + 1, attempts = o.attempts + 1,
        first_attempt_at = least(o.first_attempt_at, statement_timestamp()),
        lease_owner = $5, per_key_lease = $6, leased_at = statement_timestamp(),
        lease_expires_at = statement_timestamp() + $7, updated_at = statement_timestamp()
    WHERE o.bucket = ANY($1) AND o.id = ANY(ARRAY(SELECT id FROM picked))
      AND ((o.state = 'pending' COLLATE "C" AND o.next_attempt_at <= statement_timestamp())
        OR (o.state = 'leased' COLLATE "C" AND o.lease_expires_at < statement_timestamp()))
      AND o.attempts - o.attempts_base < $2
      AND (o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - $3)
    RETURNING o.*
)
SELECT o.id, o.bucket, o.state, o.lease_token, b.payload,
       to_timestamp((b.payload ->> 'timestamp')::bigint) NOT BETWEEN statement_timestamp() - interval '35 days'
                                                          AND statement_timestamp() + interval '5 minutes' AS timestamp_outside
FROM claimed o JOIN outbox_item_bodies b ON b.id = o.id AND b.bucket = o.bucket AND b.bucket = ANY($1)
ORDER BY o.id;
EXPLAIN (COSTS OFF) EXECUTE claim_be2(:'shard_buckets', 10, '24 hours', 50, 'probe', false, '1 minute');
