-- The completeness report from counters (docs/reports.md, "Counters").
--
-- completeness_counters holds the report's buckets per billing period,
-- tenant, feature and destination account, as events and value, spread over
-- slots (pg_backend_pid() mod 16) so that concurrent ingests of one tenant
-- and feature add to different rows; a reader sums the slots. The row of
-- account '' also holds what belongs to no item: the unstaged usage and the
-- usage withdrawn before it was sent. completeness_items holds, per item the
-- ledger names (the root of a chain of successors), the usage its events
-- carry and what of it the counters hold ("applied"): where it stands now
-- (the bucket of the live item's state, its account, late or not, and
-- whether the live item's value is the reduction of the events). A state
-- transition moves an item's usage from its applied bucket to the new one
-- without reading its events.
--
-- Nothing in Go writes either table: triggers do, in the transaction of
-- every write that moves usage, whoever makes it. Statement-level AFTER
-- triggers with transition tables aggregate a statement's rows into one
-- upsert per counter row:
--   usage_events INSERT: the new events (unstaged, by the tenant's anchor);
--   usage_events UPDATE: staging (item_id set) and cancellation
--     (cancelled_at set) move an event between unstaged, an item and
--     cancelled;
--   usage_cancellations INSERT: a cancellation's outcome (withdrawn or not);
--   outbox_item_states INSERT and UPDATE: an item's state, its successor;
--   tenant_mappings (per row, rare): a new anchor moves the tenant's
--     unstaged events to the periods it computes.
-- The triggers never change an item's state: the outbox stays the only code
-- that does. They work on the ledger as a plain table and as a table
-- partitioned by month (statement triggers with transition tables fire on a
-- partitioned table's root), joining old and new rows by id.
--
-- completeness_audits records every comparison of the counters with the
-- full computation from the ledger (tally report completeness --verify, the
-- nightly audit, a repair): the keys that differ, each bucket's two values.
--
-- The backfill reads the ledger and the outbox once, in one pass each
-- (hash joins), and writes one counter row per line and account; its cost
-- is in docs/running.md.

-- +goose Up
CREATE TABLE completeness_counters (
    period                timestamptz NOT NULL,
    tenant                text        NOT NULL,
    feature               text        NOT NULL,
    account               text        NOT NULL,
    slot                  smallint    NOT NULL,
    ingested_events       bigint      NOT NULL DEFAULT 0,
    ingested_value        numeric     NOT NULL DEFAULT 0,
    confirmed_events      bigint      NOT NULL DEFAULT 0,
    confirmed_value       numeric     NOT NULL DEFAULT 0,
    accepted_events       bigint      NOT NULL DEFAULT 0,
    accepted_value        numeric     NOT NULL DEFAULT 0,
    pending_events        bigint      NOT NULL DEFAULT 0,
    pending_value         numeric     NOT NULL DEFAULT 0,
    unstaged_events       bigint      NOT NULL DEFAULT 0,
    unstaged_value        numeric     NOT NULL DEFAULT 0,
    quarantined_events    bigint      NOT NULL DEFAULT 0,
    quarantined_value     numeric     NOT NULL DEFAULT 0,
    uncertain_events      bigint      NOT NULL DEFAULT 0,
    uncertain_value       numeric     NOT NULL DEFAULT 0,
    rejected_events       bigint      NOT NULL DEFAULT 0,
    rejected_value        numeric     NOT NULL DEFAULT 0,
    cancelled_events      bigint      NOT NULL DEFAULT 0,
    cancelled_value       numeric     NOT NULL DEFAULT 0,
    period_closed_events  bigint      NOT NULL DEFAULT 0,
    period_closed_value   numeric     NOT NULL DEFAULT 0,
    -- items counts the items (with usage) whose live item has this account;
    -- inconsistent those whose value is not the reduction of their events.
    items                 bigint      NOT NULL DEFAULT 0,
    inconsistent          bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (period, tenant, feature, account, slot)
);

CREATE TABLE completeness_items (
    item_id          bigint      NOT NULL,
    tenant           text        NOT NULL,
    feature          text        NOT NULL,
    period           timestamptz,
    carrier          bigint      NOT NULL,
    -- the usage of its events not withdrawn, and of those cancelled
    events           bigint      NOT NULL DEFAULT 0,
    value            numeric     NOT NULL DEFAULT 0,
    cancelled_events bigint      NOT NULL DEFAULT 0,
    cancelled_value  numeric     NOT NULL DEFAULT 0,
    last_at          timestamptz,
    last_id          bigint,
    last_value       bigint,
    -- what the counters hold of it
    applied_bucket           text,
    applied_account          text,
    applied_late             boolean NOT NULL DEFAULT false,
    applied_inconsistent     boolean NOT NULL DEFAULT false,
    applied_events           bigint  NOT NULL DEFAULT 0,
    applied_value            numeric NOT NULL DEFAULT 0,
    applied_cancelled_events bigint  NOT NULL DEFAULT 0,
    applied_cancelled_value  numeric NOT NULL DEFAULT 0,
    PRIMARY KEY (item_id, tenant, feature)
);
CREATE INDEX completeness_items_carrier ON completeness_items (carrier);

CREATE TABLE completeness_audits (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    period      text        NOT NULL CHECK (period ~ '^[0-9]{4}-[0-9]{2}$'),
    kind        text        NOT NULL CHECK (kind IN ('verify', 'nightly', 'repair')),
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    lines       integer     NOT NULL,
    drift_keys  integer     NOT NULL,
    -- every key that differs: tenant, feature, period, account, bucket,
    -- the counters' events and value and the ledger's (at most 1000)
    drift       jsonb       NOT NULL DEFAULT '[]',
    requested_by text       NOT NULL
);
CREATE INDEX completeness_audits_period ON completeness_audits (period, id);

-- An operator's repair of a month's counters is audited.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach', 'completeness.repair'));
CREATE TRIGGER completeness_audits_append_only BEFORE DELETE OR UPDATE ON completeness_audits
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('audits are never changed or deleted');

-- completeness_slot is the counter row a backend adds to.
-- +goose StatementBegin
CREATE FUNCTION completeness_slot() RETURNS smallint LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT (pg_backend_pid() % 16)::smallint $$;
-- +goose StatementEnd

-- completeness_bucket is the report's bucket of an item state.
-- +goose StatementBegin
CREATE FUNCTION completeness_bucket(state text) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN state IN ('pending', 'leased') THEN 'pending' ELSE coalesce(state, 'missing') END $$;
-- +goose StatementEnd

-- completeness_cancel is how the report sees an event's cancellation: NULL
-- when it is not cancelled, its outcome, or withdrawn while it has none.
-- +goose StatementBegin
CREATE FUNCTION completeness_cancel(event_row bigint, cancelled_at timestamptz) RETURNS text LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF cancelled_at IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN coalesce((SELECT c.outcome FROM usage_cancellations c WHERE c.event_row = completeness_cancel.event_row), 'withdrawn');
END
$$;
-- +goose StatementEnd

-- completeness_last_aggregation is whether a feature's items built from
-- mapping_version reduce their events to the last value (the mapping in
-- force at that version).
-- +goose StatementBegin
CREATE FUNCTION completeness_last_aggregation(feature text, mapping_version integer) RETURNS boolean LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN coalesce((SELECT fv.aggregation = 'last' FROM feature_mapping_versions fv
                     WHERE fv.feature = completeness_last_aggregation.feature AND fv.version <= mapping_version
                     ORDER BY fv.version DESC LIMIT 1), false);
END
$$;
-- +goose StatementEnd

-- completeness_delta is one contribution to a counter row: events and
-- value ingested, in a bucket (less the cancelled part, which counts as
-- cancelled), in period_closed too when late, and items (inconsistent or
-- not). Negative to take one back.
CREATE TYPE completeness_delta AS (
    period           timestamptz,
    tenant           text,
    feature          text,
    account          text,
    bucket           text,
    late             boolean,
    inconsistent     boolean,
    items            bigint,
    events           bigint,
    value            numeric,
    cancelled_events bigint,
    cancelled_value  numeric
);

-- completeness_bump adds contributions to the counters: one upsert per
-- row, in key order, on the backend's slot; all-zero sums write nothing.
-- It and the functions below are PL/pgSQL, whose plans a session keeps
-- (a SQL function's statement is planned at every call), and generic:
-- planned once, not again for every statement's rows.
-- +goose StatementBegin
CREATE FUNCTION completeness_bump(d completeness_delta[]) RETURNS bigint LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    n bigint;
BEGIN
WITH s AS (
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
),
written AS (
    INSERT INTO completeness_counters AS c
    SELECT period, tenant, feature, account, completeness_slot(),
           ie, iv, ce, cv, ae, av, pe, pv, ue, uv, qe, qv, ne, nv, re, rv, xe, xv, le, lv, it, bad
    FROM s
    WHERE (ie, iv, ce, cv, ae, av, pe, pv, ue, uv, qe, qv, ne, nv, re, rv, xe, xv, le, lv, it, bad)
          IS DISTINCT FROM (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    ORDER BY period, tenant, feature, account
    ON CONFLICT (period, tenant, feature, account, slot) DO UPDATE SET
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
SELECT count(*) FROM written INTO n;
RETURN n;
END
$$;
-- +goose StatementEnd

-- completeness_refresh moves the usage of items (roots) to where their live
-- items stand now: it follows each one's successors, takes back what the
-- counters hold of it and adds what they should. The rows are locked first,
-- so that the second statement reads what concurrent writers committed.
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

-- completeness_event is one event's side of a change: sign -1 for what it
-- was, 1 for what it is.
CREATE TYPE completeness_event AS (
    sign        integer,
    id          bigint,
    tenant      text,
    feature     text,
    value       bigint,
    occurred_at timestamptz,
    item_id     bigint,
    cancel      text
);

-- completeness_events applies changes of events: an unstaged event, or one
-- withdrawn, counts on its line directly (by its tenant's anchor, or its
-- item's period); any other adds to its item's usage, which then moves.
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

-- The ledger's inserts: unstaged events count on their line by one
-- statement (the ingest's path); anything else (staged or cancelled
-- already, as a fixture or an import may write) goes the general way.
-- +goose StatementBegin
CREATE FUNCTION completeness_ledger_insert() RETURNS trigger LANGUAGE plpgsql
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
CREATE TRIGGER usage_events_completeness_insert AFTER INSERT ON usage_events
    REFERENCING NEW TABLE AS completeness_new
    FOR EACH STATEMENT EXECUTE FUNCTION completeness_ledger_insert();

-- Staging and cancellation: each changed event leaves where it was and
-- arrives where it is.
-- +goose StatementBegin
CREATE FUNCTION completeness_ledger_update() RETURNS trigger LANGUAGE plpgsql
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
CREATE TRIGGER usage_events_completeness_update AFTER UPDATE ON usage_events
    REFERENCING OLD TABLE AS completeness_old NEW TABLE AS completeness_new
    FOR EACH STATEMENT EXECUTE FUNCTION completeness_ledger_update();

-- A cancellation's outcome: an event cancelled without one counts as
-- withdrawn; with an outcome other than withdrawn it is back in its item,
-- as cancelled usage.
-- +goose StatementBegin
CREATE FUNCTION completeness_cancellation_insert() RETURNS trigger LANGUAGE plpgsql
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
CREATE TRIGGER usage_cancellations_completeness AFTER INSERT ON usage_cancellations
    REFERENCING NEW TABLE AS completeness_new
    FOR EACH STATEMENT EXECUTE FUNCTION completeness_cancellation_insert();

-- An item's state or successor: the usage it carries moves. A claim
-- (pending to leased) and a lease's renewal stay in their bucket and move
-- nothing.
-- +goose StatementBegin
CREATE FUNCTION completeness_item_update() RETURNS trigger LANGUAGE plpgsql
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
CREATE TRIGGER outbox_item_states_completeness_update AFTER UPDATE ON outbox_item_states
    REFERENCING OLD TABLE AS completeness_old NEW TABLE AS completeness_new
    FOR EACH STATEMENT EXECUTE FUNCTION completeness_item_update();

-- A state row inserted after its events were staged (an import, a
-- successor written after its predecessor's supersede) places them.
-- +goose StatementBegin
CREATE FUNCTION completeness_item_insert() RETURNS trigger LANGUAGE plpgsql
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
CREATE TRIGGER outbox_item_states_completeness_insert AFTER INSERT ON outbox_item_states
    REFERENCING NEW TABLE AS completeness_new
    FOR EACH STATEMENT EXECUTE FUNCTION completeness_item_insert();

-- A tenant's new anchor moves its unstaged events (a backlog, by the
-- partial index) to the periods the anchor computes.
-- +goose StatementBegin
CREATE FUNCTION completeness_anchor() RETURNS trigger LANGUAGE plpgsql
AS $$
DECLARE
    was timestamptz := '1970-01-01T00:00:00Z';
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF OLD.period_anchor IS NOT DISTINCT FROM NEW.period_anchor AND OLD.tenant = NEW.tenant THEN
            RETURN NULL;
        END IF;
        was := coalesce(OLD.period_anchor, was);
    END IF;
    PERFORM completeness_bump(array(
        SELECT ROW(tally_period_start(e.occurred_at, s.anchor), e.tenant, e.feature, '',
                   CASE WHEN completeness_cancel(e.id, e.cancelled_at) = 'withdrawn' THEN 'cancelled' ELSE 'unstaged' END,
                   false, false, 0, s.sign, s.sign * e.value::numeric, 0, 0)::completeness_delta
        FROM usage_events e
        CROSS JOIN LATERAL (SELECT -1 AS sign, was AS anchor
                            UNION ALL SELECT 1, coalesce(NEW.period_anchor, '1970-01-01T00:00:00Z')) s
        WHERE e.tenant = NEW.tenant AND e.item_id IS NULL));
    RETURN NULL;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER tenant_mappings_completeness AFTER INSERT OR UPDATE ON tenant_mappings
    FOR EACH ROW EXECUTE FUNCTION completeness_anchor();

-- completeness_fold moves the counters of the periods starting before
-- p_to from every slot into slot 0, sums unchanged, so that a month no
-- longer written by many backends at once is read as one row per line and
-- account. A writer meanwhile waits for the row it would add to and then
-- adds a new one: nothing is lost. The nightly audit runs it over the
-- months before the current one.
-- +goose StatementBegin
CREATE FUNCTION completeness_fold(p_to timestamptz) RETURNS bigint LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    WITH moved AS (
        DELETE FROM completeness_counters WHERE period < p_to AND slot <> 0 RETURNING *
    ),
    summed AS (
        INSERT INTO completeness_counters AS c
        SELECT period, tenant, feature, account, 0,
               sum(ingested_events), sum(ingested_value), sum(confirmed_events), sum(confirmed_value),
               sum(accepted_events), sum(accepted_value), sum(pending_events), sum(pending_value),
               sum(unstaged_events), sum(unstaged_value), sum(quarantined_events), sum(quarantined_value),
               sum(uncertain_events), sum(uncertain_value), sum(rejected_events), sum(rejected_value),
               sum(cancelled_events), sum(cancelled_value), sum(period_closed_events), sum(period_closed_value),
               sum(items), sum(inconsistent)
        FROM moved
        GROUP BY period, tenant, feature, account
        ORDER BY period, tenant, feature, account
        ON CONFLICT (period, tenant, feature, account, slot) DO UPDATE SET
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
-- +goose StatementEnd

-- completeness_recount rebuilds, from the ledger and the outbox, the
-- counters and the items of the billing periods starting in [p_from, p_to)
-- (events that occurred from p_from to 32 days after p_to, as the full
-- computation reads them) into slot 0: the backfill below, and an
-- operator's repair of a month (tally report completeness --repair), which
-- holds the counters' lock meanwhile. It reads each event of the range
-- once and groups it with its item (hash joins).
CREATE TYPE completeness_last AS (occurred_at timestamptz, id bigint, value bigint);
-- +goose StatementBegin
CREATE FUNCTION completeness_recount(p_from timestamptz, p_to timestamptz) RETURNS void LANGUAGE plpgsql
SET enable_nestloop = off SET jit = off
AS $$
DECLARE
    everything boolean := p_from = '-infinity';
BEGIN
    DELETE FROM completeness_counters WHERE period >= p_from AND period < p_to;
    DELETE FROM completeness_items WHERE (period >= p_from AND period < p_to) OR (everything AND period IS NULL);

    WITH g AS MATERIALIZED (
        SELECT e.item_id, e.tenant, e.feature, count(*) AS n, sum(e.value) AS v,
               count(*) FILTER (WHERE e.cancelled_at IS NOT NULL) AS cn,
               coalesce(sum(e.value) FILTER (WHERE e.cancelled_at IS NOT NULL), 0) AS cv,
               (array_agg(ROW(e.occurred_at, e.id, e.value)::completeness_last ORDER BY e.occurred_at DESC, e.id DESC))[1] AS last
        FROM usage_events e
        LEFT JOIN usage_cancellations c ON c.event_row = e.id
        WHERE e.item_id IS NOT NULL AND (e.cancelled_at IS NULL OR c.outcome <> 'withdrawn')
          AND e.occurred_at >= p_from AND e.occurred_at < p_to + interval '32 days'
        GROUP BY 1, 2, 3
    ),
    placed AS MATERIALIZED (
        SELECT g.*, (rb.payload ->> 'period')::timestamptz AS period,
               CASE WHEN rs.superseded_by IS NULL THEN g.item_id ELSE coalesce(tally_live_item(g.item_id), g.item_id) END AS live
        FROM g
        JOIN outbox_item_bodies rb ON rb.id = g.item_id
        LEFT JOIN outbox_item_states rs ON rs.id = g.item_id
    ),
    lived AS MATERIALIZED (
        SELECT p.*, ls.state, lb.subject_kind, lb.mapping_version, lb.destination_account,
               (lb.payload ->> 'value')::numeric AS live_value, coalesce((lb.payload ->> 'late')::boolean, false) AS late
        FROM placed p
        LEFT JOIN outbox_item_states ls ON ls.id = p.live
        LEFT JOIN outbox_item_bodies lb ON lb.id = p.live
        WHERE (p.period >= p_from AND p.period < p_to) OR (everything AND p.period IS NULL)
    ),
    aggregations AS (
        SELECT feature, mapping_version, completeness_last_aggregation(feature, mapping_version) AS last
        FROM (SELECT DISTINCT feature, mapping_version FROM lived WHERE mapping_version IS NOT NULL) k
    )
    INSERT INTO completeness_items (item_id, tenant, feature, period, carrier, events, value, cancelled_events,
                                    cancelled_value, last_at, last_id, last_value, applied_bucket, applied_account,
                                    applied_late, applied_inconsistent, applied_events, applied_value,
                                    applied_cancelled_events, applied_cancelled_value)
    SELECT l.item_id, l.tenant, l.feature, l.period, l.live, l.n, l.v, l.cn, l.cv,
           (l.last).occurred_at, (l.last).id, (l.last).value, completeness_bucket(l.state), l.destination_account, l.late,
           CASE WHEN l.subject_kind = 'usage_event' THEN l.live_value = l.v AND l.n = 1
                WHEN a.last THEN l.live_value = (l.last).value
                ELSE l.live_value = l.v END IS FALSE,
           l.n, l.v, l.cn, l.cv
    FROM lived l
    LEFT JOIN aggregations a ON a.feature = l.feature AND a.mapping_version = l.mapping_version;

    INSERT INTO completeness_counters
    SELECT period, tenant, feature, account, 0,
           sum(events), sum(value),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'confirmed'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'confirmed'), 0),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'accepted'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'accepted'), 0),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'pending'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'pending'), 0),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'unstaged'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'unstaged'), 0),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'quarantined'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'quarantined'), 0),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'uncertain'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'uncertain'), 0),
           coalesce(sum(events - cancelled_events) FILTER (WHERE bucket = 'rejected'), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE bucket = 'rejected'), 0),
           sum(CASE WHEN bucket = 'cancelled' THEN events ELSE cancelled_events END),
           sum(CASE WHEN bucket = 'cancelled' THEN value ELSE cancelled_value END),
           coalesce(sum(events - cancelled_events) FILTER (WHERE late), 0),
           coalesce(sum(value - cancelled_value) FILTER (WHERE late), 0),
           sum(items), coalesce(sum(items) FILTER (WHERE inconsistent), 0)
    FROM (
        SELECT a.period, a.tenant, a.feature, a.applied_account AS account, a.applied_bucket AS bucket,
               a.applied_late AS late, a.applied_inconsistent AS inconsistent, 1 AS items,
               a.applied_events AS events, a.applied_value AS value,
               a.applied_cancelled_events AS cancelled_events, a.applied_cancelled_value AS cancelled_value
        FROM completeness_items a
        WHERE a.period >= p_from AND a.period < p_to AND a.applied_bucket IS NOT NULL
        UNION ALL
        SELECT CASE WHEN e.item_id IS NULL
                    THEN tally_period_start(e.occurred_at, coalesce(t.period_anchor, '1970-01-01T00:00:00Z'))
                    ELSE (b.payload ->> 'period')::timestamptz END,
               e.tenant, e.feature, '',
               CASE WHEN e.cancelled_at IS NOT NULL AND coalesce(c.outcome, 'withdrawn') = 'withdrawn' THEN 'cancelled' ELSE 'unstaged' END,
               false, false, 0, 1, e.value, 0, 0
        FROM usage_events e
        LEFT JOIN usage_cancellations c ON c.event_row = e.id
        LEFT JOIN tenant_mappings t ON t.tenant = e.tenant
        LEFT JOIN outbox_item_bodies b ON b.id = e.item_id
        WHERE (e.item_id IS NULL OR (e.cancelled_at IS NOT NULL AND coalesce(c.outcome, 'withdrawn') = 'withdrawn'))
          AND e.occurred_at >= p_from AND e.occurred_at < p_to + interval '32 days'
    ) x
    WHERE period >= p_from AND period < p_to
    GROUP BY period, tenant, feature, account;
