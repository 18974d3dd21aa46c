-- Discrepancies with a lifecycle (docs/operations.md, "Resolving a
-- discrepancy").
--
-- A discrepancy gets an id, so that finance can name it, and may be
-- resolved: reconcile_resolutions keeps finance's decision about the
-- numbers of one hour of one key (customer, meter) — which discrepancy it
-- was made on, its reason from a fixed set, a note, who and when, and the
-- accepted items it settled (confirmed, T7, in the same transaction). A
-- resolution covers every discrepancy of that hour with the same reason,
-- Tally's value and Stripe's (of any run, before or after it): a later run
-- that finds those numbers again does not record them; numbers that change
-- again are a new discrepancy. Resolutions are a record, like the audit
-- log: never updated, never deleted.

-- +goose Up
ALTER TABLE reconcile_discrepancies ADD COLUMN id bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE reconcile_discrepancies ADD CONSTRAINT reconcile_discrepancies_id_key UNIQUE (id);

CREATE TABLE reconcile_resolutions (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The discrepancy finance resolved; the key, hour, reason and numbers
    -- are its own, copied so that the resolution matches findings of other
    -- runs.
    discrepancy_id      bigint  NOT NULL REFERENCES reconcile_discrepancies (id),
    destination_account text    NOT NULL,
    mode                text    NOT NULL,
    event_name          text    NOT NULL,
    customer            text    NOT NULL,
    hour                timestamptz NOT NULL,
    reason              text    NOT NULL,
    expected            numeric NOT NULL,
    provider            numeric,
    resolution          text    NOT NULL,
    note                text    NOT NULL,
    resolved_by         text    NOT NULL,
    resolved_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The accepted items the resolution confirmed (T7).
    settled_items       bigint[] NOT NULL,
    CONSTRAINT reconcile_resolutions_resolution_check
        CHECK (resolution IN ('credited_in_stripe', 'reposted', 'accept_stripe', 'accept_tally')),
    CONSTRAINT reconcile_resolutions_text_check
        CHECK (note <> '' AND char_length(note) <= 200 AND resolved_by <> '')
);
-- One resolution per hour and numbers: a provider of none (NULL) and of
-- zero are different numbers.
CREATE UNIQUE INDEX reconcile_resolutions_numbers ON reconcile_resolutions
    (destination_account, mode, event_name, customer, hour, reason, expected, (provider IS NULL), coalesce(provider, 0));

-- +goose StatementBegin
CREATE FUNCTION reconcile_resolutions_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'reconcile_resolutions rows are never updated or deleted';
END
$$;
-- +goose StatementEnd
CREATE TRIGGER reconcile_resolutions_immutable BEFORE UPDATE OR DELETE ON reconcile_resolutions
    FOR EACH ROW EXECUTE FUNCTION reconcile_resolutions_immutable();

ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve'));

-- +goose Down
-- NOT VALID: the resolutions audited stay (the log is never edited).
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close')) NOT VALID;
DROP TRIGGER reconcile_resolutions_immutable ON reconcile_resolutions;
DROP FUNCTION reconcile_resolutions_immutable();
DROP TABLE reconcile_resolutions;
ALTER TABLE reconcile_discrepancies DROP CONSTRAINT reconcile_discrepancies_id_key;
ALTER TABLE reconcile_discrepancies DROP COLUMN id;
