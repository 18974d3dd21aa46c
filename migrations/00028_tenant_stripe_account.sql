-- A tenant's destination account (issue 19, part 1). A Stripe Connect
-- platform bills customers that live in its connected accounts: a tenant
-- mapping may name one, and that tenant's usage is exported to it with the
-- Stripe-Account header (https://docs.stripe.com/connect/authentication)
-- instead of to the node's own destination (STRIPE_ACCOUNT, else the key's
-- own account).
--
-- stripe_account is NULL for "the node's destination", else a connected
-- account's id (acct_…, at most 255 characters, as package mappings and
-- stripeapi.ValidAccount hold it). The mapping checks ask Stripe that the
-- platform's key may act for the account, and look the customer up in it.
-- The history keeps each version's, like invoice_grace.
--
-- A nullable column without a default rewrites nothing; its CHECK reads
-- each existing row once (every one NULL). tenant_mapping_versions is
-- append-only by trigger, but ADD COLUMN fires no row trigger.

-- +goose Up
ALTER TABLE tenant_mappings ADD COLUMN stripe_account text,
    ADD CONSTRAINT tenant_mappings_stripe_account_check
        CHECK (stripe_account IS NULL OR (stripe_account ~ '^acct_[A-Za-z0-9_]+$' AND length(stripe_account) <= 255));
ALTER TABLE tenant_mapping_versions ADD COLUMN stripe_account text,
    ADD CONSTRAINT tenant_mapping_versions_stripe_account_check
        CHECK (stripe_account IS NULL OR (stripe_account ~ '^acct_[A-Za-z0-9_]+$' AND length(stripe_account) <= 255));

-- +goose Down
ALTER TABLE tenant_mapping_versions DROP COLUMN stripe_account;
ALTER TABLE tenant_mappings DROP COLUMN stripe_account;
