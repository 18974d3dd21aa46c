-- Cancellations (issue 19, part 2): a cancellation Stripe cannot apply is
-- kept as a quarantined item of its own (subject kind usage_cancellation),
-- for finance, never sent and never requeued:
--   cancel_too_late:   a count event Stripe received more than 24 hours
--                      ago, counted from its item's first attempt (the
--                      earliest Stripe can have received it), less a margin;
--   cancel_last_value: an event of a last feature's window Stripe may have:
--                      a meter's last value cannot be taken back.
--
-- The reasons join the CHECK, added NOT VALID as in migration 27: every
-- existing row satisfied the old one, so nothing is re-read.

-- +goose Up
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch', 'timestamp_window',
     'meter_not_found', 'customer_not_found', 'count_value', 'value_digits', 'payload_keys', 'provider_refused',
     'period_closed', 'cancel_too_late', 'cancel_last_value')) NOT VALID;

-- +goose Down
-- Refused while any item holds one of the reasons.
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch', 'timestamp_window',
     'meter_not_found', 'customer_not_found', 'count_value', 'value_digits', 'payload_keys', 'provider_refused',
     'period_closed'));
