-- The names of the Stripe customers tenants are mapped to, as Stripe last
-- answered them: the console shows a tenant's customer by name without
-- asking Stripe while it draws a page. One row per Stripe account and
-- customer id (account '' is the node's own destination); name is NULL
-- when Stripe has none (no name, a deleted or an unknown customer).
-- Saving a tenant mapping writes its row; a periodic job reads again the
-- rows older than a day. Nothing deletes a row: a customer no mapping
-- names any more keeps its last name, read by no page.

-- +goose Up
CREATE TABLE stripe_customer_names (
    account  text        NOT NULL,
    customer text        NOT NULL,
    name     text,
    read_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account, customer)
);

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        GRANT SELECT, INSERT, UPDATE ON stripe_customer_names TO tally_runtime;
        REVOKE DELETE, TRUNCATE ON stripe_customer_names FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE stripe_customer_names;
