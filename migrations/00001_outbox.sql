-- The export outbox: one table and one state machine (docs/outbox.md). Nothing in Tally deletes a row of outbox_items or
-- outbox_attempts; triggers below refuse it at the database, too.

-- +goose Up

-- tally_utf8 is convert_to(t, 'UTF8') declared IMMUTABLE so that the
-- identifier can be a generated column. convert_to is only STABLE because it
-- looks encodings up by name; with the target fixed to UTF8 its result depends
-- on the database encoding alone, which never changes for a database.
-- +goose StatementBegin
CREATE FUNCTION tally_utf8(t text) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT convert_to(t, 'UTF8') $$;
-- +goose StatementEnd

CREATE TABLE outbox_items (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,

    -- The identity: unique in the database; the identifier is a pure function of it.
    tenant_key          text    NOT NULL,
    subject_kind        text    NOT NULL,
    subject_ref         text    NOT NULL,
    exporter            text    NOT NULL,
    destination_account text    NOT NULL,
    mode                text    NOT NULL,
    mapping_version     integer NOT NULL,

    -- "tly_" || sha256(tenant_key|subject_kind|subject_ref|exporter|destination_account|mode|mapping_version)
    identifier text NOT NULL GENERATED ALWAYS AS (
        'tly_' || encode(sha256(tally_utf8(
            tenant_key || '|' || subject_kind || '|' || subject_ref || '|' || exporter || '|' ||
            destination_account || '|' || mode || '|' || mapping_version::text)), 'hex')
    ) STORED,

    -- The financial intent: customer, event_name, value, timestamp, identifier,
    -- feature, period. Immutable (trigger below).
    payload             jsonb   NOT NULL,

    -- The ordering key of the per-key claim policy: destination account,
    -- Stripe customer and meter event name (one concurrent call per customer
    -- and meter at Stripe).
    ordering_key text NOT NULL GENERATED ALWAYS AS (
        destination_account || '|' || coalesce(payload ->> 'customer', '') || '|' ||
        coalesce(payload ->> 'event_name', '')
    ) STORED,

    state               text    NOT NULL,

    -- attempts counts claims (T1). refused_attempts counts the attempts known
    -- not to have reached the provider: refused by it, or never sent.
    -- attempts_base is where the current attempt budget started (an operator's
    -- recovery or requeue grants a fresh budget without moving attempts).
    attempts            integer NOT NULL DEFAULT 0,
    refused_attempts    integer NOT NULL DEFAULT 0,
    attempts_base       integer NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    first_attempt_at    timestamptz,

    -- The lease (liveness) and the fence (lease_token, correctness).
    lease_owner         text,
    leased_at           timestamptz,
    lease_expires_at    timestamptz,
    lease_token         bigint  NOT NULL DEFAULT 0,

    provider_ref        text,
    accepted_at         timestamptz,
    confirmed_at        timestamptz,

    -- Sanitised: a code, a status and at most 200 characters of message.
    last_error_code     text,
    last_error_status   integer,
    last_error          text,
    quarantine_reason   text,

    -- Set when an operator re-addressed a quarantined item under a new
    -- identity (T9r); the successor carries its usage from then on.
    superseded_by       bigint REFERENCES outbox_items (id),

    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),

    CONSTRAINT outbox_items_identity_key UNIQUE
        (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version),
    CONSTRAINT outbox_items_identifier_key UNIQUE (identifier),

    CONSTRAINT outbox_items_state_check CHECK (state IN
        ('pending', 'leased', 'accepted', 'confirmed', 'uncertain', 'rejected', 'quarantined', 'superseded')),
    CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
        ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch',
         'timestamp_window', 'meter_not_found', 'customer_not_found')),
    CONSTRAINT outbox_items_quarantined_has_reason CHECK
        (state NOT IN ('quarantined', 'superseded') OR quarantine_reason IS NOT NULL),
    CONSTRAINT outbox_items_reason_only_when_quarantined CHECK
        (quarantine_reason IS NULL OR state IN ('quarantined', 'superseded')),

    CONSTRAINT outbox_items_identity_check CHECK (
        tenant_key <> '' AND subject_kind ~ '^[a-z][a-z_]*$' AND subject_ref <> '' AND
        exporter ~ '^[a-z][a-z0-9_]*$' AND mode IN ('live', 'test') AND mapping_version >= 0 AND
        strpos(tenant_key, '|') = 0 AND strpos(subject_ref, '|') = 0 AND strpos(destination_account, '|') = 0),
    CONSTRAINT outbox_items_payload_check CHECK (
        jsonb_typeof(payload) = 'object' AND payload ->> 'identifier' = identifier AND
        jsonb_typeof(payload -> 'value') = 'number' AND jsonb_typeof(payload -> 'timestamp') = 'number'),

    CONSTRAINT outbox_items_attempts_check CHECK (
        attempts >= 0 AND refused_attempts BETWEEN 0 AND attempts AND attempts_base BETWEEN 0 AND attempts AND
        lease_token >= attempts AND (attempts = 0) = (first_attempt_at IS NULL)),
    CONSTRAINT outbox_items_lease_check CHECK (
        (state = 'leased') = (lease_expires_at IS NOT NULL) AND
        (state <> 'leased' OR (lease_owner IS NOT NULL AND leased_at IS NOT NULL AND lease_token > 0))),
    CONSTRAINT outbox_items_accepted_check CHECK (state NOT IN ('accepted', 'confirmed') OR accepted_at IS NOT NULL),
    CONSTRAINT outbox_items_confirmed_check CHECK ((state = 'confirmed') = (confirmed_at IS NOT NULL)),
    CONSTRAINT outbox_items_superseded_check CHECK ((state = 'superseded') = (superseded_by IS NOT NULL)),
    CONSTRAINT outbox_items_error_check CHECK (
        (last_error_code IS NULL OR last_error_code ~ '^[a-z0-9][a-z0-9_.:-]{0,63}$') AND
        (last_error_status IS NULL OR last_error_status BETWEEN 0 AND 999) AND
        (last_error IS NULL OR char_length(last_error) <= 200)),
    CONSTRAINT outbox_items_provider_ref_check CHECK (provider_ref IS NULL OR char_length(provider_ref) <= 255)
);

