-- The tenant's bucket: the key the distributed tables share on Citus
-- (docs/scale.md, "Past one server"), the same on plain PostgreSQL.
--
-- tally_bucket(tenant) is the first two bytes of sha256(tenant) as a
-- big-endian integer, mod 1024 (Go: tenantbucket.Of). It is one IMMUTABLE
-- expression with no FROM, so that it inlines: Citus refuses an INSERT …
-- SELECT that calls a SQL function it cannot inline.
--
-- Every table that holds a tenant gets a bucket column, computed once by
-- the rewrite of ADD COLUMN … GENERATED, then made a plain column (a
-- distribution column may not be generated): the writers write it, and
-- CHECK (bucket = tally_bucket(tenant)) refuses a wrong one. The item
-- states and attempts have no tenant: they copy their body's bucket,
-- backfilled here with their user triggers off (the counters and the state
-- machine do not move), and the foreign keys (x, bucket) below prove the
-- copy.
--
-- Every PRIMARY KEY and UNIQUE gets the bucket last, under its old name,
-- so the leading columns and the plans stay what they are; uniqueness is
-- unchanged, as each key holds the tenant or an id unique alone. The
-- PerKey lease becomes one per (ordering key, bucket). Every foreign key
-- between these tables becomes (x, bucket). meter_error_evidence loses its
-- key to the bodies: on Citus a local table may not reference a
-- distributed one; its one writer (reconcile's error report) names only
-- an item it found by identifier and locked in the same transaction.
--
-- The ledger gets a unique index (id, occurred_at, bucket), the replica
-- identity of every month (a shard move copies by logical replication),
-- and loses the plain id index it covers.
--
-- The counters' trigger functions take the firing rows' buckets and carry
-- them on every table they read (docs/scale.md, "The counters' triggers"); they count
-- exactly as before, with the generic plans they had. Citus refuses a
-- generic plan with parameters inside a function: distributing sets
-- plan_cache_mode to force_custom_plan on them. completeness_fold takes
-- the buckets it folds.
--
-- Cost on an existing database: every table above but the states and
-- attempts is rewritten (the ledger too, month by month), the states and
-- attempts are updated row by row, and every key index is built again,
-- each under an ACCESS EXCLUSIVE lock (docs/running.md, "Upgrades").

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION tally_bucket(tenant text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (('x' || left(encode(sha256(tally_utf8(tenant)), 'hex'), 4))::bit(16)::integer & 1023)::smallint $$;
-- +goose StatementEnd

ALTER TABLE usage_events ADD COLUMN bucket smallint GENERATED ALWAYS AS (tally_bucket(tenant)) STORED;
ALTER TABLE usage_event_keys ADD COLUMN bucket smallint GENERATED ALWAYS AS (tally_bucket(tenant)) STORED;
ALTER TABLE usage_cancellations ADD COLUMN bucket smallint GENERATED ALWAYS AS (tally_bucket(tenant)) STORED;
ALTER TABLE outbox_item_bodies ADD COLUMN bucket smallint GENERATED ALWAYS AS (tally_bucket(tenant_key)) STORED;
ALTER TABLE completeness_counters ADD COLUMN bucket smallint GENERATED ALWAYS AS (tally_bucket(tenant)) STORED;
ALTER TABLE completeness_items ADD COLUMN bucket smallint GENERATED ALWAYS AS (tally_bucket(tenant)) STORED;
ALTER TABLE usage_events ALTER COLUMN bucket DROP EXPRESSION;
ALTER TABLE usage_event_keys ALTER COLUMN bucket DROP EXPRESSION;
ALTER TABLE usage_cancellations ALTER COLUMN bucket DROP EXPRESSION;
ALTER TABLE outbox_item_bodies ALTER COLUMN bucket DROP EXPRESSION;
ALTER TABLE completeness_counters ALTER COLUMN bucket DROP EXPRESSION;
ALTER TABLE completeness_items ALTER COLUMN bucket DROP EXPRESSION;
ALTER TABLE usage_events ALTER COLUMN bucket SET NOT NULL,
    ADD CONSTRAINT usage_events_bucket_check CHECK (bucket = tally_bucket(tenant));
ALTER TABLE usage_event_keys ALTER COLUMN bucket SET NOT NULL,
    ADD CONSTRAINT usage_event_keys_bucket_check CHECK (bucket = tally_bucket(tenant));
ALTER TABLE usage_cancellations ALTER COLUMN bucket SET NOT NULL,
    ADD CONSTRAINT usage_cancellations_bucket_check CHECK (bucket = tally_bucket(tenant));
ALTER TABLE outbox_item_bodies ALTER COLUMN bucket SET NOT NULL,
    ADD CONSTRAINT outbox_item_bodies_bucket_check CHECK (bucket = tally_bucket(tenant_key));
ALTER TABLE completeness_counters ALTER COLUMN bucket SET NOT NULL,
    ADD CONSTRAINT completeness_counters_bucket_check CHECK (bucket = tally_bucket(tenant));
ALTER TABLE completeness_items ALTER COLUMN bucket SET NOT NULL,
    ADD CONSTRAINT completeness_items_bucket_check CHECK (bucket = tally_bucket(tenant));

ALTER TABLE outbox_item_states ADD COLUMN bucket smallint;
ALTER TABLE outbox_attempts ADD COLUMN bucket smallint;
ALTER TABLE outbox_item_states DISABLE TRIGGER USER;
ALTER TABLE outbox_attempts DISABLE TRIGGER USER;
UPDATE outbox_item_states s SET bucket = b.bucket FROM outbox_item_bodies b WHERE b.id = s.id;
UPDATE outbox_attempts a SET bucket = b.bucket FROM outbox_item_bodies b WHERE b.id = a.item_id;
ALTER TABLE outbox_item_states ENABLE TRIGGER USER;
ALTER TABLE outbox_attempts ENABLE TRIGGER USER;
ALTER TABLE outbox_item_states ALTER COLUMN bucket SET NOT NULL;
ALTER TABLE outbox_attempts ALTER COLUMN bucket SET NOT NULL;

ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_item_states_id_fkey,
    DROP CONSTRAINT outbox_item_states_superseded_by_fkey;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_item_id_fkey;
ALTER TABLE usage_events DROP CONSTRAINT usage_events_item_id_fkey;
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_carried_by_fkey,
    DROP CONSTRAINT usage_cancellations_item_id_fkey,
    DROP CONSTRAINT usage_cancellations_event_key_fkey;
ALTER TABLE meter_error_evidence DROP CONSTRAINT meter_error_evidence_item_id_fkey;

ALTER TABLE outbox_item_bodies DROP CONSTRAINT outbox_items_pkey,
    ADD CONSTRAINT outbox_items_pkey PRIMARY KEY (id, bucket),
    DROP CONSTRAINT outbox_items_identifier_key,
    ADD CONSTRAINT outbox_items_identifier_key UNIQUE (identifier, bucket),
    DROP CONSTRAINT outbox_items_identity_key,
    ADD CONSTRAINT outbox_items_identity_key
        UNIQUE (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, bucket);
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_item_states_pkey,
    ADD CONSTRAINT outbox_item_states_pkey PRIMARY KEY (id, bucket);
DROP INDEX outbox_item_states_per_key_lease;
CREATE UNIQUE INDEX outbox_item_states_per_key_lease ON outbox_item_states (ordering_key, bucket)
    WHERE state = 'leased' AND per_key_lease;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_pkey,
    ADD CONSTRAINT outbox_attempts_pkey PRIMARY KEY (item_id, lease_token, bucket);
ALTER TABLE usage_event_keys DROP CONSTRAINT usage_event_keys_pkey,
    ADD CONSTRAINT usage_event_keys_pkey PRIMARY KEY (tenant, event_key, bucket);
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_pkey,
    ADD CONSTRAINT usage_cancellations_pkey PRIMARY KEY (id, bucket),
    DROP CONSTRAINT usage_cancellations_event_key,
    ADD CONSTRAINT usage_cancellations_event_key UNIQUE (tenant, event_id, bucket),
    DROP CONSTRAINT usage_cancellations_row_key,
    ADD CONSTRAINT usage_cancellations_row_key UNIQUE (event_row, bucket);
ALTER TABLE completeness_counters DROP CONSTRAINT completeness_counters_pkey,
    ADD CONSTRAINT completeness_counters_pkey PRIMARY KEY (period, tenant, feature, account, slot, bucket);
ALTER TABLE completeness_items DROP CONSTRAINT completeness_items_pkey,
    ADD CONSTRAINT completeness_items_pkey PRIMARY KEY (item_id, tenant, feature, bucket);

ALTER TABLE outbox_item_states
    ADD CONSTRAINT outbox_item_states_id_fkey FOREIGN KEY (id, bucket) REFERENCES outbox_item_bodies (id, bucket),
    ADD CONSTRAINT outbox_item_states_superseded_by_fkey FOREIGN KEY (superseded_by, bucket) REFERENCES outbox_item_bodies (id, bucket);
ALTER TABLE outbox_attempts
    ADD CONSTRAINT outbox_attempts_item_id_fkey FOREIGN KEY (item_id, bucket) REFERENCES outbox_item_bodies (id, bucket);
ALTER TABLE usage_events
    ADD CONSTRAINT usage_events_item_id_fkey FOREIGN KEY (item_id, bucket) REFERENCES outbox_item_bodies (id, bucket);
ALTER TABLE usage_cancellations
    ADD CONSTRAINT usage_cancellations_carried_by_fkey FOREIGN KEY (carried_by, bucket) REFERENCES outbox_item_bodies (id, bucket),
    ADD CONSTRAINT usage_cancellations_item_id_fkey FOREIGN KEY (item_id, bucket) REFERENCES outbox_item_bodies (id, bucket),
    ADD CONSTRAINT usage_cancellations_event_key_fkey FOREIGN KEY (tenant, event_key, bucket)
        REFERENCES usage_event_keys (tenant, event_key, bucket);

CREATE UNIQUE INDEX usage_events_row ON usage_events (id, occurred_at, bucket);
DROP INDEX usage_events_id;

-- usage_events_set_identity makes a month's own index of usage_events_row
-- its replica identity.
-- +goose StatementBegin
CREATE FUNCTION usage_events_set_identity(part regclass) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    ix regclass;
BEGIN
    SELECT i.indexrelid::regclass INTO ix FROM pg_index i JOIN pg_inherits h ON h.inhrelid = i.indexrelid
    WHERE i.indrelid = part AND h.inhparent = 'usage_events_row'::regclass;
    EXECUTE format('ALTER TABLE %s REPLICA IDENTITY USING INDEX %s', part, ix);
END
$$;
-- +goose StatementEnd
SELECT usage_events_set_identity(inhrelid::regclass) FROM pg_inherits WHERE inhparent = 'usage_events'::regclass;

-- usage_events_ensure_months as migration 36 wrote it, each month it
-- creates given its replica identity.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION usage_events_ensure_months(through date) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = public, pg_temp
    SET lock_timeout = '1s'
    AS $$
DECLARE
    m       date := date_trunc('month', now() AT TIME ZONE 'UTC')::date - interval '1 month';
    made    integer := 0;
    part    text;
BEGIN
    IF through > m + interval '2 years' THEN
        RAISE EXCEPTION 'usage_events_ensure_months: % is too far ahead', through;
    END IF;
    WHILE m <= through LOOP
        part := usage_events_month_name(m);
        IF to_regclass(part) IS NULL AND NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = m) THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF usage_events FOR VALUES FROM (%L) TO (%L)',
                part, m::timestamp AT TIME ZONE 'UTC', (m + interval '1 month')::timestamp AT TIME ZONE 'UTC');
            -- Statement triggers are not inherited: TRUNCATE of a partition
            -- is refused as of the ledger.
            EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse(%L)',
                part || '_no_truncate', part, 'rows are never deleted');
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
                EXECUTE format('REVOKE ALL ON %I FROM tally_runtime', part);
            END IF;
            PERFORM usage_events_set_identity(part::regclass);
            made := made + 1;
        END IF;
        m := m + interval '1 month';
    END LOOP;
    RETURN made;
