-- The completeness report from the ledger (quarantine.LedgerCompletenessOf):
-- every ledger event of the periods starting in [@from, @to), attributed to
-- the state of the item that carries it now. A staged event's period is its
-- item's; an unstaged one's comes from its tenant's current anchor. Every
-- event falls in exactly one bucket; what breaks the identity is an event
-- whose item cannot be followed to a live one ("missing") or an item whose
-- value is not the reduction of its events (bad).
--
-- Its cost stays linear in the month's events and items whatever plan the
-- planner picks, from statistics that have not seen the month or that
-- believe it larger than it is. It runs with nested loops off (the caller's
-- SET LOCAL), so no join of two parts becomes a loop reading one part once
-- per row of the other; the LATERAL subqueries stay nested loops that read
-- one index entry a row, or none.

-- ev, grouped: the month's events grouped by the item that carries them, so
-- each item is read once, not once per event; a tenant's anchor is read
-- only for an event not yet staged. The latest value is the greatest
-- (microsecond, id, value) array, a plain aggregate that hashes: an ordered
-- one would sort the whole month first.
WITH RECURSIVE ev AS (
    SELECT e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id,
           CASE WHEN e.cancelled_at IS NOT NULL
                THEN coalesce((SELECT c.outcome FROM usage_cancellations c WHERE c.event_row = e.id), 'withdrawn') END AS cancel,
           CASE WHEN e.item_id IS NULL THEN tally_period_start(e.occurred_at,
               coalesce((SELECT t.period_anchor FROM tenant_mappings t WHERE t.tenant = e.tenant), '1970-01-01T00:00:00Z'))
           END AS unstaged_period
    FROM usage_events e
    WHERE e.occurred_at >= @from AND e.occurred_at < @to::timestamptz + interval '32 days'
      AND (@tenant = '' OR e.tenant = @tenant)
),
grouped AS MATERIALIZED (
    SELECT tenant, feature, item_id, unstaged_period, coalesce(cancel = 'withdrawn', false) AS gone, count(*) AS n, sum(value) AS v,
           (max(ARRAY[(extract(epoch FROM occurred_at) * 1000000)::bigint, id, value]))[3] AS last_value,
           count(*) FILTER (WHERE cancel IS NOT NULL) AS cn, coalesce(sum(value) FILTER (WHERE cancel IS NOT NULL), 0) AS cv
    FROM ev GROUP BY 1, 2, 3, 4, 5
),
-- span: the month's items, but for stragglers, are a contiguous run of ids,
-- so their states and bodies are read as one range of the primary key and
-- hashed with the month's items: a cost that does not grow with history,
-- where a probe costs two B-tree descents an item. A range holding more
-- than 4n + 256 ids is emptied, and every item is then probed ("near" finds
-- nothing), as is an item outside the range (a successor made later).
-- Never a join without the range: a planner that believes the month large
-- merges its items with every state there is.
span AS MATERIALIZED (
    SELECT lo, CASE WHEN hi - lo < 4 * n + 256 THEN hi ELSE lo - 1 END AS hi
    FROM (SELECT min(item_id) AS lo, max(item_id) AS hi, count(item_id) AS n FROM grouped) m
),
-- chain: every item followed to the end of its chain of successors in one
-- recursive scan, carrying its group along. Most items have no successor;
-- their period and value come from one body row (live), and the body of
-- the item the events name is read only for a superseded one.
chain (tenant, feature, start, n, v, last_value, cn, cv, id, next, state, depth) AS (
    SELECT g.tenant, g.feature, g.item_id, g.n, g.v, g.last_value, g.cn, g.cv, s.id, s.superseded_by, s.state, 0
    FROM grouped g
    LEFT JOIN outbox_item_states near ON near.id = g.item_id
        AND near.id BETWEEN (SELECT lo FROM span) AND (SELECT hi FROM span)
    CROSS JOIN LATERAL (SELECT near.id, near.superseded_by, near.state WHERE near.id IS NOT NULL
                        UNION ALL
                        SELECT s.id, s.superseded_by, s.state FROM outbox_item_states s WHERE near.id IS NULL AND s.id = g.item_id) s
    WHERE NOT g.gone
    UNION ALL
    SELECT c.tenant, c.feature, c.start, c.n, c.v, c.last_value, c.cn, c.cv, s.id, s.superseded_by, s.state, c.depth + 1
    FROM chain c
    CROSS JOIN LATERAL (SELECT s.id, s.superseded_by, s.state FROM outbox_item_states s WHERE s.id = c.next LIMIT 1) s
    WHERE c.depth < 1000
),
per_item AS (
    SELECT c.tenant, c.feature, c.start AS item_id, c.n, c.v, c.last_value, c.cn, c.cv, c.state,
           live.subject_kind, live.mapping_version, (live.payload ->> 'value')::numeric AS live_value, live.destination_account,
           coalesce((live.payload ->> 'late')::boolean, false) AS late,
           (CASE WHEN c.id = c.start THEN live.payload ->> 'period'
                 ELSE (SELECT b.payload ->> 'period' FROM outbox_item_bodies b WHERE b.id = c.start) END)::timestamptz AS period
    FROM chain c
    LEFT JOIN outbox_item_bodies near ON near.id = c.id
        AND near.id BETWEEN (SELECT lo FROM span) AND (SELECT hi FROM span)
    CROSS JOIN LATERAL (SELECT near.subject_kind, near.mapping_version, near.payload, near.destination_account
                        WHERE near.id IS NOT NULL
                        UNION ALL
                        SELECT b.subject_kind, b.mapping_version, b.payload, b.destination_account
                        FROM outbox_item_bodies b WHERE near.id IS NULL AND b.id = c.id) live
    WHERE c.next IS NULL
    UNION ALL
    SELECT g.tenant, g.feature, g.item_id, g.n, g.v, g.last_value, 0, 0,
           CASE WHEN g.gone THEN 'cancelled' WHEN g.item_id IS NULL THEN 'unstaged' ELSE 'missing' END,
           NULL, NULL, NULL, NULL, false,
           CASE WHEN g.item_id IS NULL THEN g.unstaged_period
                ELSE (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = g.item_id) END
    FROM grouped g
    WHERE g.gone OR g.item_id IS NULL OR NOT EXISTS (SELECT FROM chain c WHERE c.start = g.item_id AND c.next IS NULL)
),
-- aggregations: the aggregation in force is looked up once per feature and
-- mapping version among the month's items (one jsonb object an item reads
-- its key of), not once per item: a lookup an item costs a probe each, and
-- a join with a set of pairs could be planned as a nested loop.
aggregations AS (
    SELECT coalesce(jsonb_object_agg(k.feature || '@' || k.mapping_version,
               (SELECT fv.aggregation FROM feature_mapping_versions fv
                WHERE fv.feature = k.feature AND fv.version <= k.mapping_version
                ORDER BY fv.version DESC LIMIT 1)), '{}') AS of
    FROM (SELECT DISTINCT feature, mapping_version FROM per_item WHERE mapping_version IS NOT NULL) k
),
resolved AS (
    SELECT p.tenant, p.feature, p.period, p.state, p.n, p.v, p.cn, p.cv, p.late, p.destination_account,
           CASE
             WHEN p.subject_kind IS NULL THEN true
             WHEN p.subject_kind = 'usage_event' THEN p.live_value = p.v AND p.n = 1
             WHEN (SELECT of FROM aggregations) ->> (p.feature || '@' || p.mapping_version) = 'last'
               THEN p.live_value = p.last_value
             ELSE p.live_value = p.v
           END AS consistent
    FROM per_item p
    WHERE p.period >= @from AND p.period < @to
),
buckets AS (
    SELECT tenant, feature, period, state, sum(n - cn) AS n, sum(v - cv) AS v, count(*) FILTER (WHERE NOT consistent) AS bad,
           coalesce(sum(n - cn) FILTER (WHERE late), 0) AS late_n, coalesce(sum(v - cv) FILTER (WHERE late), 0) AS late_v,
           coalesce(array_agg(DISTINCT destination_account) FILTER (WHERE destination_account IS NOT NULL), '{}') AS accounts
    FROM resolved GROUP BY 1, 2, 3, 4
    UNION ALL
    SELECT tenant, feature, period, 'cancelled', sum(cn), sum(cv), 0, 0, 0, '{}'
    FROM resolved WHERE cn > 0 GROUP BY 1, 2, 3
)
-- A line's ingested total is a window sum over its buckets, not a join of
-- two aggregates (a quadratic join again).
SELECT tenant, feature, period,
       (sum(n) OVER line)::bigint, (sum(v) OVER line)::text, state, n::bigint, v::text, bad, late_n::bigint, late_v::text, accounts
FROM buckets
WINDOW line AS (PARTITION BY tenant, feature, period)
ORDER BY 1, 2, 3, 6
