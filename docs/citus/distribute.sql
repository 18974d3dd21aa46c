-- Draft: Tally's schema distributed by a tenant bucket on Citus 13.2.
--
-- Not a goose migration yet (docs/scale.md, "Past one server"). It runs,
-- as the tables' owner on the coordinator of a cluster whose workers are
-- added, after `tally migrate` has applied every migration up to 46 —
-- verified on a coordinator and two workers (docs/citus/findings.md).
-- Parts A and B are for every database (plain Postgres too: the code is
-- one, so the columns and keys are the same everywhere); part C only
-- where `citus` is installed.
--
-- Order: A (the bucket function and columns), B (keys, foreign keys, the
-- view, then completeness.sql's functions, all with the bucket), C
-- (reference tables first, then the distributed tables, the referenced
-- one first), D (the coordinator's copy of the rows removed). Run with
-- psql -f (it includes completeness.sql).

\set ON_ERROR_STOP on
BEGIN;

-- ===== A. The bucket ======================================================

-- tally_bucket is the tenant's bucket: the first two bytes of
-- sha256(tenant) as a big-endian integer, mod 1024. sha256 over the
-- tenant's UTF-8 bytes is the same on every PostgreSQL version and in Go:
--   b := sha256.Sum256([]byte(tenant)); bucket := int16(binary.BigEndian.Uint16(b[:2]) & 1023)
-- (hashtext is not: it is internal and has changed between versions.)
-- One expression, no FROM: Citus refuses an INSERT … SELECT that calls a
-- SQL function it cannot inline ("could not create distributed plan").
CREATE FUNCTION tally_bucket(tenant text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (('x' || left(encode(sha256(tally_utf8(tenant)), 'hex'), 4))::bit(16)::integer & 1023)::smallint $$;

-- Tables that hold the tenant get the bucket computed by a generated
-- column in the rewrite ADD COLUMN does anyway, then made a plain column
-- (a distribution column may not be generated): the writers write it and
-- the CHECK refuses a wrong one, so a bad bucket is an error, never a row
-- on the wrong shard.
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

-- The state and attempt rows have no tenant: they copy the body's bucket,
-- and the foreign key (id, bucket) below proves the copy. The backfill is
-- an UPDATE of every row, with the table's user triggers disabled (the
-- counters and the state machine do not move; the owner may do this).
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

-- ===== B. Keys with the bucket ============================================

-- The NOTIFY triggers fail any write of two shards at its PREPARE
-- (findings §2.3); migration 47 replaces them by the application's NOTIFY.
DROP TRIGGER IF EXISTS outbox_item_states_notify_insert ON outbox_item_states;
DROP TRIGGER IF EXISTS outbox_item_states_notify_pending ON outbox_item_states;

-- Every foreign key into the bodies goes, then comes back as (x, bucket).
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_item_states_id_fkey,
    DROP CONSTRAINT outbox_item_states_superseded_by_fkey;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_item_id_fkey;
ALTER TABLE usage_events DROP CONSTRAINT usage_events_item_id_fkey;
ALTER TABLE usage_cancellations DROP CONSTRAINT usage_cancellations_carried_by_fkey,
    DROP CONSTRAINT usage_cancellations_item_id_fkey,
    DROP CONSTRAINT usage_cancellations_event_key_fkey;
-- A local table may not reference a distributed one (findings §1.5): the
-- evidence keeps the item id, checked by its writer, not by a key.
ALTER TABLE meter_error_evidence DROP CONSTRAINT meter_error_evidence_item_id_fkey;

-- Every PRIMARY KEY and UNIQUE gets the bucket last, so the leading
-- columns, and the plans on one server, stay what they are. The uniqueness
-- is the same: each key holds the tenant (or the item id, unique with the
-- bucket as it was alone), and the bucket is a function of the tenant.
ALTER TABLE outbox_item_bodies DROP CONSTRAINT outbox_items_pkey,
    ADD CONSTRAINT outbox_items_pkey PRIMARY KEY (id, bucket),
    DROP CONSTRAINT outbox_items_identifier_key,
    ADD CONSTRAINT outbox_items_identifier_key UNIQUE (identifier, bucket),
    DROP CONSTRAINT outbox_items_identity_key,
    ADD CONSTRAINT outbox_items_identity_key
        UNIQUE (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, bucket);
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_item_states_pkey,
    ADD CONSTRAINT outbox_item_states_pkey PRIMARY KEY (id, bucket);
-- One PerKey lease per (ordering key, bucket): per key whenever a Stripe
-- customer is fed by tenants of one bucket (findings §1.3).
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

-- A unique key on the ledger, the replica identity of every partition: a
-- shard move copies by logical replication, which needs one on every
-- table of the shard group (findings §3.5); (id, occurred_at, bucket)
-- holds what usage_events_id (id) held, so that index goes.
CREATE UNIQUE INDEX usage_events_row ON usage_events (id, occurred_at, bucket);
DROP INDEX usage_events_id;
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
SELECT usage_events_set_identity(inhrelid::regclass) FROM pg_inherits WHERE inhparent = 'usage_events'::regclass;
-- usage_events_ensure_months sets it on each month it creates: the
-- function as migration 36 wrote it, with that one call added.
DO $$
DECLARE
    src text := pg_get_functiondef('usage_events_ensure_months(date)'::regprocedure);
BEGIN
    src := replace(src, $r$            made := made + 1;$r$,
                   $r$            PERFORM usage_events_set_identity(part::regclass);
            made := made + 1;$r$);
    IF position('usage_events_set_identity' IN src) = 0 THEN
        RAISE EXCEPTION 'usage_events_ensure_months is not the function this draft expects';
    END IF;
    EXECUTE src;
END $$;

-- The refusals name the table: on a shard TG_TABLE_NAME is the shard's
-- (outbox_item_states_102071), so the shard id is cut off, and the edge
-- report, which compared the name, fires on the shards too.
CREATE OR REPLACE FUNCTION ledger_refuse() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION '%: %', regexp_replace(TG_TABLE_NAME, '_[0-9]+$', ''), TG_ARGV[0] USING ERRCODE = 'restrict_violation';
END
$$;
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

-- The view joins on the bucket too: a join of two distributed tables must
-- include the distribution column (findings §3).
CREATE OR REPLACE VIEW outbox_items AS
SELECT s.id, b.tenant_key, b.subject_kind, b.subject_ref, s.exporter, b.destination_account, s.mode,
       b.mapping_version, b.identifier, b.payload, s.ordering_key, s.state, s.attempts, s.refused_attempts,
       s.attempts_base, s.next_attempt_at, s.first_attempt_at, s.lease_owner, s.leased_at, s.lease_expires_at,
       s.lease_token, s.provider_ref, s.accepted_at, s.confirmed_at, s.last_error_code, s.last_error_status,
       s.last_error, s.quarantine_reason, s.superseded_by, s.created_at, s.updated_at, s.reported_state,
       s.reported_reason, s.reported_code, s.reported_message, s.bucket
FROM outbox_item_states s LEFT JOIN outbox_item_bodies b ON b.id = s.id AND b.bucket = s.bucket;

COMMIT;

-- The counters' trigger functions, made shard-local (same on plain Postgres).
\ir completeness.sql

-- ===== C. Citus only ======================================================

BEGIN;
-- Distributing a table with triggers, and creating one on it later (a new
-- month's partition gets its TRUNCATE trigger), need this; the database's
-- default keeps later migrations and usage_events_ensure_months working.
SET LOCAL citus.enable_unsafe_triggers = on;
DO $$ BEGIN
    EXECUTE format('ALTER DATABASE %I SET citus.enable_unsafe_triggers = on', current_database());
END $$;

-- A trigger on a reference table fires on every placement (each worker's
-- and the coordinator's copy) and may not write a distributed table from
-- there (findings §2.4): the anchor's move of the unstaged counters is the
-- mapping writer's own statement on Citus.
DROP TRIGGER tenant_mappings_completeness ON tenant_mappings;

-- The mappings: small, read by staging and joined to the ledger.
SELECT create_reference_table('tenant_mappings');
SELECT create_reference_table('tenant_mapping_versions');
SELECT create_reference_table('feature_mappings');
SELECT create_reference_table('feature_mapping_versions');
SELECT create_reference_table('stripe_meters');
SELECT create_reference_table('stripe_customer_names');

-- create_distributed_table copies the rows into the shards, and the
-- shards' triggers fire on that copy (findings §5): the counters would
-- count every row twice, and the items' trigger reads tables not yet
-- distributed. The user triggers are off for the copy, on again after.
ALTER TABLE outbox_item_bodies DISABLE TRIGGER USER;
ALTER TABLE outbox_item_states DISABLE TRIGGER USER;
ALTER TABLE outbox_attempts DISABLE TRIGGER USER;
ALTER TABLE usage_event_keys DISABLE TRIGGER USER;
ALTER TABLE usage_events DISABLE TRIGGER USER;
ALTER TABLE usage_cancellations DISABLE TRIGGER USER;

-- The bodies first (every foreign key points at them), then the rest
-- co-located: a bucket's rows of every table are on one shard group.
-- 32 shards: 32 buckets each; a split divides a shard's buckets.
SELECT create_distributed_table('outbox_item_bodies', 'bucket', shard_count => 32);
SELECT create_distributed_table('outbox_item_states', 'bucket', colocate_with => 'outbox_item_bodies');
SELECT create_distributed_table('outbox_attempts', 'bucket', colocate_with => 'outbox_item_bodies');
SELECT create_distributed_table('usage_event_keys', 'bucket', colocate_with => 'outbox_item_bodies');
SELECT create_distributed_table('usage_events', 'bucket', colocate_with => 'outbox_item_bodies');
SELECT create_distributed_table('usage_cancellations', 'bucket', colocate_with => 'outbox_item_bodies');
SELECT create_distributed_table('completeness_counters', 'bucket', colocate_with => 'outbox_item_bodies');
SELECT create_distributed_table('completeness_items', 'bucket', colocate_with => 'outbox_item_bodies');

ALTER TABLE outbox_item_bodies ENABLE TRIGGER USER;
ALTER TABLE outbox_item_states ENABLE TRIGGER USER;
ALTER TABLE outbox_attempts ENABLE TRIGGER USER;
ALTER TABLE usage_event_keys ENABLE TRIGGER USER;
ALTER TABLE usage_events ENABLE TRIGGER USER;
ALTER TABLE usage_cancellations ENABLE TRIGGER USER;
COMMIT;

-- Everything else stays a local table on the coordinator: River, tokens,
-- sessions, audit, reconcile_*, stripe_events*, meter_error_evidence,
-- archives, usage_closed_months, report_snapshots, completeness_audits,
-- outbox_snapshots, outbox_gauge_settled.

-- ===== D. The coordinator's copy ==========================================
-- create_distributed_table leaves the rows it copied on the coordinator's
-- disk, invisible. truncate_local_data_after_distributing_table removes
-- them, and the no-truncate triggers refuse it (findings §5): they are off
-- for this one transaction, on the distributed tables and their shards,
-- and on again before it commits. The distributed rows are not touched.
BEGIN;
SET LOCAL citus.enable_unsafe_triggers = on;
DO $$
DECLARE
    t record;
BEGIN
    -- the no-truncate triggers of the distributed tables and their partitions, off for this transaction
    FOR t IN SELECT tg.tgrelid::regclass AS rel, tg.tgname FROM pg_trigger tg
             WHERE NOT tg.tgisinternal AND tg.tgname ~ '_no_truncate$'
               AND tg.tgrelid IN (SELECT logicalrelid FROM pg_dist_partition WHERE partmethod = 'h') LOOP
        EXECUTE format('ALTER TABLE %s DISABLE TRIGGER %I', t.rel, t.tgname);
    END LOOP;
    FOR t IN SELECT logicalrelid::regclass AS rel FROM pg_dist_partition
             WHERE partmethod = 'h' AND logicalrelid NOT IN (SELECT inhrelid FROM pg_inherits) LOOP
        PERFORM truncate_local_data_after_distributing_table(t.rel);
    END LOOP;
    FOR t IN SELECT tg.tgrelid::regclass AS rel, tg.tgname FROM pg_trigger tg
             WHERE NOT tg.tgisinternal AND tg.tgname ~ '_no_truncate$'
               AND tg.tgrelid IN (SELECT logicalrelid FROM pg_dist_partition WHERE partmethod = 'h') LOOP
        EXECUTE format('ALTER TABLE %s ENABLE TRIGGER %I', t.rel, t.tgname);
    END LOOP;
END $$;
COMMIT;