-- The due query (T1): pending and due, or leased with an expired lease.
CREATE INDEX outbox_items_pending_due ON outbox_items (next_attempt_at, id) WHERE state = 'pending';
CREATE INDEX outbox_items_leased_expiry ON outbox_items (lease_expires_at, id) WHERE state = 'leased';
-- The per-key policy: the next item of a key, and whether a key holds a lease.
CREATE INDEX outbox_items_pending_key ON outbox_items (ordering_key, next_attempt_at, id) WHERE state = 'pending';
CREATE INDEX outbox_items_leased_key ON outbox_items (ordering_key) WHERE state = 'leased';
-- The gauge: the oldest item not yet answered.
CREATE INDEX outbox_items_unanswered_created ON outbox_items (created_at) WHERE state IN ('pending', 'leased');

-- One row per attempt that has an outcome: written by the same statement as
-- the transition out of leased (T2-T6), by a claim that takes over an expired
-- lease (outcome "abandoned") and by the maintenance sweep. Its primary key
-- makes "one outcome per claim" a database fact.
CREATE TABLE outbox_attempts (
    item_id       bigint  NOT NULL REFERENCES outbox_items (id),
    lease_token   bigint  NOT NULL,
    lease_owner   text    NOT NULL,
    leased_at     timestamptz NOT NULL,
    outcome       text    NOT NULL,
    state_after   text    NOT NULL,
    refused       boolean NOT NULL,
    provider_ref  text,
    error_code    text,
    error_status  integer,
    error_message text,
    recorded_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (item_id, lease_token),
    CONSTRAINT outbox_attempts_outcome_check CHECK (outcome IN
        ('accepted', 'retry', 'rate_limited', 'uncertain', 'rejected', 'quarantined', 'abandoned')),
    CONSTRAINT outbox_attempts_error_check CHECK (
        (error_code IS NULL OR error_code ~ '^[a-z0-9][a-z0-9_.:-]{0,63}$') AND
        (error_message IS NULL OR char_length(error_message) <= 200))
);

