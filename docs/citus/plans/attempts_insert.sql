-- the attempts' INSERT as its own statement: rows from unnest of parameters, all of one shard's buckets.
PREPARE att(bigint[], smallint[], bigint[], text[], timestamptz[], text[], text[], bool[]) AS
INSERT INTO outbox_attempts (item_id, bucket, lease_token, lease_owner, leased_at, outcome, state_after, refused)
SELECT * FROM unnest($1, $2, $3, $4, $5, $6, $7, $8);
EXPLAIN (COSTS OFF) EXECUTE att('{1}', '{555}', '{1}', '{probe}', '{2026-12-06T00:00:00Z}', '{abandoned}', '{leased}', '{false}');
\echo -- the same as multi-row VALUES
EXPLAIN (COSTS OFF) INSERT INTO outbox_attempts (item_id, bucket, lease_token, lease_owner, leased_at, outcome, state_after, refused)
VALUES (1, 555, 1, 'probe', '2026-12-06T00:00:00Z', 'abandoned', 'leased', false), (4, 27, 1, 'probe', '2026-12-06T00:00:00Z', 'abandoned', 'leased', false);
SET plan_cache_mode = force_generic_plan;
\echo -- forced generic plan
EXPLAIN (COSTS OFF) EXECUTE att('{1}', '{555}', '{1}', '{probe}', '{2026-12-06T00:00:00Z}', '{abandoned}', '{leased}', '{false}');
