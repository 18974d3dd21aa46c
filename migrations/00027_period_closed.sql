-- Usage after the invoice (issue 19): an item staged after its billing
-- period's invoice closed — the period's end plus the invoice grace
-- (TALLY_INVOICE_GRACE, or the tenant mapping's invoice_grace, migration
-- 26) — is quarantined period_closed under TALLY_LATE_USAGE=quarantine, the
-- default: Stripe would record it and bill it on no invoice. Its payload
-- carries "late": true either way (outbox.Payload.Late).
--
-- The reason joins the CHECK. The new constraint is added NOT VALID:
-- every existing row satisfied the old one, which admits a subset of the
-- new one's reasons, so nothing needs re-reading, and adding it takes no
-- scan of the state table (it is enforced on every row written from now).

-- +goose Up
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch', 'timestamp_window',
     'meter_not_found', 'customer_not_found', 'count_value', 'value_digits', 'payload_keys', 'provider_refused',
     'period_closed')) NOT VALID;

-- +goose Down
-- Refused while any item holds the reason (requeue or re-address them first).
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch', 'timestamp_window',
     'meter_not_found', 'customer_not_found', 'count_value', 'value_digits', 'payload_keys', 'provider_refused'));
