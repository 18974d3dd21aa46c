-- Draft: the completeness counters' trigger functions made shard-local.
--
-- On Citus a trigger of a distributed table fires on the shard, on the
-- worker, once per shard-level statement with that shard's rows only
-- (findings §2). Inside it, Citus plans every query on a distributed or
-- reference table again, and refuses three things (findings §2.1):
--   * a query that names a transition table and a Citus table together
--     ("unrecognized RTE kind: 7", "executor could not find named
--     tuplestore"): the transition table is read into arrays first;
--   * a query that does not prune to one shard ("cannot execute a
--     distributed query from a query on a shard"): every reference to a
--     distributed table — each table of a join, each subquery — carries
--     `bucket = ANY (bk)` itself, bk being the buckets of the firing rows
--     (all of one shard); a join's equality on the bucket is not enough;
--   * a generic plan of a statement with parameters, inside a function
--     ("could not create distributed plan … parameters in SQL
--     functions"): the functions force custom plans, where they forced
--     generic ones (planning once per call, as before the counters'
--     migration 43 made them generic).
-- The same text runs on plain Postgres, where the extra predicates are
-- redundant. Runs after distribute.sql's parts A and B (the bucket
-- columns and keys), before or after part C.
--
-- Rewritten here: the ingest path (completeness_ledger_insert), staging
-- and cancelling (completeness_ledger_update, completeness_events,
-- completeness_cancel), the item paths (completeness_item_insert,
-- completeness_item_update, which every transition fires) and what they
-- call (completeness_bump, completeness_refresh, tally_live_item), and a
-- cancellation's (completeness_cancellation_insert). Not yet:
-- completeness_anchor (goes on Citus: findings §1.7),
-- completeness_recount, tally_root_item — the same rules apply. The fold
-- takes a shard group's buckets.

\set ON_ERROR_STOP on
BEGIN;

-- completeness_bump adds deltas to the counters; each delta's bucket is
-- its tenant's, so the INSERT routes to the firing shard. Citus plans an
-- INSERT … SELECT only with its parameters' values.
CREATE OR REPLACE FUNCTION completeness_bump(d completeness_delta[]) RETURNS bigint
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
DECLARE
    n bigint;
BEGIN
    INSERT INTO completeness_counters AS c
    SELECT period, tenant, feature, account, completeness_slot(),
           ie, iv, ce, cv, ae, av, pe, pv, ue, uv, qe, qv, ne, nv, re, rv, xe, xv, le, lv, it, bad, tally_bucket(tenant)
    FROM (
        SELECT period, tenant, feature, account,
               sum(events) AS ie, sum(value) AS iv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'confirmed'), 0) AS ce,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'confirmed'), 0) AS cv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'accepted'), 0) AS ae,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'accepted'), 0) AS av,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'pending'), 0) AS pe,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'pending'), 0) AS pv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'unstaged'), 0) AS ue,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'unstaged'), 0) AS uv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'quarantined'), 0) AS qe,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'quarantined'), 0) AS qv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'uncertain'), 0) AS ne,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'uncertain'), 0) AS nv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'rejected'), 0) AS re,
               coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'rejected'), 0) AS rv,
               sum(CASE WHEN bucket = 'cancelled' THEN events ELSE cancelled_events END) AS xe,
               sum(CASE WHEN bucket = 'cancelled' THEN value ELSE cancelled_value END) AS xv,
               coalesce(sum(events - cancelled_events) FILTER (WHERE late), 0) AS le,
               coalesce(sum(value - cancelled_value) FILTER (WHERE late), 0) AS lv,
               sum(items) AS it, coalesce(sum(items) FILTER (WHERE inconsistent), 0) AS bad
        FROM unnest(d)
        WHERE period IS NOT NULL
        GROUP BY period, tenant, feature, account
    ) s
    WHERE (ie, iv, ce, cv, ae, av, pe, pv, ue, uv, qe, qv, ne, nv, re, rv, xe, xv, le, lv, it, bad)
          IS DISTINCT FROM (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    ORDER BY period, tenant, feature, account
    ON CONFLICT (period, tenant, feature, account, slot, bucket) DO UPDATE SET
        ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
        confirmed_events = c.confirmed_events + excluded.confirmed_events, confirmed_value = c.confirmed_value + excluded.confirmed_value,
        accepted_events = c.accepted_events + excluded.accepted_events, accepted_value = c.accepted_value + excluded.accepted_value,
        pending_events = c.pending_events + excluded.pending_events, pending_value = c.pending_value + excluded.pending_value,
        unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value,
        quarantined_events = c.quarantined_events + excluded.quarantined_events, quarantined_value = c.quarantined_value + excluded.quarantined_value,
        uncertain_events = c.uncertain_events + excluded.uncertain_events, uncertain_value = c.uncertain_value + excluded.uncertain_value,
        rejected_events = c.rejected_events + excluded.rejected_events, rejected_value = c.rejected_value + excluded.rejected_value,
        cancelled_events = c.cancelled_events + excluded.cancelled_events, cancelled_value = c.cancelled_value + excluded.cancelled_value,
        period_closed_events = c.period_closed_events + excluded.period_closed_events,
        period_closed_value = c.period_closed_value + excluded.period_closed_value,
        items = c.items + excluded.items, inconsistent = c.inconsistent + excluded.inconsistent;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- tally_live_item follows an item's successors within its bucket: a
-- successor is its predecessor's tenant's, so the chain never leaves it.
CREATE OR REPLACE FUNCTION tally_live_item(item bigint, bk smallint) RETURNS bigint
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    WITH RECURSIVE chain (id, next, depth) AS (
        SELECT id, superseded_by, 0 FROM outbox_item_states WHERE id = item AND bucket = bk
        UNION ALL
        SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.id = c.next
        WHERE o.bucket = bk AND c.depth < 1000
    )
    SELECT id FROM chain WHERE next IS NULL
$$;

CREATE OR REPLACE FUNCTION completeness_refresh(roots bigint[], bk smallint[]) RETURNS completeness_delta[]
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
DECLARE
    deltas completeness_delta[];
BEGIN
    PERFORM FROM completeness_items WHERE item_id = ANY (roots) AND bucket = ANY (bk) ORDER BY item_id, tenant, feature FOR UPDATE;
    WITH cur AS (
        SELECT a.*, CASE WHEN c.superseded_by IS NULL THEN a.carrier
                         ELSE coalesce(tally_live_item(a.carrier, a.bucket), a.carrier) END AS live
        FROM completeness_items a
        LEFT JOIN outbox_item_states c ON c.id = a.carrier AND c.bucket = a.bucket AND c.bucket = ANY (bk)
        WHERE a.item_id = ANY (roots) AND a.bucket = ANY (bk)
    ),
    nxt AS (
        SELECT cur.item_id, cur.tenant, cur.feature, cur.bucket AS shard_bucket, cur.live,
               CASE WHEN cur.events = 0 THEN NULL ELSE completeness_bucket(s.state) END AS bucket,
               b.destination_account AS account,
               coalesce((b.payload ->> 'late')::boolean, false) AS late,
               CASE WHEN b.subject_kind = 'usage_event' THEN (b.payload ->> 'value')::numeric = cur.value AND cur.events = 1
                    WHEN completeness_last_aggregation(cur.feature, b.mapping_version)
                    THEN (b.payload ->> 'value')::numeric = cur.last_value
                    ELSE (b.payload ->> 'value')::numeric = cur.value END IS FALSE AS inconsistent
        FROM cur
        LEFT JOIN outbox_item_states s ON s.id = cur.live AND s.bucket = cur.bucket AND s.bucket = ANY (bk)
        LEFT JOIN outbox_item_bodies b ON b.id = cur.live AND b.bucket = cur.bucket AND b.bucket = ANY (bk)
    ),
    upd AS (
        UPDATE completeness_items a SET carrier = nxt.live, applied_bucket = nxt.bucket, applied_account = nxt.account,
            applied_late = nxt.late, applied_inconsistent = nxt.inconsistent,
            applied_events = a.events, applied_value = a.value,
            applied_cancelled_events = a.cancelled_events, applied_cancelled_value = a.cancelled_value
        FROM nxt WHERE a.item_id = nxt.item_id AND a.tenant = nxt.tenant AND a.feature = nxt.feature
            AND a.bucket = nxt.shard_bucket AND a.bucket = ANY (bk)
        RETURNING a.*
    )
    SELECT array(
        SELECT ROW(period, tenant, feature, applied_account, applied_bucket, applied_late, applied_inconsistent,
                   -1, -applied_events, -applied_value, -applied_cancelled_events, -applied_cancelled_value)::completeness_delta
        FROM cur WHERE applied_bucket IS NOT NULL
        UNION ALL
        SELECT ROW(period, tenant, feature, applied_account, applied_bucket, applied_late, applied_inconsistent,
                   1, applied_events, applied_value, applied_cancelled_events, applied_cancelled_value)::completeness_delta
        FROM upd WHERE applied_bucket IS NOT NULL) INTO deltas;
    RETURN deltas;
END
$$;

CREATE OR REPLACE FUNCTION completeness_item_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
DECLARE
    ids   bigint[] := array(SELECT n.id FROM completeness_new n);
    bk    smallint[] := array(SELECT DISTINCT n.bucket FROM completeness_new n);
    roots bigint[];
BEGIN
    roots := array(SELECT DISTINCT a.item_id FROM completeness_items a WHERE a.carrier = ANY (ids) AND a.bucket = ANY (bk));
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_bump(completeness_refresh(roots, bk));
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION completeness_item_update() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
DECLARE
    moved bigint[];
    bk    smallint[] := array(SELECT DISTINCT n.bucket FROM completeness_new n);
    roots bigint[];
BEGIN
    -- An item's old and new rows paired by a grouping on its id, as the
    -- ledger's update pairs an event's; the transition tables alone.
    moved := array(
        SELECT c.id
        FROM (SELECT s.id,
                     min(s.state) FILTER (WHERE s.sign < 0) AS was_state, min(s.superseded_by) FILTER (WHERE s.sign < 0) AS was_superseded_by,
                     min(s.state) FILTER (WHERE s.sign > 0) AS state, min(s.superseded_by) FILTER (WHERE s.sign > 0) AS superseded_by
              FROM (SELECT -1 AS sign, o.id, o.state, o.superseded_by FROM completeness_old o
                    UNION ALL
                    SELECT 1, n.id, n.state, n.superseded_by FROM completeness_new n) s
              GROUP BY s.id) c
        WHERE completeness_bucket(c.state) <> completeness_bucket(c.was_state) OR c.superseded_by IS DISTINCT FROM c.was_superseded_by);
    IF cardinality(moved) = 0 THEN
        RETURN NULL;
    END IF;
    roots := array(SELECT DISTINCT a.item_id FROM completeness_items a WHERE a.carrier = ANY (moved) AND a.bucket = ANY (bk));
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_bump(completeness_refresh(roots, bk));
    END IF;
    RETURN NULL;
END
$$;

-- The ledger's insert: the tenants' anchors are read from the reference
-- table by a query of their own, then joined to the rows as arrays.
CREATE OR REPLACE FUNCTION completeness_ledger_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
DECLARE
    tenants text[] := array(SELECT DISTINCT n.tenant FROM completeness_new n WHERE n.item_id IS NULL AND n.cancelled_at IS NULL);
    anchors timestamptz[];
    d       completeness_delta[];
BEGIN
    SELECT array_agg(coalesce(t.period_anchor, '1970-01-01T00:00:00Z') ORDER BY u.i) INTO anchors
    FROM unnest(tenants) WITH ORDINALITY u (tenant, i) LEFT JOIN tenant_mappings t ON t.tenant = u.tenant;
    d := array(
        SELECT ROW(tally_period_start(n.occurred_at, a.anchor), n.tenant, n.feature, '', 'unstaged', false, false,
                   0, count(*), sum(n.value), 0, 0)::completeness_delta
        FROM completeness_new n JOIN unnest(tenants, anchors) a (tenant, anchor) ON a.tenant = n.tenant
        WHERE n.item_id IS NULL AND n.cancelled_at IS NULL
        GROUP BY tally_period_start(n.occurred_at, a.anchor), n.tenant, n.feature);
    IF cardinality(d) > 0 THEN
        PERFORM completeness_bump(d);
    END IF;
    IF EXISTS (SELECT FROM completeness_new n WHERE n.item_id IS NOT NULL OR n.cancelled_at IS NOT NULL) THEN
        RAISE EXCEPTION 'completeness_ledger_insert: a staged or cancelled row at insert is not rewritten for Citus yet';
    END IF;
    RETURN NULL;
END
$$;

-- Staging and cancelling: the ledger's update trigger, and what it calls.
-- completeness_change holds a changed ledger row, read from the transition
-- tables before any Citus table is touched; completeness_cancel and
-- completeness_events take the buckets (the old ones stay for what is not
-- yet rewritten).
CREATE TYPE completeness_change AS (
    id bigint, tenant text, feature text, value bigint, occurred_at timestamptz,
    was_item bigint, was_cancelled timestamptz, item_id bigint, cancelled_at timestamptz, staged boolean);
CREATE OR REPLACE FUNCTION completeness_cancel(event_row bigint, cancelled_at timestamp with time zone, bk smallint)
 RETURNS text
 LANGUAGE plpgsql
 STABLE
AS $$
BEGIN
    IF cancelled_at IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN coalesce((SELECT c.outcome FROM usage_cancellations c WHERE c.event_row = completeness_cancel.event_row AND c.bucket = bk), 'withdrawn');
END
$$;

CREATE OR REPLACE FUNCTION completeness_events(evs completeness_event[], bk smallint[])
 RETURNS completeness_delta[]
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_custom_plan'
AS $$
DECLARE
    deltas completeness_delta[];
    touched_items bigint[];
    removed_items bigint[];
BEGIN
    deltas := array(
        SELECT ROW(
                   CASE WHEN e.item_id IS NULL
                        THEN tally_period_start(e.occurred_at, coalesce(
                            (SELECT t.period_anchor FROM tenant_mappings t WHERE t.tenant = e.tenant), '1970-01-01T00:00:00Z'))
                        ELSE (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = e.item_id AND b.bucket = ANY (bk)) END,
                   e.tenant, e.feature, '', CASE WHEN e.cancel = 'withdrawn' THEN 'cancelled' ELSE 'unstaged' END,
                   false, false, 0, e.sign, e.sign * e.value::numeric, 0, 0)::completeness_delta
        FROM unnest(evs) e
        WHERE e.item_id IS NULL OR e.cancel = 'withdrawn');

    WITH d AS (
        SELECT e.item_id, e.tenant, e.feature, sum(e.sign) AS n, sum(e.sign * e.value::numeric) AS v,
               coalesce(sum(e.sign) FILTER (WHERE e.cancel IS NOT NULL), 0) AS cn,
               coalesce(sum(e.sign * e.value::numeric) FILTER (WHERE e.cancel IS NOT NULL), 0) AS cv,
               bool_or(e.sign < 0) AS lost,
               (array_agg(e.occurred_at ORDER BY e.occurred_at DESC, e.id DESC) FILTER (WHERE e.sign > 0))[1] AS last_at,
               (array_agg(e.id ORDER BY e.occurred_at DESC, e.id DESC) FILTER (WHERE e.sign > 0))[1] AS last_id,
               (array_agg(e.value ORDER BY e.occurred_at DESC, e.id DESC) FILTER (WHERE e.sign > 0))[1] AS last_value
        FROM unnest(evs) e
        WHERE e.item_id IS NOT NULL AND e.cancel IS DISTINCT FROM 'withdrawn'
        GROUP BY 1, 2, 3
    ),
    up AS (
        INSERT INTO completeness_items AS a (item_id, tenant, feature, period, carrier, events, value, cancelled_events,
                                             cancelled_value, last_at, last_id, last_value, bucket)
        SELECT d.item_id, d.tenant, d.feature,
               (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = d.item_id AND b.bucket = ANY (bk)),
               d.item_id, d.n, d.v, d.cn, d.cv, d.last_at, d.last_id, d.last_value, tally_bucket(d.tenant)
        FROM d ORDER BY 1, 2, 3
        ON CONFLICT (item_id, tenant, feature, bucket) DO UPDATE SET
            events = a.events + excluded.events, value = a.value + excluded.value,
            cancelled_events = a.cancelled_events + excluded.cancelled_events,
            cancelled_value = a.cancelled_value + excluded.cancelled_value,
            -- the latest event (occurred_at, then id) gives the last value
            last_at = CASE WHEN excluded.last_id IS NOT NULL AND (a.last_id IS NULL OR (excluded.last_at, excluded.last_id) > (a.last_at, a.last_id)) THEN excluded.last_at ELSE a.last_at END,
            last_id = CASE WHEN excluded.last_id IS NOT NULL AND (a.last_id IS NULL OR (excluded.last_at, excluded.last_id) > (a.last_at, a.last_id)) THEN excluded.last_id ELSE a.last_id END,
            last_value = CASE WHEN excluded.last_id IS NOT NULL AND (a.last_id IS NULL OR (excluded.last_at, excluded.last_id) > (a.last_at, a.last_id)) THEN excluded.last_value ELSE a.last_value END
        RETURNING a.item_id
    )
    SELECT array(SELECT DISTINCT item_id FROM up), array(SELECT item_id FROM d WHERE lost) INTO touched_items, removed_items;

    IF cardinality(removed_items) > 0 THEN
        -- An event left the item: its last value is read again.
        UPDATE completeness_items a SET (last_at, last_id, last_value) = (
            SELECT e.occurred_at, e.id, e.value FROM usage_events e
            WHERE e.bucket = ANY (bk) AND e.bucket = a.bucket AND e.item_id = a.item_id AND e.tenant = a.tenant AND e.feature = a.feature
              AND completeness_cancel(e.id, e.cancelled_at, e.bucket) IS DISTINCT FROM 'withdrawn'
            ORDER BY e.occurred_at DESC, e.id DESC LIMIT 1)
        WHERE a.item_id = ANY (removed_items) AND a.bucket = ANY (bk);
    END IF;
    IF cardinality(touched_items) > 0 THEN
        deltas := deltas || completeness_refresh(touched_items, bk);
    END IF;
    RETURN deltas;
END
$$;

CREATE OR REPLACE FUNCTION completeness_ledger_update()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_custom_plan'
AS $$
DECLARE
    deltas completeness_delta[];
    rest   completeness_event[];
    chs    completeness_change[];
    bk     smallint[] := array(SELECT DISTINCT n.bucket FROM completeness_new n);
BEGIN
    chs := array(
        SELECT ROW(p.*, p.was_item IS NULL AND p.item_id IS NOT NULL AND p.was_cancelled IS NULL AND p.cancelled_at IS NULL)::completeness_change
        FROM (
            SELECT s.id, min(s.tenant) AS tenant, min(s.feature) AS feature, min(s.value) AS value, min(s.occurred_at) AS occurred_at,
                   min(s.item_id) FILTER (WHERE s.sign < 0) AS was_item, min(s.cancelled_at) FILTER (WHERE s.sign < 0) AS was_cancelled,
                   min(s.item_id) FILTER (WHERE s.sign > 0) AS item_id, min(s.cancelled_at) FILTER (WHERE s.sign > 0) AS cancelled_at
            FROM (SELECT -1 AS sign, o.id, o.tenant, o.feature, o.value, o.occurred_at, o.item_id, o.cancelled_at FROM completeness_old o
                  UNION ALL
                  SELECT 1, n.id, n.tenant, n.feature, n.value, n.occurred_at, n.item_id, n.cancelled_at FROM completeness_new n) s
            GROUP BY s.id
        ) p
        WHERE p.item_id IS DISTINCT FROM p.was_item OR (p.cancelled_at IS NULL) <> (p.was_cancelled IS NULL));
    IF cardinality(chs) = 0 THEN
        RETURN NULL;
    END IF;
    WITH ch AS MATERIALIZED (SELECT * FROM unnest(chs)),
    g AS (
        SELECT c.item_id, c.tenant, c.feature, count(*) AS n, sum(c.value::numeric) AS v,
               (array_agg(ROW(c.occurred_at, c.id, c.value)::completeness_last ORDER BY c.occurred_at DESC, c.id DESC))[1] AS last
        FROM ch c WHERE c.staged
        GROUP BY 1, 2, 3
    ),
    fresh AS (
        SELECT g.*, (rb.payload ->> 'period')::timestamptz AS period,
               CASE WHEN rs.superseded_by IS NULL THEN g.item_id ELSE coalesce(tally_live_item(g.item_id, tally_bucket(g.tenant)), g.item_id) END AS live
        FROM g
        LEFT JOIN outbox_item_bodies rb ON rb.id = g.item_id AND rb.bucket = ANY (bk)
        LEFT JOIN outbox_item_states rs ON rs.id = g.item_id AND rs.bucket = ANY (bk)
        WHERE NOT EXISTS (SELECT FROM completeness_items a WHERE a.bucket = ANY (bk) AND a.item_id = g.item_id AND a.tenant = g.tenant AND a.feature = g.feature)
    ),
    ins AS (
        INSERT INTO completeness_items AS a (item_id, tenant, feature, period, carrier, events, value, cancelled_events,
                                             cancelled_value, last_at, last_id, last_value, applied_bucket, applied_account,
                                             applied_late, applied_inconsistent, applied_events, applied_value,
                                             applied_cancelled_events, applied_cancelled_value, bucket)
        SELECT f.item_id, f.tenant, f.feature, f.period, f.live, f.n, f.v, 0, 0,
               (f.last).occurred_at, (f.last).id, (f.last).value,
               completeness_bucket(s.state), b.destination_account, coalesce((b.payload ->> 'late')::boolean, false),
               CASE WHEN b.subject_kind = 'usage_event' THEN (b.payload ->> 'value')::numeric = f.v AND f.n = 1
                    WHEN completeness_last_aggregation(f.feature, b.mapping_version)
                    THEN (b.payload ->> 'value')::numeric = (f.last).value
                    ELSE (b.payload ->> 'value')::numeric = f.v END IS FALSE,
               f.n, f.v, 0, 0, tally_bucket(f.tenant)
        FROM fresh f
        LEFT JOIN outbox_item_states s ON s.id = f.live AND s.bucket = ANY (bk)
        LEFT JOIN outbox_item_bodies b ON b.id = f.live AND b.bucket = ANY (bk)
        ORDER BY 1, 2, 3
        ON CONFLICT (item_id, tenant, feature, bucket) DO NOTHING
        RETURNING a.*
    )
    -- the deltas summed per counter row and bucket already
    SELECT array(
               SELECT ROW(u.period, u.tenant, u.feature, '', 'unstaged', false, false, 0,
                          -count(*), -sum(u.value), 0, 0)::completeness_delta
               FROM (SELECT tally_period_start(c.occurred_at, coalesce(t.period_anchor, '1970-01-01T00:00:00Z')) AS period,
                            c.tenant, c.feature, c.value::numeric AS value
                     FROM ch c LEFT JOIN tenant_mappings t ON t.tenant = c.tenant
                     WHERE c.staged) u
               GROUP BY u.period, u.tenant, u.feature
               UNION ALL
               SELECT ROW(i.period, i.tenant, i.feature, i.applied_account, i.applied_bucket, i.applied_late,
                          i.applied_inconsistent, count(*), sum(i.applied_events)::bigint, sum(i.applied_value), 0, 0)::completeness_delta
               FROM ins i
               GROUP BY i.period, i.tenant, i.feature, i.applied_account, i.applied_bucket, i.applied_late, i.applied_inconsistent),
           array(
               SELECT ROW(s.sign, c.id, c.tenant, c.feature, c.value, c.occurred_at, s.item_id,
                          completeness_cancel(c.id, s.cancelled_at, tally_bucket(c.tenant)))::completeness_event
               FROM ch c
               CROSS JOIN LATERAL (VALUES (-1, c.was_item, c.was_cancelled), (1, c.item_id, c.cancelled_at)) s (sign, item_id, cancelled_at)
               WHERE NOT c.staged)
           -- the staged events of items not placed here: read only when some are
           || CASE WHEN (SELECT count(*) FROM ins) < (SELECT count(*) FROM g) THEN array(
               SELECT ROW(1, c.id, c.tenant, c.feature, c.value, c.occurred_at, c.item_id, NULL)::completeness_event
               FROM ch c
               JOIN (SELECT k.item_id, k.tenant, k.feature
                     FROM (SELECT g.item_id, g.tenant, g.feature, false AS placed FROM g
                           UNION ALL SELECT i.item_id, i.tenant, i.feature, true FROM ins i) k
                     GROUP BY 1, 2, 3 HAVING NOT bool_or(k.placed)) u
                 ON u.item_id = c.item_id AND u.tenant = c.tenant AND u.feature = c.feature
               WHERE c.staged) ELSE '{}' END
    INTO deltas, rest;
    IF cardinality(rest) > 0 THEN
        deltas := deltas || completeness_events(rest, bk);
    END IF;
    IF cardinality(deltas) > 0 THEN
        PERFORM completeness_bump(deltas);
    END IF;
    RETURN NULL;
END
$$;

-- A cancellation's outcome other than withdrawn moves its event's usage:
-- the rows are read from the transition table first.
CREATE OR REPLACE FUNCTION completeness_cancellation_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
DECLARE
    bk       smallint[];
    rows     bigint[];
    outcomes text[];
BEGIN
    SELECT array_agg(DISTINCT c.bucket), array_agg(c.event_row ORDER BY c.event_row), array_agg(c.outcome ORDER BY c.event_row)
    INTO bk, rows, outcomes
    FROM completeness_new c WHERE c.outcome <> 'withdrawn';
    IF rows IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM completeness_bump(completeness_events(array(
        SELECT ROW(s.sign, e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id, s.cancel)::completeness_event
        FROM unnest(rows, outcomes) c (event_row, outcome)
        JOIN usage_events e ON e.id = c.event_row AND e.bucket = ANY (bk)
        CROSS JOIN LATERAL (SELECT -1 AS sign, 'withdrawn' AS cancel UNION ALL SELECT 1, c.outcome) s
        WHERE e.cancelled_at IS NOT NULL), bk));
    RETURN NULL;
END
$$;

-- The fold of a shard group's counter slots, called by the maintenance
-- pass once per shard group with its buckets (on one server, once with
-- every bucket); the old form, over every shard, is refused on Citus and
-- no longer matches the counters' key.
DROP FUNCTION completeness_fold(timestamptz);
CREATE OR REPLACE FUNCTION completeness_fold(p_to timestamp with time zone, bk smallint[])
 RETURNS bigint
 LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    WITH victims AS (
        SELECT period, tenant, feature, account, slot, bucket FROM completeness_counters
        WHERE bucket = ANY (bk) AND period < p_to AND slot <> 0
        ORDER BY period, tenant, feature, account, slot, bucket
        FOR UPDATE SKIP LOCKED
    ),
    moved AS (
        DELETE FROM completeness_counters c USING victims v
        WHERE c.bucket = ANY (bk) AND (c.period, c.tenant, c.feature, c.account, c.slot, c.bucket) = (v.period, v.tenant, v.feature, v.account, v.slot, v.bucket)
        RETURNING c.*
    ),
    summed AS (
        INSERT INTO completeness_counters AS c
        SELECT period, tenant, feature, account, 0,
               sum(ingested_events), sum(ingested_value), sum(confirmed_events), sum(confirmed_value),
               sum(accepted_events), sum(accepted_value), sum(pending_events), sum(pending_value),
               sum(unstaged_events), sum(unstaged_value), sum(quarantined_events), sum(quarantined_value),
               sum(uncertain_events), sum(uncertain_value), sum(rejected_events), sum(rejected_value),
               sum(cancelled_events), sum(cancelled_value), sum(period_closed_events), sum(period_closed_value),
               sum(items), sum(inconsistent), bucket
        FROM moved
        GROUP BY period, tenant, feature, account, bucket
        ORDER BY period, tenant, feature, account
        ON CONFLICT (period, tenant, feature, account, slot, bucket) DO UPDATE SET
            ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
            confirmed_events = c.confirmed_events + excluded.confirmed_events, confirmed_value = c.confirmed_value + excluded.confirmed_value,
            accepted_events = c.accepted_events + excluded.accepted_events, accepted_value = c.accepted_value + excluded.accepted_value,
            pending_events = c.pending_events + excluded.pending_events, pending_value = c.pending_value + excluded.pending_value,
            unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value,
            quarantined_events = c.quarantined_events + excluded.quarantined_events, quarantined_value = c.quarantined_value + excluded.quarantined_value,
            uncertain_events = c.uncertain_events + excluded.uncertain_events, uncertain_value = c.uncertain_value + excluded.uncertain_value,
            rejected_events = c.rejected_events + excluded.rejected_events, rejected_value = c.rejected_value + excluded.rejected_value,
            cancelled_events = c.cancelled_events + excluded.cancelled_events, cancelled_value = c.cancelled_value + excluded.cancelled_value,
            period_closed_events = c.period_closed_events + excluded.period_closed_events,
            period_closed_value = c.period_closed_value + excluded.period_closed_value,
            items = c.items + excluded.items, inconsistent = c.inconsistent + excluded.inconsistent
        RETURNING 1
    )
    SELECT count(*) FROM moved INTO n;
    RETURN n;
END
$$;

COMMIT;
