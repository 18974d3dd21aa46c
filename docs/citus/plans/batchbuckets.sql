\echo == sqlBatchBuckets rewritten: a join grouped at the top, not a LATERAL aggregate
EXPLAIN (COSTS OFF)
SELECT g.n, date_bin(g.width, u.occurred_at, '2000-01-01'::timestamptz) AS wbucket, count(*) AS rows,
       date_bin(g.width, u.occurred_at, '2000-01-01'::timestamptz) + g.width + interval '5 minutes' <= statement_timestamp()
FROM unnest('{ten1,ten2}'::text[], '{193,11}'::smallint[], '{api_calls,api_calls}'::text[], '{1 hour,1 hour}'::interval[]) WITH ORDINALITY AS g(tenant, bucket, feature, width, n)
JOIN usage_events u ON u.bucket = g.bucket AND u.tenant = g.tenant AND u.feature = g.feature
WHERE u.bucket = ANY('{193,11}'::smallint[]) AND u.item_id IS NULL
  AND u.occurred_at < statement_timestamp() - interval '5 minutes'
GROUP BY g.n, g.width, 2
ORDER BY g.n, 2;
\echo == sqlBatchBuckets with LATERAL, without the clock in the select list
EXPLAIN (COSTS OFF)
SELECT g.n, b.wbucket, b.rows
FROM unnest('{ten1,ten2}'::text[], '{193,11}'::smallint[], '{api_calls,api_calls}'::text[], '{1 hour,1 hour}'::interval[]) WITH ORDINALITY AS g(tenant, bucket, feature, width, n)
CROSS JOIN LATERAL (
    SELECT date_bin(g.width, u.occurred_at, '2000-01-01'::timestamptz) AS wbucket, count(*) AS rows
    FROM usage_events u
    WHERE u.bucket = ANY('{193,11}'::smallint[]) AND u.bucket = g.bucket
      AND u.tenant = g.tenant AND u.feature = g.feature AND u.item_id IS NULL
    GROUP BY 1
) b;
