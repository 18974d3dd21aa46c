-- What an invoice check's meter comes to in money: the lines' amounts as
-- Stripe billed them, and what the price bills for the period's expected
-- usage (package pricing), in the lines' currency; amount_note says why
-- an amount could not be computed, or what a reader should know of it.

-- +goose Up
ALTER TABLE invoice_checks
    ADD COLUMN currency        text   NOT NULL DEFAULT '',
    ADD COLUMN invoiced_amount bigint,
    ADD COLUMN expected_amount bigint,
    ADD COLUMN amount_note     text   NOT NULL DEFAULT '',
    ADD CONSTRAINT invoice_checks_amount_note_check CHECK (length(amount_note) <= 300);

-- +goose Down
ALTER TABLE invoice_checks DROP COLUMN amount_note, DROP COLUMN expected_amount, DROP COLUMN invoiced_amount, DROP COLUMN currency;