END
$$;
-- +goose StatementEnd

-- The refusals name the table without a shard's suffix: on Citus a
-- trigger fires on the shard, whose TG_TABLE_NAME is the table's name and
-- the shard id (outbox_item_states_102071).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION ledger_refuse() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION '%: %', regexp_replace(TG_TABLE_NAME, '_[0-9]+$', ''), TG_ARGV[0] USING ERRCODE = 'restrict_violation';
END
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_refuse() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    t text := regexp_replace(TG_TABLE_NAME, '_[0-9]+$', '');
BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        RAISE EXCEPTION '%: %', t, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    ELSIF TG_OP = 'UPDATE' AND t = 'outbox_item_states' THEN
        RAISE EXCEPTION '%: % (outbox item %: % -> %)', t, TG_ARGV[0], OLD.id, OLD.state, NEW.state
            USING ERRCODE = 'restrict_violation';
    ELSE
        RAISE EXCEPTION '%: %', t, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    END IF;
END
$$;
-- +goose StatementEnd

-- The view joins on the bucket too (a join of two distributed tables
-- names the distribution column), and shows it.
CREATE OR REPLACE VIEW outbox_items AS
SELECT s.id, b.tenant_key, b.subject_kind, b.subject_ref, s.exporter, b.destination_account, s.mode,
       b.mapping_version, b.identifier, b.payload, s.ordering_key, s.state, s.attempts, s.refused_attempts,
       s.attempts_base, s.next_attempt_at, s.first_attempt_at, s.lease_owner, s.leased_at, s.lease_expires_at,
       s.lease_token, s.provider_ref, s.accepted_at, s.confirmed_at, s.last_error_code, s.last_error_status,
       s.last_error, s.quarantine_reason, s.superseded_by, s.created_at, s.updated_at, s.reported_state,
       s.reported_reason, s.reported_code, s.reported_message, s.bucket
