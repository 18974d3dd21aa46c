-- A tenant's invoice finalization grace period. Stripe finalizes an
-- invoice of a subscription a grace period after its billing period ends:
-- 1 hour by default, up to 72 hours as the account's invoice settings say,
-- and their rules may give groups of invoices a grace of their own
-- (https://docs.stripe.com/billing/subscriptions/usage-based/configure-grace-period).
-- Usage for the ended period can be reported until then, not after. The
-- node's setting, TALLY_INVOICE_GRACE, is the default; a tenant mapping may
-- override it.
--
-- invoice_grace is NULL for "the node's TALLY_INVOICE_GRACE", else the
-- tenant's own grace, from 0 to Stripe's largest, 72 hours. Package mappings
-- also holds it to whole seconds. The history keeps each version's, like
-- period_anchor.
--
-- A nullable column without a default rewrites nothing; its CHECK reads
-- each existing row once (every one NULL). tenant_mapping_versions is
-- append-only by trigger, but ADD COLUMN fires no row trigger.

-- +goose Up
ALTER TABLE tenant_mappings ADD COLUMN invoice_grace interval,
    ADD CONSTRAINT tenant_mappings_invoice_grace_check
        CHECK (invoice_grace IS NULL OR invoice_grace BETWEEN interval '0' AND interval '72 hours');
ALTER TABLE tenant_mapping_versions ADD COLUMN invoice_grace interval,
    ADD CONSTRAINT tenant_mapping_versions_invoice_grace_check
        CHECK (invoice_grace IS NULL OR invoice_grace BETWEEN interval '0' AND interval '72 hours');

-- +goose Down
ALTER TABLE tenant_mapping_versions DROP COLUMN invoice_grace;
ALTER TABLE tenant_mappings DROP COLUMN invoice_grace;
