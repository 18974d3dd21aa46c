\echo == the fold of one shard group (the shard of bucket 193), called on the coordinator
SELECT array_agg(b ORDER BY b)::text AS sb FROM generate_series(0, 1023) b
WHERE get_shard_id_for_distribution_column('completeness_counters', b) = get_shard_id_for_distribution_column('completeness_counters', 193) \gset
SELECT count(*) AS rows, count(*) FILTER (WHERE slot <> 0) AS slotted, sum(ingested_events) ie, sum(pending_events) pe FROM completeness_counters WHERE bucket = ANY(:'sb'::smallint[]);
SELECT completeness_fold('2027-01-01', :'sb'::smallint[]);
SELECT count(*) AS rows, count(*) FILTER (WHERE slot <> 0) AS slotted, sum(ingested_events) ie, sum(pending_events) pe FROM completeness_counters WHERE bucket = ANY(:'sb'::smallint[]);