FROM outbox_item_states s LEFT JOIN outbox_item_bodies b ON b.id = s.id AND b.bucket = s.bucket;

-- completeness_change holds a changed ledger row, read from the
-- transition tables before any distributed table is touched.
CREATE TYPE completeness_change AS (
    id bigint, tenant text, feature text, value bigint, occurred_at timestamptz,
    was_item bigint, was_cancelled timestamptz, item_id bigint, cancelled_at timestamptz, staged boolean);

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_bump(d completeness_delta[]) RETURNS bigint
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
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
-- +goose StatementEnd

-- tally_live_item follows an item's successors within its bucket: a
-- successor is its predecessor's tenant's, so the chain never leaves it.
-- +goose StatementBegin
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
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_refresh(roots bigint[], bk smallint[]) RETURNS completeness_delta[]
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
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
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
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
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_update() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    moved bigint[];
    bk    smallint[];
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
    bk := array(SELECT DISTINCT n.bucket FROM completeness_new n);
    roots := array(SELECT DISTINCT a.item_id FROM completeness_items a WHERE a.carrier = ANY (moved) AND a.bucket = ANY (bk));
    IF cardinality(roots) > 0 THEN
        PERFORM completeness_bump(completeness_refresh(roots, bk));
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- The ledger's insert: the tenants' anchors are read from the reference
-- table by a query of their own, then joined to the rows as arrays; rows
-- stored staged or cancelled (a restore) are read into an array first.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    tenants text[] := array(SELECT DISTINCT n.tenant FROM completeness_new n WHERE n.item_id IS NULL AND n.cancelled_at IS NULL);
    done    completeness_change[] := array(
        SELECT ROW(n.id, n.tenant, n.feature, n.value, n.occurred_at, NULL, NULL, n.item_id, n.cancelled_at, false)::completeness_change
        FROM completeness_new n WHERE n.item_id IS NOT NULL OR n.cancelled_at IS NOT NULL);
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
    IF cardinality(done) > 0 THEN
        d := d || completeness_events(array(
            SELECT ROW(1, c.id, c.tenant, c.feature, c.value, c.occurred_at, c.item_id,
                       completeness_cancel(c.id, c.cancelled_at, tally_bucket(c.tenant)))::completeness_event
            FROM unnest(done) c), array(SELECT DISTINCT tally_bucket(c.tenant) FROM unnest(done) c));
    END IF;
    IF cardinality(d) > 0 THEN
        PERFORM completeness_bump(d);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- Staging and cancelling: the ledger's update trigger, and what it calls;
