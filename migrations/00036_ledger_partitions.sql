-- The ledger by month, so that a closed period can leave the database
-- (docs/design.md, "Ledger months"; docs/running.md says what this costs).
--
-- usage_events becomes a table partitioned by range of occurred_at, one
-- partition a month (usage_events_yYYYYmMM, UTC), created ahead by
-- usage_events_ensure_months (here for history and the next three months,
-- then daily by a River job). usage_events_before holds what occurred
-- before the first month kept as its own partition: back-dated usage.
-- There is no default partition: DETACH ... CONCURRENTLY refuses a table
-- that has one.
--
-- A unique index of a partitioned table must hold the partition key, so
-- (tenant, event_id) cannot stay unique in the ledger itself. It moves to
-- usage_event_keys: one row per event ever stored, kept when its month
-- leaves, so that a re-post of a detached month's event is found and
-- refused, never stored twice. The key is md5(event_id) as a uuid, 16
-- bytes whatever the id's length; the ingest compares the stored event_id
-- too. usage_cancellations referred to the ledger row; it refers to the key
-- now (event_key, generated from event_id).
--
-- usage_closed_months lists the months detached (meter.DetachMonth): an
-- event of a closed month is refused period_closed at ingest.
--
-- Bytes: the columns are ordered widest-aligned first (no padding between
-- them), the ledger's id index is not unique (the identity makes ids
-- unique, and a unique index would have to carry occurred_at), and
-- usage_events_received is a BRIN index: received_at is set by the database
-- at insert, so block ranges follow it (docs/performance.md).
--
-- Privileges: tally_runtime (NOLOGIN) is the role `tally serve` connects
-- as, through a login role granted it (`tally migrate --grant-runtime`): it
-- reads and writes every table but never deletes a ledger, outbox or audit
-- row, and it owns nothing, so it cannot TRUNCATE, DETACH or DROP. Made
-- only where the migrating role may create roles; docs/security.md.
--
-- The conversion rewrites the ledger once, under an ACCESS EXCLUSIVE lock:
-- ingest waits for it. The rows keep their ids; the identity continues.

-- +goose Up
CREATE TABLE usage_event_keys (
    event_row   bigint      NOT NULL,
    occurred_at timestamptz NOT NULL,
    event_key   uuid        NOT NULL,
    tenant      text        NOT NULL,
    CONSTRAINT usage_event_keys_pkey PRIMARY KEY (tenant, event_key)
);
CREATE TRIGGER usage_event_keys_immutable BEFORE UPDATE OR DELETE ON usage_event_keys
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('event keys are never changed or deleted');
CREATE TRIGGER usage_event_keys_no_truncate BEFORE TRUNCATE ON usage_event_keys
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('event keys are never deleted');

CREATE TABLE usage_closed_months (
    month       date        PRIMARY KEY,
    -- The rows the detached partition held, as counted by the detach.
    events      bigint      NOT NULL,
    closed_by   text        NOT NULL,
    closed_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT usage_closed_months_month_check CHECK (extract(day FROM month) = 1)
);
CREATE TRIGGER usage_closed_months_append_only BEFORE UPDATE OR DELETE ON usage_closed_months
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('a closed month stays closed');
CREATE TRIGGER usage_closed_months_no_truncate BEFORE TRUNCATE ON usage_closed_months
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('a closed month stays closed');

LOCK TABLE usage_events IN ACCESS EXCLUSIVE MODE;
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_event_row_fkey;
ALTER TABLE usage_events RENAME TO usage_events_unpartitioned;
ALTER SEQUENCE usage_events_id_seq RENAME TO usage_events_unpartitioned_id_seq;
ALTER TABLE usage_events_unpartitioned DROP CONSTRAINT usage_events_pkey;
ALTER TABLE usage_events_unpartitioned DROP CONSTRAINT usage_events_tenant_event_key;
DROP INDEX usage_events_unstaged, usage_events_item, usage_events_received, usage_events_unstaged_received, usage_events_occurred;

