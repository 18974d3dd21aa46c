-- The outbox's hot path writes little (issue 17): an item's state, lease,
-- counters and outcome move to a narrow table of their own,
-- outbox_item_states, and what never changes after the insert — the
-- identity, the identifier, the payload and the ordering key — stays in
-- outbox_items, renamed outbox_item_bodies and never updated again.
--
-- Why: no transition of the wide row was a HOT update (state is in the
-- predicate of every partial index), so every claim and every accept
-- wrote a whole new ~600-byte tuple and an entry in every full index of
-- the wide table — the primary key, the identity (seven text columns), the
-- identifier and the reconciler's key_time — besides the partial indexes
-- the new state enters. A state row is ~200 bytes and its table has no
-- index on the identity, the identifier or the payload (docs/performance.md,
-- "Outbox hot path").
--
-- outbox_item_states keeps copies of the immutable columns its partial
-- indexes lead with or filter on (exporter, mode, ordering_key,
-- created_at); a trigger refuses any change to them. Every CHECK of the
-- state machine moves with the columns it constrains, every guard trigger
-- (edges, counters, first_attempt_at, no delete) with the state; a
-- trigger refuses any UPDATE of a body.
--
-- Readers keep reading outbox_items: it is now a view of the two tables
-- joined by id, with the columns of the old table in their old order. It
-- reads the state table and LEFT JOINs the bodies (every state row has its
-- body: a foreign key; every body its state row: package outbox inserts
-- both in one statement), so that a query reading state columns alone —
-- counts and lists by state, the console's, the tests' — does not read the
-- bodies at all (the planner removes a left join to a unique key it does
-- not use); the immutable columns both tables hold (exporter, mode,
-- ordering_key, created_at) come from the state row. Only package outbox
-- writes the two tables.
--
-- The columns dropped from the bodies take no space in rows inserted from
-- now on; the rows of before keep their bytes until rewritten (VACUUM FULL
-- outbox_item_bodies reclaims them; nothing requires it).
--
-- The migration rewrites every item in one transaction: 66 s for a
-- million pending items on the 2-core CI kind of machine under load, the
-- outbox locked meanwhile (docs/running.md, "Migrations and upgrades").
--
-- The foreign keys that referenced outbox_items (usage_events.item_id,
-- outbox_attempts.item_id, meter_error_evidence.item_id) follow the rename
-- to the bodies: their checks share-lock a row nothing updates, so staging
-- and evidence never wait on a claim or an accept.

-- +goose Up
ALTER TABLE outbox_items RENAME TO outbox_item_bodies;

DROP TRIGGER outbox_items_counters ON outbox_item_bodies;
DROP TRIGGER outbox_items_edges ON outbox_item_bodies;
DROP TRIGGER outbox_items_first_attempt ON outbox_item_bodies;
DROP TRIGGER outbox_items_immutable ON outbox_item_bodies;
DROP TRIGGER outbox_items_notify_insert ON outbox_item_bodies;
DROP TRIGGER outbox_items_notify_pending ON outbox_item_bodies;

CREATE TABLE outbox_item_states (
    id                  bigint  PRIMARY KEY REFERENCES outbox_item_bodies (id),

    -- Copies of the body's, for the partial indexes below. Immutable.
    exporter            text    NOT NULL,
    mode                text    NOT NULL,
    ordering_key        text    NOT NULL,

    state               text    NOT NULL,
    attempts            integer NOT NULL DEFAULT 0,
    refused_attempts    integer NOT NULL DEFAULT 0,
    attempts_base       integer NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    first_attempt_at    timestamptz,
    lease_owner         text,
    leased_at           timestamptz,
    lease_expires_at    timestamptz,
    lease_token         bigint  NOT NULL DEFAULT 0,
    provider_ref        text,
    accepted_at         timestamptz,
    confirmed_at        timestamptz,
    last_error_code     text,
    last_error_status   integer,
    last_error          text,
    quarantine_reason   text,
    superseded_by       bigint  REFERENCES outbox_item_bodies (id),
    reported_state      text,
    reported_reason     text,
    reported_code       text,
    reported_message    text,

    -- A copy of the body's. Immutable.
    created_at          timestamptz NOT NULL,
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),

    CONSTRAINT outbox_items_state_check CHECK (state IN
        ('pending', 'leased', 'accepted', 'confirmed', 'uncertain', 'rejected', 'quarantined', 'superseded')),
    CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
        ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch', 'timestamp_window',
         'meter_not_found', 'customer_not_found', 'count_value', 'value_digits', 'payload_keys', 'provider_refused')),
    CONSTRAINT outbox_items_quarantined_has_reason CHECK
        (state NOT IN ('quarantined', 'superseded') OR quarantine_reason IS NOT NULL),
    CONSTRAINT outbox_items_reason_only_when_quarantined CHECK
        (quarantine_reason IS NULL OR state IN ('quarantined', 'superseded')),
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
    CONSTRAINT outbox_items_provider_ref_check CHECK (provider_ref IS NULL OR char_length(provider_ref) <= 255),
    CONSTRAINT outbox_items_reported_check CHECK (
        (reported_state IS NULL AND reported_reason IS NULL) OR
        (reported_state = 'rejected' AND reported_reason IS NULL) OR
        (reported_state = 'quarantined' AND reported_reason IS NOT NULL))
);