-- completeness_cancel and completeness_events take the buckets.
-- +goose StatementBegin
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
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_events(evs completeness_event[], bk smallint[])
 RETURNS completeness_delta[]
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_update()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    deltas completeness_delta[];
    rest   completeness_event[];
    chs    completeness_change[];
    bk     smallint[];
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
    bk := array(SELECT DISTINCT n.bucket FROM completeness_new n);
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
-- +goose StatementEnd

-- A cancellation's outcome other than withdrawn moves its event's usage:
-- the rows are read from the transition table first.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_cancellation_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
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
-- +goose StatementEnd

-- The fold of a shard group's counter slots, called by the maintenance
-- pass once per shard group with its buckets (on one server, once with
-- every bucket).
DROP FUNCTION completeness_fold(timestamptz);
-- +goose StatementBegin
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
-- +goose StatementEnd

-- A tenant's new period anchor moves its unstaged usage (on Citus this
-- trigger goes: the mapping writer moves it).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_anchor() RETURNS trigger
    LANGUAGE plpgsql
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
                   CASE WHEN completeness_cancel(e.id, e.cancelled_at, e.bucket) = 'withdrawn' THEN 'cancelled' ELSE 'unstaged' END,
                   false, false, 0, s.sign, s.sign * e.value::numeric, 0, 0)::completeness_delta
        FROM usage_events e
        CROSS JOIN LATERAL (SELECT -1 AS sign, was AS anchor
                            UNION ALL SELECT 1, coalesce(NEW.period_anchor, '1970-01-01T00:00:00Z')) s
        WHERE e.tenant = NEW.tenant AND e.bucket = tally_bucket(NEW.tenant) AND e.item_id IS NULL));
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- The recount, with the bucket in every join and every row it writes.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_recount(p_from timestamp with time zone, p_to timestamp with time zone)
    RETURNS void
    LANGUAGE plpgsql
    SET enable_nestloop TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    everything boolean := p_from = '-infinity';