-- The guards: defence in depth behind the conditional UPDATEs of package
-- outbox. They refuse deletes, changes to the identity or the payload, moving
-- first_attempt_at, counters going backwards, and any state change that is
-- not an edge of the machine. Each condition is a trigger WHEN clause, so the
-- happy path runs no PL/pgSQL at all; outbox_refuse only raises.
-- +goose StatementBegin
CREATE FUNCTION outbox_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        RAISE EXCEPTION '%: %', TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    ELSIF TG_OP = 'UPDATE' AND TG_TABLE_NAME = 'outbox_items' THEN
        RAISE EXCEPTION '%: % (outbox_items %: % -> %)', TG_TABLE_NAME, TG_ARGV[0], OLD.id, OLD.state, NEW.state
            USING ERRCODE = 'restrict_violation';
    ELSE
        RAISE EXCEPTION '%: %', TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    END IF;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_items_no_delete BEFORE DELETE ON outbox_items
    FOR EACH ROW EXECUTE FUNCTION outbox_refuse('rows are never deleted');
CREATE TRIGGER outbox_items_no_truncate BEFORE TRUNCATE ON outbox_items
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_refuse('rows are never deleted');

CREATE TRIGGER outbox_items_immutable BEFORE UPDATE ON outbox_items
    FOR EACH ROW WHEN (
        (NEW.tenant_key, NEW.subject_kind, NEW.subject_ref, NEW.exporter, NEW.destination_account, NEW.mode,
         NEW.mapping_version, NEW.payload, NEW.created_at)
        IS DISTINCT FROM
        (OLD.tenant_key, OLD.subject_kind, OLD.subject_ref, OLD.exporter, OLD.destination_account, OLD.mode,
         OLD.mapping_version, OLD.payload, OLD.created_at))
    EXECUTE FUNCTION outbox_refuse('the identity and payload of an item are immutable');

CREATE TRIGGER outbox_items_first_attempt BEFORE UPDATE ON outbox_items
    FOR EACH ROW WHEN (OLD.first_attempt_at IS NOT NULL AND NEW.first_attempt_at IS DISTINCT FROM OLD.first_attempt_at)
    EXECUTE FUNCTION outbox_refuse('first_attempt_at never moves');

CREATE TRIGGER outbox_items_counters BEFORE UPDATE ON outbox_items
    FOR EACH ROW WHEN (NEW.attempts < OLD.attempts OR NEW.lease_token < OLD.lease_token
                       OR NEW.refused_attempts < OLD.refused_attempts OR NEW.attempts_base < OLD.attempts_base)
    EXECUTE FUNCTION outbox_refuse('counters never go backwards');

CREATE TRIGGER outbox_items_edges BEFORE UPDATE ON outbox_items
    FOR EACH ROW WHEN (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (
        ('pending', 'leased'),                                  -- T1
        ('leased', 'accepted'), ('leased', 'pending'),          -- T2, T3
        ('leased', 'uncertain'), ('leased', 'rejected'),        -- T4, T5
        ('leased', 'quarantined'),                              -- T6
        ('accepted', 'confirmed'),                              -- T7
        ('uncertain', 'accepted'), ('uncertain', 'pending'), ('uncertain', 'rejected'), -- T8
        ('quarantined', 'pending'), ('quarantined', 'superseded'),                      -- T9, T9r
        ('pending', 'uncertain')))                              -- T4 by the maintenance sweep
    EXECUTE FUNCTION outbox_refuse('not an edge of the state machine');

CREATE TRIGGER outbox_attempts_append_only BEFORE UPDATE OR DELETE ON outbox_attempts
    FOR EACH ROW EXECUTE FUNCTION outbox_refuse('append-only');
CREATE TRIGGER outbox_attempts_no_truncate BEFORE TRUNCATE ON outbox_attempts
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_refuse('append-only');

-- +goose Down
DROP TABLE outbox_attempts;
DROP TABLE outbox_items;
DROP FUNCTION outbox_refuse();
DROP FUNCTION tally_utf8(text);