CREATE TABLE usage_events (
    id              bigint      GENERATED ALWAYS AS IDENTITY,
    value           bigint      NOT NULL,
    occurred_at     timestamptz NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    item_id         bigint      CONSTRAINT usage_events_item_id_fkey REFERENCES outbox_item_bodies (id),
    staged_at       timestamptz,
    cancelled_at    timestamptz,
    timestamp_given boolean     NOT NULL,
    tenant          text        NOT NULL,
    event_id        text        NOT NULL,
    feature         text        NOT NULL,
    CONSTRAINT usage_events_tenant_check CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT usage_events_feature_check CHECK (feature ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT usage_events_event_id_check CHECK (char_length(event_id) BETWEEN 1 AND 128 AND event_id ~ '^[[:print:]]+$'),
    CONSTRAINT usage_events_staged_check CHECK ((item_id IS NULL) = (staged_at IS NULL))
) PARTITION BY RANGE (occurred_at);
CREATE INDEX usage_events_id ON usage_events (id);
CREATE INDEX usage_events_unstaged ON usage_events (tenant, feature, occurred_at) WHERE item_id IS NULL;
CREATE INDEX usage_events_item ON usage_events (item_id);
CREATE INDEX usage_events_unstaged_received ON usage_events (received_at) WHERE item_id IS NULL;
CREATE INDEX usage_events_occurred ON usage_events USING brin (occurred_at timestamptz_minmax_multi_ops)
    WITH (autosummarize = on);
CREATE INDEX usage_events_received ON usage_events USING brin (received_at) WITH (autosummarize = on);

CREATE TRIGGER usage_events_no_delete BEFORE DELETE ON usage_events
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('rows are never deleted');
CREATE TRIGGER usage_events_no_truncate BEFORE TRUNCATE ON usage_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('rows are never deleted');
CREATE TRIGGER usage_events_immutable BEFORE UPDATE ON usage_events
    FOR EACH ROW WHEN (
        (NEW.id, NEW.tenant, NEW.event_id, NEW.feature, NEW.value, NEW.occurred_at, NEW.timestamp_given, NEW.received_at)
        IS DISTINCT FROM
        (OLD.id, OLD.tenant, OLD.event_id, OLD.feature, OLD.value, OLD.occurred_at, OLD.timestamp_given, OLD.received_at)
        OR (OLD.item_id IS NOT NULL AND (NEW.item_id, NEW.staged_at) IS DISTINCT FROM (OLD.item_id, OLD.staged_at))
        OR (OLD.cancelled_at IS NOT NULL AND NEW.cancelled_at IS DISTINCT FROM OLD.cancelled_at))
    EXECUTE FUNCTION ledger_refuse('a ledger row is immutable; its item and its cancellation are set once');

-- usage_events_month_name is the partition of the month that starts at m.
-- +goose StatementBegin
CREATE FUNCTION usage_events_month_name(m date) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT 'usage_events_' || to_char(m, '"y"YYYY"m"MM')
$$;
-- +goose StatementEnd

-- usage_events_ensure_months creates the month partitions of the ledger
-- from the month before the current one through the month of through,
-- skipping the closed months and those that exist, and returns how many it
-- created. It runs as the ledger's owner (SECURITY DEFINER) so that the
-- runtime role's daily job can call it. A partition is created under an
-- ACCESS EXCLUSIVE lock of the ledger: it waits at most a second for it,
-- and fails (to be retried the next day) rather than queue ingest behind a
-- long transaction.
-- +goose StatementBegin
CREATE FUNCTION usage_events_ensure_months(through date) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '1s' AS $$
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
$$;
-- +goose StatementEnd

-- The partitions: usage_events_before up to the first month kept as its
-- own (the oldest month of the ledger, at most two years back), then one a
-- month through three months ahead.
-- +goose StatementBegin
DO $$
DECLARE
    cur   date := date_trunc('month', now() AT TIME ZONE 'UTC')::date;
    first date;
    m     date;
    part  text;
BEGIN
    SELECT date_trunc('month', min(occurred_at) AT TIME ZONE 'UTC')::date INTO first FROM usage_events_unpartitioned;
    first := least(cur - interval '3 months', greatest(coalesce(first, cur), cur - interval '2 years'));
    EXECUTE format('CREATE TABLE usage_events_before PARTITION OF usage_events FOR VALUES FROM (MINVALUE) TO (%L)',
        first::timestamp AT TIME ZONE 'UTC');
    CREATE TRIGGER usage_events_before_no_truncate BEFORE TRUNCATE ON usage_events_before
        FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('rows are never deleted');
    m := first;
    WHILE m < cur - interval '1 month' LOOP
        part := usage_events_month_name(m);
        EXECUTE format('CREATE TABLE %I PARTITION OF usage_events FOR VALUES FROM (%L) TO (%L)',
            part, m::timestamp AT TIME ZONE 'UTC', (m + interval '1 month')::timestamp AT TIME ZONE 'UTC');
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse(%L)',
            part || '_no_truncate', part, 'rows are never deleted');
        m := m + interval '1 month';
    END LOOP;
    PERFORM usage_events_ensure_months((cur + interval '3 months')::date);