BEGIN
    DELETE FROM completeness_counters WHERE period >= p_from AND period < p_to;
    DELETE FROM completeness_items WHERE (period >= p_from AND period < p_to) OR (everything AND period IS NULL);

    WITH g AS MATERIALIZED (
        SELECT e.item_id, e.tenant, e.feature, e.bucket, count(*) AS n, sum(e.value) AS v,
               count(*) FILTER (WHERE e.cancelled_at IS NOT NULL) AS cn,
               coalesce(sum(e.value) FILTER (WHERE e.cancelled_at IS NOT NULL), 0) AS cv,
               (array_agg(ROW(e.occurred_at, e.id, e.value)::completeness_last ORDER BY e.occurred_at DESC, e.id DESC))[1] AS last
        FROM usage_events e
        LEFT JOIN usage_cancellations c ON c.event_row = e.id AND c.bucket = e.bucket
        WHERE e.item_id IS NOT NULL AND (e.cancelled_at IS NULL OR c.outcome <> 'withdrawn')
          AND e.occurred_at >= p_from AND e.occurred_at < p_to + interval '32 days'
        GROUP BY 1, 2, 3, 4
    ),
    placed AS MATERIALIZED (
        SELECT g.*, (rb.payload ->> 'period')::timestamptz AS period,
               CASE WHEN rs.superseded_by IS NULL THEN g.item_id ELSE coalesce(tally_live_item(g.item_id, g.bucket), g.item_id) END AS live
        FROM g
        JOIN outbox_item_bodies rb ON rb.id = g.item_id AND rb.bucket = g.bucket
        LEFT JOIN outbox_item_states rs ON rs.id = g.item_id AND rs.bucket = g.bucket
    ),
    lived AS MATERIALIZED (
        SELECT p.*, ls.state, lb.subject_kind, lb.mapping_version, lb.destination_account,
               (lb.payload ->> 'value')::numeric AS live_value, coalesce((lb.payload ->> 'late')::boolean, false) AS late
        FROM placed p
        LEFT JOIN outbox_item_states ls ON ls.id = p.live AND ls.bucket = p.bucket
        LEFT JOIN outbox_item_bodies lb ON lb.id = p.live AND lb.bucket = p.bucket
        WHERE (p.period >= p_from AND p.period < p_to) OR (everything AND p.period IS NULL)
    ),
    aggregations AS (
        SELECT feature, mapping_version, completeness_last_aggregation(feature, mapping_version) AS last
        FROM (SELECT DISTINCT feature, mapping_version FROM lived WHERE mapping_version IS NOT NULL) k
    )
    INSERT INTO completeness_items (item_id, tenant, feature, period, carrier, events, value, cancelled_events,
                                    cancelled_value, last_at, last_id, last_value, applied_bucket, applied_account,
                                    applied_late, applied_inconsistent, applied_events, applied_value,
                                    applied_cancelled_events, applied_cancelled_value, bucket)
    SELECT l.item_id, l.tenant, l.feature, l.period, l.live, l.n, l.v, l.cn, l.cv,
           (l.last).occurred_at, (l.last).id, (l.last).value, completeness_bucket(l.state), l.destination_account, l.late,
           CASE WHEN l.subject_kind = 'usage_event' THEN l.live_value = l.v AND l.n = 1
                WHEN a.last THEN l.live_value = (l.last).value
                ELSE l.live_value = l.v END IS FALSE,
           l.n, l.v, l.cn, l.cv, l.bucket
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
           sum(items), coalesce(sum(items) FILTER (WHERE inconsistent), 0), shard_bucket
    FROM (
        SELECT a.period, a.tenant, a.feature, a.applied_account AS account, a.applied_bucket AS bucket,
               a.applied_late AS late, a.applied_inconsistent AS inconsistent, 1 AS items,
               a.applied_events AS events, a.applied_value AS value,
               a.applied_cancelled_events AS cancelled_events, a.applied_cancelled_value AS cancelled_value,
               a.bucket AS shard_bucket
        FROM completeness_items a
        WHERE a.period >= p_from AND a.period < p_to AND a.applied_bucket IS NOT NULL
        UNION ALL
        SELECT CASE WHEN e.item_id IS NULL
                    THEN tally_period_start(e.occurred_at, coalesce(t.period_anchor, '1970-01-01T00:00:00Z'))
                    ELSE (b.payload ->> 'period')::timestamptz END,
               e.tenant, e.feature, '',
               CASE WHEN e.cancelled_at IS NOT NULL AND coalesce(c.outcome, 'withdrawn') = 'withdrawn' THEN 'cancelled' ELSE 'unstaged' END,
               false, false, 0, 1, e.value, 0, 0, e.bucket
        FROM usage_events e
        LEFT JOIN usage_cancellations c ON c.event_row = e.id AND c.bucket = e.bucket
        LEFT JOIN tenant_mappings t ON t.tenant = e.tenant
        LEFT JOIN outbox_item_bodies b ON b.id = e.item_id AND b.bucket = e.bucket
        WHERE (e.item_id IS NULL OR (e.cancelled_at IS NOT NULL AND coalesce(c.outcome, 'withdrawn') = 'withdrawn'))
          AND e.occurred_at >= p_from AND e.occurred_at < p_to + interval '32 days'
    ) x
    WHERE period >= p_from AND period < p_to
    GROUP BY period, tenant, feature, account, shard_bucket;
