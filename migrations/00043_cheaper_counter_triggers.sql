-- Cheaper completeness counters' triggers (docs/performance.md, "Cheaper
-- counter triggers"), counting exactly as migration 37's.
--
-- Staging marks unstaged events with new items. The ledger's update
-- trigger took every such statement the general way: the events left the
-- unstaged row (a bump), their items' aggregates were upserted, then
-- locked, read back with their states and bodies, placed and bumped again:
-- six statements in three functions, for a window as for a per-event item
-- staged in its ingest. Now that usual case — an unstaged event, not
-- cancelled, marked with an item that has no aggregate yet — is one
-- statement: the aggregates are inserted already placed (the live item's
-- bucket, account, late flag and consistency, as completeness_refresh
-- computes them). Anything else (an item that has an aggregate, a
-- cancellation, an aggregate a concurrent transaction inserted first)
-- goes the general way, as before, in the same call.
--
-- completeness_refresh and completeness_events now return their deltas
-- (same arguments, so that migration 37's Down still drops them) and each
-- trigger adds all of a call's deltas in one bump.
--
-- The triggers on the ledger and on the item states paired each row's old
-- and new versions with a join of the transition tables, which the generic
-- plans (made without knowing their sizes) ran as a nested loop: quadratic
-- in a statement's rows. They are paired by a grouping on id instead.
--
-- The tables and the meaning of their rows are unchanged: an existing
-- database needs no conversion, and the counters it holds stay valid.

-- +goose Up
DROP FUNCTION completeness_refresh(bigint[]), completeness_events(completeness_event[]);

-- completeness_refresh moves the usage of items (roots) to where their live
-- items stand now: it follows each one's successors, takes back what the
-- counters hold of it and returns, with it, what they should hold. The
-- rows are locked first, so that the second statement reads what
-- concurrent writers committed.
-- +goose StatementBegin
CREATE FUNCTION completeness_refresh(roots bigint[]) RETURNS completeness_delta[] LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    deltas completeness_delta[];
BEGIN
    PERFORM FROM completeness_items WHERE item_id = ANY (roots) ORDER BY item_id, tenant, feature FOR UPDATE;
    WITH cur AS (
        SELECT a.*, CASE WHEN c.superseded_by IS NULL THEN a.carrier
                         ELSE coalesce(tally_live_item(a.carrier), a.carrier) END AS live
        FROM completeness_items a
        LEFT JOIN outbox_item_states c ON c.id = a.carrier
        WHERE a.item_id = ANY (roots)
    ),
    nxt AS (
        SELECT cur.item_id, cur.tenant, cur.feature, cur.live,
               CASE WHEN cur.events = 0 THEN NULL ELSE completeness_bucket(s.state) END AS bucket,
               b.destination_account AS account,
               coalesce((b.payload ->> 'late')::boolean, false) AS late,
               CASE WHEN b.subject_kind = 'usage_event' THEN (b.payload ->> 'value')::numeric = cur.value AND cur.events = 1
                    WHEN completeness_last_aggregation(cur.feature, b.mapping_version)
                    THEN (b.payload ->> 'value')::numeric = cur.last_value
                    ELSE (b.payload ->> 'value')::numeric = cur.value END IS FALSE AS inconsistent
        FROM cur
        LEFT JOIN outbox_item_states s ON s.id = cur.live
        LEFT JOIN outbox_item_bodies b ON b.id = cur.live
    ),
    upd AS (
        UPDATE completeness_items a SET carrier = nxt.live, applied_bucket = nxt.bucket, applied_account = nxt.account,
            applied_late = nxt.late, applied_inconsistent = nxt.inconsistent,
            applied_events = a.events, applied_value = a.value,
            applied_cancelled_events = a.cancelled_events, applied_cancelled_value = a.cancelled_value
        FROM nxt WHERE a.item_id = nxt.item_id AND a.tenant = nxt.tenant AND a.feature = nxt.feature
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
-- +goose StatementEnd


-- completeness_events applies changes of events to the items' aggregates
-- and returns the deltas for the counters: an unstaged event, or one withdrawn, counts on its line
-- directly (by its tenant's anchor, or its item's period); any other adds
-- to its item's usage, which then moves.
-- +goose StatementBegin
CREATE FUNCTION completeness_events(evs completeness_event[]) RETURNS completeness_delta[] LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
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
                        ELSE (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = e.item_id) END,
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
                                             cancelled_value, last_at, last_id, last_value)
        SELECT d.item_id, d.tenant, d.feature,
               (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = d.item_id),
               d.item_id, d.n, d.v, d.cn, d.cv, d.last_at, d.last_id, d.last_value
        FROM d ORDER BY 1, 2, 3
        ON CONFLICT (item_id, tenant, feature) DO UPDATE SET
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
            WHERE e.item_id = a.item_id AND e.tenant = a.tenant AND e.feature = a.feature
              AND completeness_cancel(e.id, e.cancelled_at) IS DISTINCT FROM 'withdrawn'
            ORDER BY e.occurred_at DESC, e.id DESC LIMIT 1)
        WHERE a.item_id = ANY (removed_items);
    END IF;
    IF cardinality(touched_items) > 0 THEN
        deltas := deltas || completeness_refresh(touched_items);
    END IF;
    RETURN deltas;
