-- Stripe as documented (docs/stripe.md).
--
-- New quarantine reasons:
--   value_digits      the value has more digits than Stripe accepts (15
--                     significant digits): never sent, never truncated;
--   payload_keys      Stripe found no customer (or value) under the payload
--                     keys the item carries: the meter's keys differ from the
--                     mapping's, which setting the mapping again cures;
--   provider_refused  Stripe refused the item with an answer Tally does not
--                     recognise: a human looks before anything is decided.
--
-- A meter error report that names an item still in flight (pending, leased
-- or uncertain) is noted on the item (reported_*), so that the accept
-- recorded for it afterwards (T2) lands where the report says instead of in
-- accepted, where nothing would ever look at it again. The note is the
-- report's verdict (to_state and reason, as exporter.ClassifyReport made
-- them) and its error, sanitised; T2 and T9 clear it.

-- +goose Up
ALTER TABLE outbox_items DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_items ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch',
     'timestamp_window', 'meter_not_found', 'customer_not_found', 'count_value',
     'value_digits', 'payload_keys', 'provider_refused'));

ALTER TABLE outbox_items
    ADD COLUMN reported_state   text,
    ADD COLUMN reported_reason  text,
    ADD COLUMN reported_code    text,
    ADD COLUMN reported_message text,
    ADD CONSTRAINT outbox_items_reported_check CHECK (
        (reported_state IS NULL AND reported_reason IS NULL)
        OR (reported_state = 'rejected' AND reported_reason IS NULL)
        OR (reported_state = 'quarantined' AND reported_reason IS NOT NULL));

-- +goose Down
ALTER TABLE outbox_items DROP CONSTRAINT outbox_items_reported_check;
ALTER TABLE outbox_items DROP COLUMN reported_state, DROP COLUMN reported_reason,
    DROP COLUMN reported_code, DROP COLUMN reported_message;
ALTER TABLE outbox_items DROP CONSTRAINT outbox_items_quarantine_reason_check;
ALTER TABLE outbox_items ADD CONSTRAINT outbox_items_quarantine_reason_check CHECK (quarantine_reason IS NULL OR quarantine_reason IN
    ('feature_unmapped', 'no_customer', 'no_account', 'account_mismatch', 'mode_mismatch',
     'timestamp_window', 'meter_not_found', 'customer_not_found', 'count_value'));
