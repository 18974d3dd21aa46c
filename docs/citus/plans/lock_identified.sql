\echo == the provider report: lock per shard, each table with its own bucket predicate
EXPLAIN (COSTS OFF)
SELECT b.identifier, s.id FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id AND s.bucket = b.bucket
WHERE b.bucket = ANY('{193}'::smallint[]) AND s.bucket = ANY('{193}'::smallint[]) AND b.identifier = ANY('{tly_x}'::text[])
ORDER BY s.id FOR NO KEY UPDATE OF s;
\echo == the discrepancies items, read apart: by (bucket, id) pairs, every shard they name
EXPLAIN (COSTS OFF)
SELECT o.id, o.tenant_key FROM outbox_items o WHERE (o.bucket, o.id) IN (SELECT * FROM unnest('{193,555}'::smallint[], '{1,2}'::bigint[]));
