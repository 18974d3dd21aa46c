-- What each finalized invoice bills, set beside the usage of its period.
--
-- stripe_prices: the prices invoice lines name, as Stripe gave them (a
-- price's amounts, tiers and transform never change once created), kept
-- to read a line's quantity and to price usage. One row per account and
-- price; grows with the catalogue, never with usage.
--
-- invoice_checks: one row per finalized invoice and meter event name the
-- customer's tenants use: the invoiced quantity (NULL when no line bills
-- the meter), the usage of the period that should be on it, the usage
-- that came after the invoice closed, and what differs. Compared again
-- while usage of the period can still arrive; finance resolves a row that
-- differs. Rows are never deleted. Grows with customers × meters × months.
--
-- Both stay on the coordinator of a distributed database: nothing joins
-- them with the ledger in SQL.

-- +goose Up
CREATE TABLE stripe_prices (
    account text        NOT NULL,
    price   text        NOT NULL,
    body    jsonb       NOT NULL,
    read_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account, price)
);

CREATE TABLE invoice_checks (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account           text        NOT NULL,
    invoice           text        NOT NULL,
    customer          text        NOT NULL,
    event_name        text        NOT NULL,
    formula           text        NOT NULL,
    period_start      timestamptz NOT NULL,
    period_end        timestamptz NOT NULL,
    tenants           text[]      NOT NULL,
    features          text[]      NOT NULL,
    lines             text[]      NOT NULL,
    prices            text[]      NOT NULL,
    invoiced          numeric,
    expected          numeric,
    unbilled          numeric     NOT NULL DEFAULT 0,
    status            text        NOT NULL,
    kinds             text[]      NOT NULL,
    reason            text        NOT NULL DEFAULT '',
    compared_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    resolution        text,
    resolution_note   text,
    resolved_by       text,
    resolved_at       timestamptz,
    UNIQUE (account, invoice, event_name),
    FOREIGN KEY (account, invoice) REFERENCES stripe_invoices (account, invoice),
    CONSTRAINT invoice_checks_status_check CHECK (status IN ('matches', 'differs', 'not_compared')),
    CONSTRAINT invoice_checks_kinds_check CHECK (kinds <@ ARRAY['invoiced_more', 'invoiced_less', 'used_not_invoiced']),
    CONSTRAINT invoice_checks_reason_check CHECK (length(reason) <= 300),
    CONSTRAINT invoice_checks_resolution_check CHECK (
        resolution IS NULL OR resolution IN ('credited_in_stripe', 'invoiced_separately', 'accept_stripe', 'accept_tally'))
);
CREATE INDEX invoice_checks_period ON invoice_checks (period_start);

-- When each invoice was last compared; the recompare job picks invoices
-- finalized lately by finalized_at.
ALTER TABLE stripe_invoices ADD COLUMN compared_at timestamptz;
CREATE INDEX stripe_invoices_finalized ON stripe_invoices (finalized_at) WHERE finalized_at IS NOT NULL;
CREATE INDEX invoice_checks_open ON invoice_checks (id) WHERE status = 'differs' AND resolved_at IS NULL;

ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach', 'completeness.repair', 'archive.write', 'archive.verify', 'archive.detach',
     'invoice.resolve', 'invoice.hold', 'invoice.release'));

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        GRANT SELECT, INSERT, UPDATE ON stripe_prices, invoice_checks TO tally_runtime;
        REVOKE DELETE, TRUNCATE ON stripe_prices, invoice_checks FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP INDEX stripe_invoices_finalized;
ALTER TABLE stripe_invoices DROP COLUMN compared_at;
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach', 'completeness.repair', 'archive.write', 'archive.verify', 'archive.detach')) NOT VALID;
DROP TABLE invoice_checks;
DROP TABLE stripe_prices;