INSERT INTO outbox_item_states
    (id, exporter, mode, ordering_key, state, attempts, refused_attempts, attempts_base, next_attempt_at,
     first_attempt_at, lease_owner, leased_at, lease_expires_at, lease_token, provider_ref, accepted_at,
     confirmed_at, last_error_code, last_error_status, last_error, quarantine_reason, superseded_by,
     reported_state, reported_reason, reported_code, reported_message, created_at, updated_at)
SELECT id, exporter, mode, ordering_key, state, attempts, refused_attempts, attempts_base, next_attempt_at,
       first_attempt_at, lease_owner, leased_at, lease_expires_at, lease_token, provider_ref, accepted_at,
       confirmed_at, last_error_code, last_error_status, last_error, quarantine_reason, superseded_by,
       reported_state, reported_reason, reported_code, reported_message, created_at, updated_at
FROM outbox_item_bodies ORDER BY id;

-- Drops, with the columns, the partial indexes, CHECKs and the
-- superseded_by foreign key they carried on the wide table.
ALTER TABLE outbox_item_bodies
    DROP COLUMN state, DROP COLUMN attempts, DROP COLUMN refused_attempts, DROP COLUMN attempts_base,
    DROP COLUMN next_attempt_at, DROP COLUMN first_attempt_at, DROP COLUMN lease_owner, DROP COLUMN leased_at,
    DROP COLUMN lease_expires_at, DROP COLUMN lease_token, DROP COLUMN provider_ref, DROP COLUMN accepted_at,
    DROP COLUMN confirmed_at, DROP COLUMN last_error_code, DROP COLUMN last_error_status, DROP COLUMN last_error,
    DROP COLUMN quarantine_reason, DROP COLUMN superseded_by, DROP COLUMN reported_state,
    DROP COLUMN reported_reason, DROP COLUMN reported_code, DROP COLUMN reported_message, DROP COLUMN updated_at;

-- The claim (T1): pending and due, or leased with an expired lease; the
-- stream's pending items apart (migration 11). Leased items are few (those
-- in flight), so no index is kept for the stream's alone, and none of the
-- indexes a claim or an accept enters serves the gauge alone: a claim
-- writes entries in the primary key, leased_expiry and leased_key; an
-- accept in the primary key and accepted_key.
CREATE INDEX outbox_item_states_pending_due ON outbox_item_states (next_attempt_at, id) WHERE state = 'pending';
CREATE INDEX outbox_item_states_leased_expiry ON outbox_item_states (lease_expires_at, id) WHERE state = 'leased';
CREATE INDEX outbox_item_states_stream_pending_due ON outbox_item_states (next_attempt_at, id)
    WHERE state = 'pending' AND exporter = 'stripe_meter_event_stream';
-- The per-key policy: the next item of a key, and whether a key holds a lease.
CREATE INDEX outbox_item_states_pending_key ON outbox_item_states (ordering_key, next_attempt_at, id)
    WHERE state = 'pending';
CREATE INDEX outbox_item_states_leased_key ON outbox_item_states (ordering_key) WHERE state = 'leased';
-- The gauge: the oldest pending item (the oldest leased one is found among
-- the few leased items), and a count of each state but confirmed
-- (migration 22).
CREATE INDEX outbox_item_states_pending_created ON outbox_item_states (created_at) WHERE state = 'pending';
CREATE INDEX outbox_item_states_quarantined ON outbox_item_states (id) WHERE state = 'quarantined';
CREATE INDEX outbox_item_states_uncertain ON outbox_item_states (id) WHERE state = 'uncertain';
CREATE INDEX outbox_item_states_rejected ON outbox_item_states (id) WHERE state = 'rejected';
CREATE INDEX outbox_item_states_superseded_by ON outbox_item_states (superseded_by) WHERE superseded_by IS NOT NULL;
-- Reconciliation: the accepted items of a key.
CREATE INDEX outbox_item_states_accepted_key ON outbox_item_states (ordering_key, mode, accepted_at)
    WHERE state = 'accepted';
-- Sustained retries (migration 20).
CREATE INDEX outbox_item_states_retrying ON outbox_item_states (first_attempt_at)
    WHERE (state = 'pending' AND attempts > attempts_base) OR (state = 'leased' AND attempts > attempts_base + 1);

-- The guards (migration 1, 10), now on the state table.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
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
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_item_bodies_immutable BEFORE UPDATE ON outbox_item_bodies
    FOR EACH ROW EXECUTE FUNCTION outbox_refuse('the identity and payload of an item are immutable');