END
$$;
-- +goose StatementEnd

-- The rows, set-based, with their ids; then the identity goes on from where
-- the old one stood.
INSERT INTO usage_events (id, value, occurred_at, received_at, item_id, staged_at, cancelled_at, timestamp_given, tenant, event_id, feature)
    OVERRIDING SYSTEM VALUE
    SELECT id, value, occurred_at, received_at, item_id, staged_at, cancelled_at, timestamp_given, tenant, event_id, feature
    FROM usage_events_unpartitioned;
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant)
    SELECT id, occurred_at, md5(event_id)::uuid, tenant FROM usage_events_unpartitioned;
SELECT setval('usage_events_id_seq', last_value, is_called) FROM usage_events_unpartitioned_id_seq;
DROP TABLE usage_events_unpartitioned;

-- A detach is audited. NOT VALID: the existing entries are not re-read.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach')) NOT VALID;

ALTER TABLE usage_cancellations ADD COLUMN event_key uuid GENERATED ALWAYS AS (md5(event_id)::uuid) STORED;
ALTER TABLE usage_cancellations ADD CONSTRAINT usage_cancellations_event_key_fkey
    FOREIGN KEY (tenant, event_key) REFERENCES usage_event_keys (tenant, event_key);

-- The runtime role.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        IF NOT (SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user) THEN
            RAISE NOTICE 'tally_runtime not created: % may not create roles (docs/security.md)', current_user;
            RETURN;
        END IF;
        BEGIN
            CREATE ROLE tally_runtime NOLOGIN;
        EXCEPTION WHEN duplicate_object THEN
            NULL; -- made meanwhile by another database's migration
        END;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO tally_runtime', current_schema());
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %I TO tally_runtime', current_schema());
    EXECUTE format('GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA %I TO tally_runtime', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO tally_runtime', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO tally_runtime', current_schema());
    -- What is never deleted, whatever the code: the ledger, its keys and
    -- cancellations, the outbox and its history, the audit log, the mapping
    -- history, the evidence of reconciliation.
    REVOKE DELETE ON usage_events, usage_event_keys, usage_cancellations, usage_closed_months,
        outbox_item_bodies, outbox_item_states, outbox_attempts, audit_log,
        feature_mapping_versions, tenant_mapping_versions, reconcile_runs, reconcile_discrepancies,
        reconcile_resolutions, stripe_events, meter_error_evidence FROM tally_runtime;
    -- Only the owner closes a month (meter.DetachMonth) or migrates.
    REVOKE INSERT, UPDATE ON usage_closed_months FROM tally_runtime;
    IF to_regclass('goose_db_version') IS NOT NULL THEN
        REVOKE INSERT, UPDATE, DELETE ON goose_db_version FROM tally_runtime;
    END IF;
    -- The partitions are reached through the ledger only.
    EXECUTE (SELECT string_agg(format('REVOKE ALL ON %I FROM tally_runtime', c.relname), '; ')
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'usage_events'::regclass);
END
$$;
-- +goose StatementEnd

-- +goose Down
-- For development only: the ledger back in one table (every month still
-- attached; refused once a month was closed).
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM usage_closed_months) THEN
        RAISE EXCEPTION 'a ledger month was detached: restore a backup instead';
    END IF;
