-- Draft: the completeness counters' trigger functions made shard-local.
--
-- On Citus a trigger of a distributed table fires on the shard, on the
-- worker, once per shard-level statement with that shard's rows only
-- (findings §2). Inside it, Citus plans every query on a distributed or
-- reference table again, and refuses two things (findings §2.1):
--   * a query that names a transition table and a Citus table together
--     ("unrecognized RTE kind: 7", "executor could not find named
--     tuplestore"): the transition table is read into arrays first;
--   * a query that does not prune to one shard ("cannot execute a
--     distributed query from a query on a shard"): every read or write of
--     a distributed table carries `bucket = ANY (bk)`, bk being the buckets
--     of the firing rows — all of one shard — and joins by id carry the
--     bucket too;
--   * a generic plan of a statement with parameters, inside a function
--     ("could not create distributed plan … parameters in SQL
--     functions"): the functions force custom plans, where they forced
--     generic ones (planning once per call, as before the counters'
--     migration 43 made them generic).
-- The same text runs on plain Postgres, where the extra predicates are
-- redundant. Runs after distribute.sql's parts A and B (the bucket
-- columns and keys), before or after part C.
--
-- Rewritten here: the ingest path (completeness_ledger_insert), the item
-- paths (completeness_item_insert, completeness_item_update, which every
-- transition fires) and what they call (completeness_bump,
-- completeness_refresh, tally_live_item). Not yet: completeness_events,
-- completeness_ledger_update, completeness_cancellation_insert,
-- completeness_cancel, completeness_anchor, completeness_fold,
-- completeness_recount, tally_root_item — the same two rules apply
-- (docs/scale.md lists them).

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
        LEFT JOIN outbox_item_states c ON c.id = a.carrier AND c.bucket = a.bucket
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
        LEFT JOIN outbox_item_states s ON s.id = cur.live AND s.bucket = cur.bucket
        LEFT JOIN outbox_item_bodies b ON b.id = cur.live AND b.bucket = cur.bucket
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

COMMIT;