CREATE TRIGGER outbox_item_states_no_delete BEFORE DELETE ON outbox_item_states
    FOR EACH ROW EXECUTE FUNCTION outbox_refuse('rows are never deleted');
CREATE TRIGGER outbox_item_states_no_truncate BEFORE TRUNCATE ON outbox_item_states
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_refuse('rows are never deleted');
CREATE TRIGGER outbox_item_states_immutable BEFORE UPDATE ON outbox_item_states
    FOR EACH ROW WHEN ((NEW.id, NEW.exporter, NEW.mode, NEW.ordering_key, NEW.created_at)
                       IS DISTINCT FROM (OLD.id, OLD.exporter, OLD.mode, OLD.ordering_key, OLD.created_at))
    EXECUTE FUNCTION outbox_refuse('the identity and payload of an item are immutable');
CREATE TRIGGER outbox_item_states_first_attempt BEFORE UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (OLD.first_attempt_at IS NOT NULL AND NEW.first_attempt_at IS DISTINCT FROM OLD.first_attempt_at)
    EXECUTE FUNCTION outbox_refuse('first_attempt_at never moves');
CREATE TRIGGER outbox_item_states_counters BEFORE UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (NEW.attempts < OLD.attempts OR NEW.lease_token < OLD.lease_token
                       OR NEW.refused_attempts < OLD.refused_attempts OR NEW.attempts_base < OLD.attempts_base)
    EXECUTE FUNCTION outbox_refuse('counters never go backwards');
CREATE TRIGGER outbox_item_states_edges BEFORE UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (
        ('pending', 'leased'),                                  -- T1
        ('leased', 'accepted'), ('leased', 'pending'),          -- T2, T3
        ('leased', 'uncertain'), ('leased', 'rejected'),        -- T4, T5
        ('leased', 'quarantined'),                              -- T6
        ('accepted', 'confirmed'),                              -- T7
        ('uncertain', 'accepted'), ('uncertain', 'pending'), ('uncertain', 'rejected'), -- T8
        ('quarantined', 'pending'), ('quarantined', 'superseded'),                      -- T9, T9r
        ('pending', 'uncertain'),                               -- T4 by the maintenance sweep
        ('accepted', 'quarantined'), ('accepted', 'rejected'))) -- T10
    EXECUTE FUNCTION outbox_refuse('not an edge of the state machine');

-- Deliverers wait on LISTEN tally_outbox (migration 4).
CREATE TRIGGER outbox_item_states_notify_insert AFTER INSERT ON outbox_item_states
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
CREATE TRIGGER outbox_item_states_notify_pending AFTER UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state IN ('quarantined', 'uncertain'))
    EXECUTE FUNCTION outbox_notify();

-- The ledger's links to the item that carries its usage (migration 2) read
-- superseded_by, a state column: from the state table, not the view.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION tally_live_item(item bigint) RETURNS bigint LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH RECURSIVE chain (id, next, depth) AS (
        SELECT id, superseded_by, 0 FROM outbox_item_states WHERE id = item
        UNION ALL
        SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.id = c.next
        WHERE c.depth < 1000
    )
    SELECT id FROM chain WHERE next IS NULL
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION tally_root_item(item bigint) RETURNS bigint LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH RECURSIVE chain (id, depth) AS (
        SELECT item, 0
        UNION ALL
        SELECT o.id, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.superseded_by = c.id WHERE c.depth < 1000
    )
    SELECT id FROM chain ORDER BY depth DESC LIMIT 1
$$;
-- +goose StatementEnd

CREATE VIEW outbox_items AS
SELECT s.id, b.tenant_key, b.subject_kind, b.subject_ref, s.exporter, b.destination_account, s.mode,
       b.mapping_version, b.identifier, b.payload, s.ordering_key,
       s.state, s.attempts, s.refused_attempts, s.attempts_base, s.next_attempt_at, s.first_attempt_at,
       s.lease_owner, s.leased_at, s.lease_expires_at, s.lease_token, s.provider_ref, s.accepted_at,
       s.confirmed_at, s.last_error_code, s.last_error_status, s.last_error, s.quarantine_reason,
       s.superseded_by, s.created_at, s.updated_at,
       s.reported_state, s.reported_reason, s.reported_code, s.reported_message
FROM outbox_item_states s
LEFT JOIN outbox_item_bodies b ON b.id = s.id;

ANALYZE outbox_item_states;

-- +goose Down
-- Not reversible in place: the wide table's CHECKs, indexes and triggers of
-- migrations 1-22 would have to be rebuilt around data written since. Down
-- migrations are for development only (package migrations): rebuild the
-- database from empty instead.
-- +goose StatementBegin
DO $$ BEGIN
    RAISE EXCEPTION 'migration 23 (outbox_item_states) is not reversible: rebuild the database from empty';
END $$;
-- +goose StatementEnd
