-- A count meter counts events, not values: an event of a count feature whose
-- value is not 1 (a correction, a zero, a batch of units) cannot be billed
-- as posted, so it is quarantined as count_value rather than sent.

-- +goose Up
ALTER TABLE outbox_items DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_items ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch',
     'timestamp_window', 'meter_not_found', 'customer_not_found', 'count_value'));

-- +goose Down
ALTER TABLE outbox_items DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_items ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch',
     'timestamp_window', 'meter_not_found', 'customer_not_found'));