END
$$;
-- +goose StatementEnd

-- The backfill: every period.
SELECT completeness_recount('-infinity', 'infinity');

-- The audits are never deleted, whatever the code.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        REVOKE DELETE, TRUNCATE ON completeness_audits FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- NOT VALID: the repairs audited stay (the log is never edited).
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach')) NOT VALID;
DROP TRIGGER tenant_mappings_completeness ON tenant_mappings;
DROP TRIGGER outbox_item_states_completeness_insert ON outbox_item_states;
DROP TRIGGER outbox_item_states_completeness_update ON outbox_item_states;
DROP TRIGGER usage_cancellations_completeness ON usage_cancellations;
DROP TRIGGER usage_events_completeness_update ON usage_events;
DROP TRIGGER usage_events_completeness_insert ON usage_events;
DROP FUNCTION completeness_fold(timestamptz), completeness_recount(timestamptz, timestamptz), completeness_anchor(), completeness_item_insert(), completeness_item_update(),
    completeness_cancellation_insert(), completeness_ledger_update(), completeness_ledger_insert(),
    completeness_events(completeness_event[]), completeness_refresh(bigint[]), completeness_bump(completeness_delta[]),
    completeness_last_aggregation(text, integer),
    completeness_cancel(bigint, timestamptz), completeness_bucket(text), completeness_slot();
DROP TYPE completeness_event, completeness_delta, completeness_last;
DROP TABLE completeness_audits, completeness_items, completeness_counters;
