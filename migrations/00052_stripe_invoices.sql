-- The invoices of the tenants' customers, as Stripe last gave them: read
-- when an invoice.* event arrives and by the listing, kept to compare what
-- each invoice bills with the usage of its period.
--
-- stripe_invoices: one row per account ('' is the node's destination, as
-- tenant mappings name it) and invoice, updated at each read.
-- stripe_invoice_lines: one row per line; a line a later read no longer
-- lists gets gone_at. Rows are never deleted.
--
-- Both grow with the customers and the months (a line per metered item a
-- month), never with usage. They stay on the coordinator of a distributed
-- database: nothing joins them with the ledger in SQL.

-- +goose Up
CREATE TABLE stripe_invoices (
    account        text        NOT NULL,
    invoice        text        NOT NULL,
    customer       text        NOT NULL,
    subscription   text,
    status         text        NOT NULL,
    billing_reason text        NOT NULL,
    auto_advance   boolean     NOT NULL,
    finalizes_at   timestamptz,
    created        timestamptz NOT NULL,
    finalized_at   timestamptz,
    currency       text        NOT NULL,
    read_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account, invoice)
);
CREATE INDEX stripe_invoices_customer ON stripe_invoices (account, customer, created);

CREATE TABLE stripe_invoice_lines (
    account           text        NOT NULL,
    invoice           text        NOT NULL,
    line              text        NOT NULL,
    subscription_item text,
    proration         boolean     NOT NULL,
    price             text,
    period_start      timestamptz NOT NULL,
    period_end        timestamptz NOT NULL,
    quantity          bigint      NOT NULL,
    amount            bigint      NOT NULL,
    currency          text        NOT NULL,
    gone_at           timestamptz,
    PRIMARY KEY (account, invoice, line),
    FOREIGN KEY (account, invoice) REFERENCES stripe_invoices (account, invoice)
);

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        GRANT SELECT, INSERT, UPDATE ON stripe_invoices, stripe_invoice_lines TO tally_runtime;
        REVOKE DELETE, TRUNCATE ON stripe_invoices, stripe_invoice_lines FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE stripe_invoice_lines;
DROP TABLE stripe_invoices;