END
$$;
-- +goose StatementEnd
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_event_key_fkey;
ALTER TABLE usage_cancellations DROP COLUMN event_key;
ALTER TABLE usage_events RENAME TO usage_events_partitioned;
ALTER SEQUENCE usage_events_id_seq RENAME TO usage_events_partitioned_id_seq;
ALTER INDEX usage_events_unstaged RENAME TO usage_events_partitioned_unstaged;
ALTER INDEX usage_events_item RENAME TO usage_events_partitioned_item;
ALTER INDEX usage_events_unstaged_received RENAME TO usage_events_partitioned_unstaged_received;
ALTER INDEX usage_events_occurred RENAME TO usage_events_partitioned_occurred;
ALTER INDEX usage_events_received RENAME TO usage_events_partitioned_received;
CREATE TABLE usage_events (
    id              bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant          text    NOT NULL,
    event_id        text    NOT NULL,
    feature         text    NOT NULL,
    value           bigint  NOT NULL,
    occurred_at     timestamptz NOT NULL,
    timestamp_given boolean NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    item_id         bigint  REFERENCES outbox_item_bodies (id),
    staged_at       timestamptz,
    cancelled_at    timestamptz,
    CONSTRAINT usage_events_tenant_event_key UNIQUE (tenant, event_id),
    CONSTRAINT usage_events_tenant_check CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT usage_events_feature_check CHECK (feature ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT usage_events_event_id_check CHECK (char_length(event_id) BETWEEN 1 AND 128 AND event_id ~ '^[[:print:]]+$'),
    CONSTRAINT usage_events_staged_check CHECK ((item_id IS NULL) = (staged_at IS NULL))
);
INSERT INTO usage_events (id, tenant, event_id, feature, value, occurred_at, timestamp_given, received_at, item_id, staged_at, cancelled_at)
    OVERRIDING SYSTEM VALUE
    SELECT id, tenant, event_id, feature, value, occurred_at, timestamp_given, received_at, item_id, staged_at, cancelled_at
    FROM usage_events_partitioned;
SELECT setval('usage_events_id_seq', last_value, is_called) FROM usage_events_partitioned_id_seq;
DROP TABLE usage_events_partitioned;
DROP FUNCTION usage_events_ensure_months(date);
DROP FUNCTION usage_events_month_name(date);
CREATE INDEX usage_events_unstaged ON usage_events (tenant, feature, occurred_at) WHERE item_id IS NULL;
CREATE INDEX usage_events_item ON usage_events (item_id);
CREATE INDEX usage_events_received ON usage_events (received_at);
CREATE INDEX usage_events_unstaged_received ON usage_events (received_at) WHERE item_id IS NULL;
CREATE INDEX usage_events_occurred ON usage_events USING brin (occurred_at timestamptz_minmax_multi_ops)
    WITH (autosummarize = on);
CREATE TRIGGER usage_events_no_delete BEFORE DELETE ON usage_events
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('rows are never deleted');
CREATE TRIGGER usage_events_no_truncate BEFORE TRUNCATE ON usage_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('rows are never deleted');
CREATE TRIGGER usage_events_immutable BEFORE UPDATE ON usage_events
    FOR EACH ROW WHEN (
        (NEW.id, NEW.tenant, NEW.event_id, NEW.feature, NEW.value, NEW.occurred_at, NEW.timestamp_given, NEW.received_at)
        IS DISTINCT FROM
        (OLD.id, OLD.tenant, OLD.event_id, OLD.feature, OLD.value, OLD.occurred_at, OLD.timestamp_given, OLD.received_at)
        OR (OLD.item_id IS NOT NULL AND (NEW.item_id, NEW.staged_at) IS DISTINCT FROM (OLD.item_id, OLD.staged_at))
        OR (OLD.cancelled_at IS NOT NULL AND NEW.cancelled_at IS DISTINCT FROM OLD.cancelled_at))
    EXECUTE FUNCTION ledger_refuse('a ledger row is immutable; its item and its cancellation are set once');
ALTER TABLE usage_cancellations ADD CONSTRAINT usage_cancellations_event_row_fkey
    FOREIGN KEY (event_row) REFERENCES usage_events (id);
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve')) NOT VALID;
DROP TABLE usage_closed_months;
DROP TABLE usage_event_keys;
