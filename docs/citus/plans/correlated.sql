\echo == a correlated subquery on a distributed table over unnest (as completeness_events reads periods)
EXPLAIN (COSTS OFF)
SELECT e.id, (SELECT (b.payload ->> 'period') FROM outbox_item_bodies b WHERE b.id = e.item_id AND b.bucket = ANY('{193}'::smallint[]))
FROM unnest('{1}'::bigint[], '{1}'::bigint[]) AS e(id, item_id);
\echo == the same as a LEFT JOIN
EXPLAIN (COSTS OFF)
SELECT e.id, b.payload ->> 'period'
FROM unnest('{1}'::bigint[], '{1}'::bigint[]) AS e(id, item_id)
LEFT JOIN outbox_item_bodies b ON b.id = e.item_id AND b.bucket = ANY('{193}'::smallint[]);
