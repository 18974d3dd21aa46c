-- The invoice gate: one row per draft subscription invoice Tally saw
-- being made, while it proves its period complete (every unit of the
-- period accepted by Stripe) and, when TALLY_INVOICE_HOLD is on, holds
-- the draft (auto_advance false) until it is, or until the hold's bound.
--
-- state: waiting (not proven complete, not held), held, complete (proven;
-- released if it was held), released (the hold ran out), lapsed (the
-- invoice finalized first). missing says, in words, what the period
-- lacks; finalizes_at is when Stripe was to finalize the draft when the
-- gate opened. Rows are never deleted; one per invoice, so it grows with
-- customers × months. On the coordinator of a distributed database.

-- +goose Up
CREATE TABLE invoice_gates (
    account          text        NOT NULL,
    invoice          text        NOT NULL,
    customer         text        NOT NULL,
    tenants          text[]      NOT NULL,
    period_start     timestamptz NOT NULL,
    period_end       timestamptz NOT NULL,
    finalizes_at     timestamptz,
    state            text        NOT NULL DEFAULT 'waiting',
    missing          text        NOT NULL DEFAULT '',
    opened_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    checked_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    incomplete_since timestamptz,
    incomplete       boolean     NOT NULL DEFAULT false,
    held_at          timestamptz,
    hold_until       timestamptz,
    released_at      timestamptz,
    release_reason   text,
    PRIMARY KEY (account, invoice),
    FOREIGN KEY (account, invoice) REFERENCES stripe_invoices (account, invoice),
    CONSTRAINT invoice_gates_state_check CHECK (state IN ('waiting', 'held', 'complete', 'released', 'lapsed')),
    CONSTRAINT invoice_gates_missing_check CHECK (length(missing) <= 300),
    CONSTRAINT invoice_gates_release_check CHECK (release_reason IS NULL OR release_reason IN ('complete', 'hold_max', 'finalized'))
);
CREATE INDEX invoice_gates_open ON invoice_gates (checked_at) WHERE state IN ('waiting', 'held');

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        GRANT SELECT, INSERT, UPDATE ON invoice_gates TO tally_runtime;
        REVOKE DELETE, TRUNCATE ON invoice_gates FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE invoice_gates;