END
$$;
-- +goose StatementEnd

-- The forms without the buckets are gone; tally_live_item(item) stays
-- for the statements that have not the item's bucket at hand.
DROP FUNCTION completeness_refresh(bigint[]), completeness_events(completeness_event[]), completeness_cancel(bigint, timestamptz);


-- +goose Down
DROP VIEW outbox_items;
CREATE VIEW outbox_items AS
SELECT s.id, b.tenant_key, b.subject_kind, b.subject_ref, s.exporter, b.destination_account, s.mode,
       b.mapping_version, b.identifier, b.payload, s.ordering_key, s.state, s.attempts, s.refused_attempts,
       s.attempts_base, s.next_attempt_at, s.first_attempt_at, s.lease_owner, s.leased_at, s.lease_expires_at,
       s.lease_token, s.provider_ref, s.accepted_at, s.confirmed_at, s.last_error_code, s.last_error_status,
       s.last_error, s.quarantine_reason, s.superseded_by, s.created_at, s.updated_at, s.reported_state,
       s.reported_reason, s.reported_code, s.reported_message
FROM outbox_item_states s LEFT JOIN outbox_item_bodies b ON b.id = s.id;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_bump(d completeness_delta[])
 RETURNS bigint
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_refresh(roots bigint[])
 RETURNS completeness_delta[]
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_insert()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_item_update()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_insert()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_cancel(event_row bigint, cancelled_at timestamp with time zone)
 RETURNS text
 LANGUAGE plpgsql
 STABLE
AS $$
BEGIN
    IF cancelled_at IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN coalesce((SELECT c.outcome FROM usage_cancellations c WHERE c.event_row = completeness_cancel.event_row), 'withdrawn');