END
$$;
-- +goose StatementEnd


-- The callers add what completeness_refresh and completeness_events return.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_insert() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    INSERT INTO completeness_counters AS c (period, tenant, feature, account, slot,
                                            ingested_events, ingested_value, unstaged_events, unstaged_value)
    SELECT tally_period_start(n.occurred_at, coalesce(t.period_anchor, '1970-01-01T00:00:00Z')), n.tenant, n.feature, '',
           completeness_slot(), count(*), sum(n.value), count(*), sum(n.value)
    FROM completeness_new n LEFT JOIN tenant_mappings t ON t.tenant = n.tenant
    WHERE n.item_id IS NULL AND n.cancelled_at IS NULL
    GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    ON CONFLICT (period, tenant, feature, account, slot) DO UPDATE SET
        ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
        unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value;
    IF EXISTS (SELECT FROM completeness_new n WHERE n.item_id IS NOT NULL OR n.cancelled_at IS NOT NULL) THEN
        PERFORM completeness_bump(completeness_events(array(
            SELECT ROW(1, n.id, n.tenant, n.feature, n.value, n.occurred_at, n.item_id,
                       completeness_cancel(n.id, n.cancelled_at))::completeness_event
            FROM completeness_new n WHERE n.item_id IS NOT NULL OR n.cancelled_at IS NOT NULL)));
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_cancellation_insert() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM completeness_bump(completeness_events(array(
        SELECT ROW(s.sign, e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id, s.cancel)::completeness_event
        FROM completeness_new c JOIN usage_events e ON e.id = c.event_row
        CROSS JOIN LATERAL (SELECT -1 AS sign, 'withdrawn' AS cancel UNION ALL SELECT 1, c.outcome) s
        WHERE e.cancelled_at IS NOT NULL AND c.outcome <> 'withdrawn')));
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_update() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    roots bigint[];
BEGIN
    -- An item's old and new rows paired by a grouping on its id, as the
    -- ledger's update pairs an event's.
    roots := array(
        SELECT DISTINCT a.item_id
        FROM (SELECT s.id,
                     min(s.state) FILTER (WHERE s.sign < 0) AS was_state, min(s.superseded_by) FILTER (WHERE s.sign < 0) AS was_superseded_by,
                     min(s.state) FILTER (WHERE s.sign > 0) AS state, min(s.superseded_by) FILTER (WHERE s.sign > 0) AS superseded_by
              FROM (SELECT -1 AS sign, o.id, o.state, o.superseded_by FROM completeness_old o
                    UNION ALL
                    SELECT 1, n.id, n.state, n.superseded_by FROM completeness_new n) s
              GROUP BY s.id) c
        JOIN completeness_items a ON a.carrier = c.id
        WHERE completeness_bucket(c.state) <> completeness_bucket(c.was_state) OR c.superseded_by IS DISTINCT FROM c.was_superseded_by);
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_bump(completeness_refresh(roots));
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_insert() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    roots bigint[];
BEGIN
    roots := array(SELECT DISTINCT a.item_id FROM completeness_new n JOIN completeness_items a ON a.carrier = n.id);
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_bump(completeness_refresh(roots));
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- Staging and cancellation: each changed event leaves where it was and
-- arrives where it is. An event's old and new rows are paired by a
-- grouping on its id (a join of the two transition tables, whose sizes
-- the generic plan does not know, was a nested loop: quadratic in the
-- statement's rows); the other columns of a ledger row never change
-- (usage_events_immutable). An unstaged event marked with an item that has
-- no aggregate (staging's usual case) is counted by this first statement:
-- the aggregates inserted placed, the events taken from their unstaged
-- rows. The rest — a cancellation, an item that has an aggregate, one a
-- concurrent transaction inserted first (its events then add to it) — goes
-- the general way; one bump adds it all.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_update() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    deltas completeness_delta[];
    rest   completeness_event[];
BEGIN
    WITH ch AS MATERIALIZED (
        SELECT p.*, p.was_item IS NULL AND p.item_id IS NOT NULL AND p.was_cancelled IS NULL AND p.cancelled_at IS NULL AS staged
        FROM (
            SELECT s.id, min(s.tenant) AS tenant, min(s.feature) AS feature, min(s.value) AS value, min(s.occurred_at) AS occurred_at,
                   min(s.item_id) FILTER (WHERE s.sign < 0) AS was_item, min(s.cancelled_at) FILTER (WHERE s.sign < 0) AS was_cancelled,
                   min(s.item_id) FILTER (WHERE s.sign > 0) AS item_id, min(s.cancelled_at) FILTER (WHERE s.sign > 0) AS cancelled_at
            FROM (SELECT -1 AS sign, o.id, o.tenant, o.feature, o.value, o.occurred_at, o.item_id, o.cancelled_at FROM completeness_old o
                  UNION ALL
                  SELECT 1, n.id, n.tenant, n.feature, n.value, n.occurred_at, n.item_id, n.cancelled_at FROM completeness_new n) s
            GROUP BY s.id
        ) p
        WHERE p.item_id IS DISTINCT FROM p.was_item OR (p.cancelled_at IS NULL) <> (p.was_cancelled IS NULL)
    ),
    g AS (
        SELECT c.item_id, c.tenant, c.feature, count(*) AS n, sum(c.value::numeric) AS v,
               (array_agg(ROW(c.occurred_at, c.id, c.value)::completeness_last ORDER BY c.occurred_at DESC, c.id DESC))[1] AS last
        FROM ch c WHERE c.staged
        GROUP BY 1, 2, 3
    ),
    fresh AS (
        SELECT g.*, (rb.payload ->> 'period')::timestamptz AS period,
               CASE WHEN rs.superseded_by IS NULL THEN g.item_id ELSE coalesce(tally_live_item(g.item_id), g.item_id) END AS live
        FROM g
        LEFT JOIN outbox_item_bodies rb ON rb.id = g.item_id
        LEFT JOIN outbox_item_states rs ON rs.id = g.item_id
        WHERE NOT EXISTS (SELECT FROM completeness_items a WHERE a.item_id = g.item_id AND a.tenant = g.tenant AND a.feature = g.feature)
    ),
    ins AS (
        INSERT INTO completeness_items AS a (item_id, tenant, feature, period, carrier, events, value, cancelled_events,
                                             cancelled_value, last_at, last_id, last_value, applied_bucket, applied_account,
                                             applied_late, applied_inconsistent, applied_events, applied_value,
                                             applied_cancelled_events, applied_cancelled_value)
        SELECT f.item_id, f.tenant, f.feature, f.period, f.live, f.n, f.v, 0, 0,
               (f.last).occurred_at, (f.last).id, (f.last).value,
               completeness_bucket(s.state), b.destination_account, coalesce((b.payload ->> 'late')::boolean, false),
               CASE WHEN b.subject_kind = 'usage_event' THEN (b.payload ->> 'value')::numeric = f.v AND f.n = 1
                    WHEN completeness_last_aggregation(f.feature, b.mapping_version)
                    THEN (b.payload ->> 'value')::numeric = (f.last).value
                    ELSE (b.payload ->> 'value')::numeric = f.v END IS FALSE,
               f.n, f.v, 0, 0
        FROM fresh f
        LEFT JOIN outbox_item_states s ON s.id = f.live
        LEFT JOIN outbox_item_bodies b ON b.id = f.live
        ORDER BY 1, 2, 3
        ON CONFLICT (item_id, tenant, feature) DO NOTHING
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
                          completeness_cancel(c.id, s.cancelled_at))::completeness_event
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
        deltas := deltas || completeness_events(rest);
    END IF;
    IF cardinality(deltas) > 0 THEN
        PERFORM completeness_bump(deltas);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Migration 37's functions, as they were.
DROP FUNCTION completeness_refresh(bigint[]), completeness_events(completeness_event[]);

-- +goose StatementBegin
CREATE FUNCTION completeness_refresh(roots bigint[]) RETURNS void LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    written bigint;
BEGIN
    PERFORM FROM completeness_items WHERE item_id = ANY (roots) ORDER BY item_id, tenant, feature FOR UPDATE;
    WITH cur AS (
        SELECT a.*, CASE WHEN c.superseded_by IS NULL THEN a.carrier
                         ELSE coalesce(tally_live_item(a.carrier), a.carrier) END AS live
        FROM completeness_items a
        LEFT JOIN outbox_item_states c ON c.id = a.carrier
        WHERE a.item_id = ANY (roots)
    ),
    nxt AS (
        SELECT cur.item_id, cur.tenant, cur.feature, cur.live,
               CASE WHEN cur.events = 0 THEN NULL ELSE completeness_bucket(s.state) END AS bucket,
               b.destination_account AS account,
               coalesce((b.payload ->> 'late')::boolean, false) AS late,
               CASE WHEN b.subject_kind = 'usage_event' THEN (b.payload ->> 'value')::numeric = cur.value AND cur.events = 1
                    WHEN completeness_last_aggregation(cur.feature, b.mapping_version)
                    THEN (b.payload ->> 'value')::numeric = cur.last_value
                    ELSE (b.payload ->> 'value')::numeric = cur.value END IS FALSE AS inconsistent
        FROM cur
        LEFT JOIN outbox_item_states s ON s.id = cur.live
        LEFT JOIN outbox_item_bodies b ON b.id = cur.live
    ),
    upd AS (
        UPDATE completeness_items a SET carrier = nxt.live, applied_bucket = nxt.bucket, applied_account = nxt.account,
            applied_late = nxt.late, applied_inconsistent = nxt.inconsistent,
            applied_events = a.events, applied_value = a.value,
            applied_cancelled_events = a.cancelled_events, applied_cancelled_value = a.cancelled_value
        FROM nxt WHERE a.item_id = nxt.item_id AND a.tenant = nxt.tenant AND a.feature = nxt.feature
        RETURNING a.*
    )
    SELECT completeness_bump(array(
        SELECT ROW(period, tenant, feature, applied_account, applied_bucket, applied_late, applied_inconsistent,
                   -1, -applied_events, -applied_value, -applied_cancelled_events, -applied_cancelled_value)::completeness_delta
        FROM cur WHERE applied_bucket IS NOT NULL
        UNION ALL
        SELECT ROW(period, tenant, feature, applied_account, applied_bucket, applied_late, applied_inconsistent,
                   1, applied_events, applied_value, applied_cancelled_events, applied_cancelled_value)::completeness_delta
        FROM upd WHERE applied_bucket IS NOT NULL)) INTO written;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION completeness_events(evs completeness_event[]) RETURNS void LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    touched_items bigint[];
    removed_items bigint[];
BEGIN
    PERFORM completeness_bump(array(
        SELECT ROW(
                   CASE WHEN e.item_id IS NULL
                        THEN tally_period_start(e.occurred_at, coalesce(
                            (SELECT t.period_anchor FROM tenant_mappings t WHERE t.tenant = e.tenant), '1970-01-01T00:00:00Z'))
                        ELSE (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = e.item_id) END,
                   e.tenant, e.feature, '', CASE WHEN e.cancel = 'withdrawn' THEN 'cancelled' ELSE 'unstaged' END,
                   false, false, 0, e.sign, e.sign * e.value::numeric, 0, 0)::completeness_delta
        FROM unnest(evs) e
        WHERE e.item_id IS NULL OR e.cancel = 'withdrawn'));

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
                                             cancelled_value, last_at, last_id, last_value)
        SELECT d.item_id, d.tenant, d.feature,
               (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = d.item_id),
               d.item_id, d.n, d.v, d.cn, d.cv, d.last_at, d.last_id, d.last_value
        FROM d ORDER BY 1, 2, 3
        ON CONFLICT (item_id, tenant, feature) DO UPDATE SET
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
            WHERE e.item_id = a.item_id AND e.tenant = a.tenant AND e.feature = a.feature
              AND completeness_cancel(e.id, e.cancelled_at) IS DISTINCT FROM 'withdrawn'
            ORDER BY e.occurred_at DESC, e.id DESC LIMIT 1)
        WHERE a.item_id = ANY (removed_items);
    END IF;
    IF cardinality(touched_items) > 0 THEN
        PERFORM completeness_refresh(touched_items);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_insert() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    INSERT INTO completeness_counters AS c (period, tenant, feature, account, slot,
                                            ingested_events, ingested_value, unstaged_events, unstaged_value)
    SELECT tally_period_start(n.occurred_at, coalesce(t.period_anchor, '1970-01-01T00:00:00Z')), n.tenant, n.feature, '',
           completeness_slot(), count(*), sum(n.value), count(*), sum(n.value)
    FROM completeness_new n LEFT JOIN tenant_mappings t ON t.tenant = n.tenant
    WHERE n.item_id IS NULL AND n.cancelled_at IS NULL
    GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    ON CONFLICT (period, tenant, feature, account, slot) DO UPDATE SET
        ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
        unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value;
    IF EXISTS (SELECT FROM completeness_new n WHERE n.item_id IS NOT NULL OR n.cancelled_at IS NOT NULL) THEN
        PERFORM completeness_events(array(
            SELECT ROW(1, n.id, n.tenant, n.feature, n.value, n.occurred_at, n.item_id,
                       completeness_cancel(n.id, n.cancelled_at))::completeness_event
            FROM completeness_new n WHERE n.item_id IS NOT NULL OR n.cancelled_at IS NOT NULL));
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_cancellation_insert() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM completeness_events(array(
        SELECT ROW(s.sign, e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id, s.cancel)::completeness_event
        FROM completeness_new c JOIN usage_events e ON e.id = c.event_row
        CROSS JOIN LATERAL (SELECT -1 AS sign, 'withdrawn' AS cancel UNION ALL SELECT 1, c.outcome) s
        WHERE e.cancelled_at IS NOT NULL AND c.outcome <> 'withdrawn'));
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_update() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    roots bigint[];
BEGIN
    roots := array(
        SELECT DISTINCT a.item_id
        FROM completeness_old o JOIN completeness_new n ON n.id = o.id
        JOIN completeness_items a ON a.carrier = n.id
        WHERE completeness_bucket(n.state) <> completeness_bucket(o.state) OR n.superseded_by IS DISTINCT FROM o.superseded_by);
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_refresh(roots);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_insert() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    roots bigint[];
BEGIN
    roots := array(SELECT DISTINCT a.item_id FROM completeness_new n JOIN completeness_items a ON a.carrier = n.id);
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_refresh(roots);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_update() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM completeness_events(array(
        SELECT ROW(s.sign, s.id, s.tenant, s.feature, s.value, s.occurred_at, s.item_id,
                   completeness_cancel(s.id, s.cancelled_at))::completeness_event
        FROM completeness_old o JOIN completeness_new n ON n.id = o.id
        CROSS JOIN LATERAL (SELECT -1 AS sign, o.* UNION ALL SELECT 1, n.*) s
        WHERE n.item_id IS DISTINCT FROM o.item_id OR (n.cancelled_at IS NULL) <> (o.cancelled_at IS NULL)));
    RETURN NULL;
END
$$;
-- +goose StatementEnd
