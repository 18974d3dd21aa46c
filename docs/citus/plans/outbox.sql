\set B '''{27,95,114,199,300,325,332,349,370,404,423,482,491,513,540,552,555,613,669,846,887,890,894,898,905,941,976,983,992}''::smallint[]'
\echo == claim PerKey first try (bucket list of one shard; horizon as first_attempt_at > now - horizon; no INSERT CTE)
EXPLAIN (COSTS OFF)
WITH picked AS (
    SELECT id, state AS prev_state, lease_token AS prev_token, lease_owner AS prev_owner, leased_at AS prev_leased_at
    FROM (
        SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at FROM (
            SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at, o.ordering_key, o.lease_expires_at, o.bucket
            FROM outbox_item_states o
            WHERE o.bucket = ANY(:B) AND o.state = 'leased' AND o.lease_expires_at < statement_timestamp() AND o.attempts - o.attempts_base < 10
              AND (o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - interval '24 hours')
            ORDER BY o.lease_expires_at, o.id LIMIT 200 FOR UPDATE SKIP LOCKED) o
        WHERE NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.bucket = ANY(:B) AND l.state = 'leased' AND l.ordering_key = o.ordering_key
                          AND l.id <> o.id AND (l.lease_expires_at >= statement_timestamp() OR l.per_key_lease
                                                OR (l.lease_expires_at, l.id) < (o.lease_expires_at, o.id)))
        UNION ALL
        SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at FROM (
            SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at, o.ordering_key, o.next_attempt_at
            FROM outbox_item_states o
            WHERE o.bucket = ANY(:B) AND o.state = 'pending' AND o.next_attempt_at IS NOT NULL AND o.next_attempt_at <= statement_timestamp() AND o.attempts - o.attempts_base < 10
              AND (o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - interval '24 hours')
            ORDER BY o.next_attempt_at, o.id LIMIT 200 FOR UPDATE SKIP LOCKED) o
        WHERE NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.bucket = ANY(:B) AND l.state = 'leased' AND l.ordering_key = o.ordering_key OFFSET 0)
          AND NOT EXISTS (SELECT 1 FROM outbox_item_states p WHERE p.bucket = ANY(:B) AND p.state = 'pending' AND p.ordering_key = o.ordering_key
                          AND (p.next_attempt_at, p.id) < (o.next_attempt_at, o.id) AND p.attempts - p.attempts_base < 10
                          AND (p.refused_attempts = p.attempts OR p.first_attempt_at > statement_timestamp() - interval '24 hours'))
        LIMIT 50
    ) c
),
claimed AS (
    UPDATE outbox_item_states o SET
        state = 'leased', lease_token = o.lease_token + 1, attempts = o.attempts + 1,
        first_attempt_at = least(o.first_attempt_at, statement_timestamp()),
        lease_owner = 'probe', per_key_lease = true, leased_at = statement_timestamp(),
        lease_expires_at = statement_timestamp() + interval '1 minute', updated_at = statement_timestamp()
    WHERE o.bucket = ANY(:B) AND o.id = ANY(ARRAY(SELECT id FROM picked))
      AND ((o.state = 'pending' COLLATE "C" AND o.next_attempt_at <= statement_timestamp())
        OR (o.state = 'leased' COLLATE "C" AND o.lease_expires_at < statement_timestamp()))
      AND o.attempts - o.attempts_base < 10
      AND (o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - interval '24 hours')
    RETURNING o.*
)
SELECT o.id, o.bucket, p.prev_state, p.prev_token, p.prev_owner, p.prev_leased_at, b.payload
FROM claimed o JOIN picked p ON p.id = o.id JOIN outbox_item_bodies b ON b.id = o.id AND b.bucket = o.bucket AND b.bucket = ANY(:B)
ORDER BY o.id;
\echo == claim PerKey step 1 (materialized CTEs, DISTINCT ON, advisory try-locks)
EXPLAIN (COSTS OFF)
WITH expired AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.lease_expires_at AS due_at, 0 AS pass FROM outbox_item_states o
    WHERE o.bucket = ANY(:B) AND o.state = 'leased' AND o.lease_expires_at < statement_timestamp() AND o.attempts - o.attempts_base < 10
      AND o.ordering_key <> ALL('{}'::text[])
    ORDER BY o.lease_expires_at, o.id LIMIT 200
),
due AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.next_attempt_at AS due_at, 1 AS pass FROM outbox_item_states o
    WHERE o.bucket = ANY(:B) AND o.state = 'pending' AND o.next_attempt_at IS NOT NULL AND o.next_attempt_at <= statement_timestamp()
      AND o.ordering_key <> ALL('{}'::text[])
    ORDER BY o.next_attempt_at, o.id LIMIT 200
),
firsts AS MATERIALIZED (
    SELECT DISTINCT ON (c.ordering_key) c.ordering_key, c.id, c.due_at
    FROM (SELECT * FROM expired UNION ALL SELECT * FROM due) c
    ORDER BY c.ordering_key, c.pass, c.due_at, c.id
),
cand AS MATERIALIZED (
    SELECT f.ordering_key, f.id FROM firsts f
    WHERE NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.bucket = ANY(:B) AND l.state = 'leased' AND l.ordering_key = f.ordering_key AND l.id <> f.id
                      AND (l.lease_expires_at >= statement_timestamp() OR l.per_key_lease))
    ORDER BY f.due_at, f.ordering_key
),
locked AS MATERIALIZED (
    SELECT k.id FROM cand k
    WHERE pg_try_advisory_xact_lock(7, hashtext(k.ordering_key))
    LIMIT 50
)
SELECT ARRAY(SELECT ordering_key FROM cand), ARRAY(SELECT id FROM locked), (SELECT count(*) FROM due) >= 200;
\echo == claim PerKey step 1b: the loose index scan (recursive CTE)
EXPLAIN (COSTS OFF)
WITH RECURSIVE keys(ordering_key) AS (
    (SELECT o.ordering_key FROM outbox_item_states o WHERE o.bucket = ANY(:B) AND o.state = 'pending' ORDER BY o.ordering_key LIMIT 1)
    UNION ALL
    SELECT (SELECT o.ordering_key FROM outbox_item_states o
            WHERE o.bucket = ANY(:B) AND o.state = 'pending' AND o.ordering_key > k.ordering_key
            ORDER BY o.ordering_key LIMIT 1)
    FROM keys k WHERE k.ordering_key IS NOT NULL
)
SELECT k.ordering_key, h.id FROM keys k
CROSS JOIN LATERAL (
    SELECT o.id, o.next_attempt_at AS due_at FROM outbox_item_states o
    WHERE o.bucket = ANY(:B) AND o.ordering_key = k.ordering_key AND o.state = 'pending' AND o.next_attempt_at IS NOT NULL AND o.next_attempt_at <= statement_timestamp()
    ORDER BY o.next_attempt_at, o.id LIMIT 1
) h
WHERE k.ordering_key IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.bucket = ANY(:B) AND l.state = 'leased' AND l.ordering_key = k.ordering_key AND l.id <> h.id
                      AND (l.lease_expires_at >= statement_timestamp() OR l.per_key_lease))
ORDER BY h.due_at, k.ordering_key
LIMIT 200;
\echo == claim PerKey step 2 (FOR UPDATE OF o in a join with unnest)
EXPLAIN (COSTS OFF)
WITH picked AS (
    SELECT o.id, o.state AS prev_state, o.lease_token AS prev_token, o.lease_owner AS prev_owner, o.leased_at AS prev_leased_at
    FROM unnest('{1,2}'::bigint[]) WITH ORDINALITY AS k(id, n)
    JOIN outbox_item_states o ON o.id = k.id
    WHERE o.bucket = ANY(:B) AND ((o.state = 'leased' AND o.lease_expires_at < statement_timestamp()) OR (o.state = 'pending' AND o.next_attempt_at <= statement_timestamp()))
      AND NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.bucket = ANY(:B) AND l.state = 'leased' AND l.ordering_key = o.ordering_key AND l.id <> o.id
                      AND (l.lease_expires_at >= statement_timestamp() OR l.per_key_lease))
    ORDER BY k.n LIMIT 50
    FOR UPDATE OF o SKIP LOCKED
),
claimed AS (
    UPDATE outbox_item_states o SET state = 'leased', lease_token = o.lease_token + 1, attempts = o.attempts + 1,
        first_attempt_at = least(o.first_attempt_at, statement_timestamp()), lease_owner = 'probe', per_key_lease = true,
        leased_at = statement_timestamp(), lease_expires_at = statement_timestamp() + interval '1 minute', updated_at = statement_timestamp()
    WHERE o.bucket = ANY(:B) AND o.id = ANY(ARRAY(SELECT id FROM picked))
      AND ((o.state = 'pending' COLLATE "C" AND o.next_attempt_at <= statement_timestamp())
        OR (o.state = 'leased' COLLATE "C" AND o.lease_expires_at < statement_timestamp()))
    RETURNING o.*
)
SELECT o.id, b.payload FROM claimed o JOIN outbox_item_bodies b ON b.id = o.id AND b.bucket = o.bucket AND b.bucket = ANY(:B) ORDER BY o.id;
\echo == retry as written: timestamptz + interval on a column in SET and CASE
EXPLAIN (COSTS OFF)
WITH b AS (SELECT * FROM unnest('{29}'::bigint[], '{1}'::bigint[], '{1000000}'::bigint[], '{false}'::bool[]) AS b(id, token, delay_us, refused)),
t AS (
    UPDATE outbox_item_states o SET
        state = CASE WHEN o.attempts - o.attempts_base >= 10 THEN 'uncertain'
                     WHEN o.refused_attempts + b.refused::int < o.attempts
                          AND statement_timestamp() + b.delay_us * interval '1 microsecond' > o.first_attempt_at + interval '24 hours' THEN 'uncertain'
                     ELSE 'pending' END,
        next_attempt_at = statement_timestamp() + b.delay_us * interval '1 microsecond',
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM b WHERE o.bucket = ANY(:B) AND o.id = b.id AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.state)
SELECT * FROM t;
\echo == retry rewritten: the arithmetic in UTC timestamps (immutable), the clock a constant
EXPLAIN (COSTS OFF)
WITH b AS (SELECT * FROM unnest('{29}'::bigint[], '{1}'::bigint[], '{1000000}'::bigint[], '{false}'::bool[]) AS b(id, token, delay_us, refused)),
locked AS MATERIALIZED (SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE),
t AS (
    UPDATE outbox_item_states o SET
        state = CASE WHEN o.attempts - o.attempts_base >= 10 THEN 'uncertain'
                     WHEN o.refused_attempts + b.refused::int < o.attempts
                          AND (statement_timestamp() AT TIME ZONE 'UTC') + b.delay_us * interval '1 microsecond'
                              > (o.first_attempt_at AT TIME ZONE 'UTC') + interval '24 hours' THEN 'uncertain'
                     ELSE 'pending' END,
        next_attempt_at = ((statement_timestamp() AT TIME ZONE 'UTC') + b.delay_us * interval '1 microsecond') AT TIME ZONE 'UTC',
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM b WHERE o.bucket = ANY(:B) AND o.id = b.id AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.bucket, o.lease_token, o.lease_owner, o.leased_at, o.state)
SELECT * FROM t;
\echo == sweep, per shard (bucket list), attempts INSERT out of the statement
EXPLAIN (COSTS OFF)
WITH due AS MATERIALIZED (
    SELECT o.id, o.state AS prev_state FROM outbox_item_states o
    WHERE o.bucket = ANY(:B) AND ((o.state = 'pending' AND o.attempts > 0) OR (o.state = 'leased' AND o.lease_expires_at < statement_timestamp()))
      AND (o.attempts - o.attempts_base >= 10 OR (o.refused_attempts < o.attempts AND o.first_attempt_at <= statement_timestamp() - interval '24 hours'))
    ORDER BY o.id FOR UPDATE SKIP LOCKED
),
t AS (
    UPDATE outbox_item_states o SET state = 'uncertain',
        last_error_code = CASE WHEN o.attempts - o.attempts_base >= 10 THEN 'attempt_cap' ELSE 'horizon' END,
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM due d
    WHERE o.bucket = ANY(:B) AND o.id = d.id
      AND (o.state = 'pending' OR (o.state = 'leased' AND o.lease_expires_at < statement_timestamp()))
      AND (o.attempts - o.attempts_base >= 10 OR (o.refused_attempts < o.attempts AND o.first_attempt_at <= statement_timestamp() - interval '24 hours'))
    RETURNING o.id, o.bucket, d.prev_state, o.lease_token, o.lease_owner, o.leased_at, o.last_error_code, o.last_error)
SELECT * FROM t;
\echo == sweep as written: no bucket (every shard)
EXPLAIN (COSTS OFF)
SELECT o.id FROM outbox_item_states o WHERE (o.state = 'pending' AND o.attempts > 0) ORDER BY o.id FOR UPDATE SKIP LOCKED;
\echo == confirm
EXPLAIN (COSTS OFF)
WITH locked AS MATERIALIZED (SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(:B) AND o.id = ANY('{29}'::bigint[]) ORDER BY o.id FOR UPDATE)
UPDATE outbox_item_states o SET state = 'confirmed', confirmed_at = statement_timestamp(), updated_at = statement_timestamp()
WHERE o.bucket = ANY(:B) AND o.id IN (SELECT id FROM locked) AND o.state = 'accepted' RETURNING o.id;
\echo == recover as written: a CASE holding the clock
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states SET state = 'accepted',
    accepted_at = CASE WHEN 'accepted' = 'accepted' THEN statement_timestamp() ELSE accepted_at END, updated_at = statement_timestamp()
WHERE bucket = 95 AND id = 29 AND state = 'uncertain' AND lease_token = 1;
\echo == recover with the CASE on a parameter
PREPARE rec(text) AS UPDATE outbox_item_states SET state = $1,
    accepted_at = CASE WHEN $1 = 'accepted' THEN statement_timestamp() ELSE accepted_at END, updated_at = statement_timestamp()
WHERE bucket = 95 AND id = 29 AND state = 'uncertain' AND lease_token = 1;
EXPLAIN (COSTS OFF) EXECUTE rec('accepted');
\echo == requeue (join with the bodies)
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states o SET state = 'pending', quarantine_reason = NULL, next_attempt_at = statement_timestamp(), attempts_base = o.attempts, updated_at = statement_timestamp()
FROM outbox_item_bodies b
WHERE o.bucket = 95 AND o.id = 29 AND b.bucket = o.bucket AND b.id = o.id AND o.state = 'quarantined' AND b.mapping_version = 1;
\echo == requeue without the bucket on the join
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states o SET updated_at = statement_timestamp()
FROM outbox_item_bodies b WHERE o.bucket = 95 AND o.id = 29 AND b.id = o.id AND o.state = 'quarantined';
\echo == the cancellation lock through tally_live_item(id, bucket)
EXPLAIN (COSTS OFF) SELECT id FROM outbox_item_states WHERE bucket = 95 AND id = tally_live_item(29, 95::smallint) FOR UPDATE;
\echo == the same, the chain inlined as a recursive CTE
EXPLAIN (COSTS OFF)
WITH RECURSIVE chain (id, next, depth) AS (
    SELECT id, superseded_by, 0 FROM outbox_item_states WHERE bucket = 95 AND id = 29
    UNION ALL
    SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.id = c.next WHERE o.bucket = 95 AND c.depth < 1000)
SELECT s.id FROM outbox_item_states s WHERE s.bucket = 95 AND s.id = (SELECT id FROM chain WHERE next IS NULL) FOR UPDATE;
\echo == park
EXPLAIN (COSTS OFF)
UPDATE outbox_item_states o SET next_attempt_at = statement_timestamp() + interval '1 minute', updated_at = statement_timestamp()
WHERE o.bucket = ANY(:B) AND o.id IN (
    SELECT p.id FROM unnest('{acct_1|cus_x}'::text[]) AS k(key)
    JOIN LATERAL (
        SELECT p.id FROM outbox_item_states p
        WHERE p.bucket = ANY(:B) AND p.state = 'pending' AND p.ordering_key >= split_part(k.key, '|', 1) || '|'
          AND p.ordering_key < split_part(k.key, '|', 1) || '}'
          AND p.exporter = 'stripe_meter_event_stream' AND p.next_attempt_at <= statement_timestamp()
        LIMIT 100 FOR UPDATE SKIP LOCKED
    ) p ON true
    LIMIT 100)
  AND o.state = 'pending' AND o.next_attempt_at <= statement_timestamp();
\echo == the gauge (every shard, counts)
EXPLAIN (COSTS OFF)
SELECT (SELECT count(*) FROM outbox_item_states WHERE state = 'pending' AND created_at IS NOT NULL),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'leased');