END
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_events(evs completeness_event[])
 RETURNS completeness_delta[]
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_ledger_update()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_cancellation_insert()
 RETURNS trigger
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
BEGIN
    PERFORM completeness_bump(completeness_events(array(
        SELECT ROW(s.sign, e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id, s.cancel)::completeness_event
        FROM completeness_new c JOIN usage_events e ON e.id = c.event_row
        CROSS JOIN LATERAL (SELECT -1 AS sign, 'withdrawn' AS cancel UNION ALL SELECT 1, c.outcome) s
        WHERE e.cancelled_at IS NOT NULL AND c.outcome <> 'withdrawn')));
    RETURN NULL;
END
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_fold(p_to timestamp with time zone)
 RETURNS bigint
 LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    WITH victims AS (
        SELECT period, tenant, feature, account, slot FROM completeness_counters
        WHERE period < p_to AND slot <> 0
        ORDER BY period, tenant, feature, account, slot
        FOR UPDATE SKIP LOCKED
    ),
    moved AS (
        DELETE FROM completeness_counters c USING victims v
        WHERE (c.period, c.tenant, c.feature, c.account, c.slot) = (v.period, v.tenant, v.feature, v.account, v.slot)
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_anchor()
 RETURNS trigger
 LANGUAGE plpgsql
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_recount(p_from timestamp with time zone, p_to timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 SET enable_nestloop TO 'off'
 SET jit TO 'off'
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
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION usage_events_ensure_months(through date)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
 SET lock_timeout TO '1s'
AS $$
DECLARE
    m       date := date_trunc('month', now() AT TIME ZONE 'UTC')::date - interval '1 month';
    made    integer := 0;
    part    text;
BEGIN
    IF through > m + interval '2 years' THEN
        RAISE EXCEPTION 'usage_events_ensure_months: % is too far ahead', through;
    END IF;
    WHILE m <= through LOOP
        part := usage_events_month_name(m);
        IF to_regclass(part) IS NULL AND NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = m) THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF usage_events FOR VALUES FROM (%L) TO (%L)',
                part, m::timestamp AT TIME ZONE 'UTC', (m + interval '1 month')::timestamp AT TIME ZONE 'UTC');
            -- Statement triggers are not inherited: TRUNCATE of a partition
            -- is refused as of the ledger.
            EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse(%L)',
                part || '_no_truncate', part, 'rows are never deleted');
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
                EXECUTE format('REVOKE ALL ON %I FROM tally_runtime', part);
            END IF;
            made := made + 1;
        END IF;
        m := m + interval '1 month';
    END LOOP;
    RETURN made;
END
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION ledger_refuse()
 RETURNS trigger
 LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION '%: %', TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
END
$$

;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_refuse()
 RETURNS trigger
 LANGUAGE plpgsql
AS $$
BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        RAISE EXCEPTION '%: %', TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    ELSIF TG_OP = 'UPDATE' AND TG_TABLE_NAME = 'outbox_item_states' THEN
        RAISE EXCEPTION '%: % (outbox item %: % -> %)', TG_TABLE_NAME, TG_ARGV[0], OLD.id, OLD.state, NEW.state
            USING ERRCODE = 'restrict_violation';
    ELSE
        RAISE EXCEPTION '%: %', TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    END IF;
END
$$

;
-- +goose StatementEnd

DROP FUNCTION completeness_fold(timestamptz, smallint[]), completeness_refresh(bigint[], smallint[]),
    completeness_events(completeness_event[], smallint[]), completeness_cancel(bigint, timestamptz, smallint),
    tally_live_item(bigint, smallint);
DROP TYPE completeness_change;

-- +goose StatementBegin
DO $$
DECLARE
    p regclass;
BEGIN
    FOR p IN SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = 'usage_events'::regclass LOOP
        EXECUTE format('ALTER TABLE %s REPLICA IDENTITY DEFAULT', p);
    END LOOP;
END $$;
-- +goose StatementEnd
DROP FUNCTION usage_events_set_identity(regclass);
CREATE INDEX usage_events_id ON usage_events (id);
DROP INDEX usage_events_row;

ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_item_states_id_fkey,
    DROP CONSTRAINT outbox_item_states_superseded_by_fkey;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_item_id_fkey;
ALTER TABLE usage_events DROP CONSTRAINT usage_events_item_id_fkey;
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_carried_by_fkey,
    DROP CONSTRAINT usage_cancellations_item_id_fkey,
    DROP CONSTRAINT usage_cancellations_event_key_fkey;

ALTER TABLE outbox_item_bodies DROP CONSTRAINT outbox_items_pkey,
    ADD CONSTRAINT outbox_items_pkey PRIMARY KEY (id),
    DROP CONSTRAINT outbox_items_identifier_key,
    ADD CONSTRAINT outbox_items_identifier_key UNIQUE (identifier),
    DROP CONSTRAINT outbox_items_identity_key,
    ADD CONSTRAINT outbox_items_identity_key
        UNIQUE (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version);
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_item_states_pkey,
    ADD CONSTRAINT outbox_item_states_pkey PRIMARY KEY (id);
DROP INDEX outbox_item_states_per_key_lease;
CREATE UNIQUE INDEX outbox_item_states_per_key_lease ON outbox_item_states (ordering_key)
    WHERE state = 'leased' AND per_key_lease;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_pkey,
    ADD CONSTRAINT outbox_attempts_pkey PRIMARY KEY (item_id, lease_token);
ALTER TABLE usage_event_keys DROP CONSTRAINT usage_event_keys_pkey,
    ADD CONSTRAINT usage_event_keys_pkey PRIMARY KEY (tenant, event_key);
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_pkey,
    ADD CONSTRAINT usage_cancellations_pkey PRIMARY KEY (id),
    DROP CONSTRAINT usage_cancellations_event_key,
    ADD CONSTRAINT usage_cancellations_event_key UNIQUE (tenant, event_id),
    DROP CONSTRAINT usage_cancellations_row_key,
    ADD CONSTRAINT usage_cancellations_row_key UNIQUE (event_row);
ALTER TABLE completeness_counters DROP CONSTRAINT completeness_counters_pkey,
    ADD CONSTRAINT completeness_counters_pkey PRIMARY KEY (period, tenant, feature, account, slot);
ALTER TABLE completeness_items DROP CONSTRAINT completeness_items_pkey,
    ADD CONSTRAINT completeness_items_pkey PRIMARY KEY (item_id, tenant, feature);

ALTER TABLE outbox_item_states
    ADD CONSTRAINT outbox_item_states_id_fkey FOREIGN KEY (id) REFERENCES outbox_item_bodies (id),
    ADD CONSTRAINT outbox_item_states_superseded_by_fkey FOREIGN KEY (superseded_by) REFERENCES outbox_item_bodies (id);
ALTER TABLE outbox_attempts
    ADD CONSTRAINT outbox_attempts_item_id_fkey FOREIGN KEY (item_id) REFERENCES outbox_item_bodies (id);
ALTER TABLE usage_events
    ADD CONSTRAINT usage_events_item_id_fkey FOREIGN KEY (item_id) REFERENCES outbox_item_bodies (id);
ALTER TABLE usage_cancellations
    ADD CONSTRAINT usage_cancellations_carried_by_fkey FOREIGN KEY (carried_by) REFERENCES outbox_item_bodies (id),
    ADD CONSTRAINT usage_cancellations_item_id_fkey FOREIGN KEY (item_id) REFERENCES outbox_item_bodies (id),
    ADD CONSTRAINT usage_cancellations_event_key_fkey FOREIGN KEY (tenant, event_key)
        REFERENCES usage_event_keys (tenant, event_key);
ALTER TABLE meter_error_evidence
    ADD CONSTRAINT meter_error_evidence_item_id_fkey FOREIGN KEY (item_id) REFERENCES outbox_item_bodies (id);

ALTER TABLE usage_events DROP COLUMN bucket;
ALTER TABLE usage_event_keys DROP COLUMN bucket;
ALTER TABLE usage_cancellations DROP COLUMN bucket;
ALTER TABLE outbox_item_bodies DROP COLUMN bucket;
ALTER TABLE outbox_item_states DROP COLUMN bucket;
ALTER TABLE outbox_attempts DROP COLUMN bucket;
ALTER TABLE completeness_counters DROP COLUMN bucket;
ALTER TABLE completeness_items DROP COLUMN bucket;
DROP FUNCTION tally_bucket(text);
