-- A key Stripe refuses to give summaries for (docs/reconciliation.md).
--
-- A reconcile run that reads a key's hourly summaries and is answered a 4xx
-- about that key (400 or 404 for a customer Stripe does not know, a deleted
-- customer, a meter Stripe no longer has; anything but 401, 403 and 429)
-- records the key as a discrepancy of its own and goes on to the next key,
-- instead of failing the run at that key forever.
--
-- reason says which kind a discrepancy is:
--   mismatch           an hour where Stripe's summary and what Tally holds
--                      differ (every discrepancy before this migration);
--   summaries_refused  Stripe refused the key's summaries: nothing of the
--                      key was compared. hour is the first hour of the
--                      key's compared range; expected is what Tally holds
--                      over the range's comparable hours by the formula;
--                      provider and difference are NULL; expected_items and
--                      uncertain_items are the range's items as for an
--                      hour; explanation is 'not_compared'; error_code and
--                      error_status are Stripe's code (else its error type)
--                      and HTTP status, content-free.
-- The primary key stays unique: a run records a key's hours or its refusal,
-- never both, and the refusal at the first hour of the range.

-- +goose Up
ALTER TABLE reconcile_discrepancies
    ADD COLUMN reason       text NOT NULL DEFAULT 'mismatch',
    ADD COLUMN error_code   text,
    ADD COLUMN error_status integer,
    ADD CONSTRAINT reconcile_discrepancies_reason_check CHECK (reason IN ('mismatch', 'summaries_refused')),
    ADD CONSTRAINT reconcile_discrepancies_refused_check CHECK (
        (reason = 'mismatch' AND error_code IS NULL AND error_status IS NULL AND explanation <> 'not_compared')
        OR (reason = 'summaries_refused' AND error_code IS NOT NULL AND char_length(error_code) <= 64
            AND error_status IS NOT NULL AND error_status BETWEEN 400 AND 499 AND provider IS NULL AND difference IS NULL
            AND explanation = 'not_compared' AND explained_by = '{}'));
ALTER TABLE reconcile_discrepancies DROP CONSTRAINT reconcile_discrepancies_explanation_check;
ALTER TABLE reconcile_discrepancies ADD CONSTRAINT reconcile_discrepancies_explanation_check
    CHECK (explanation IN ('explained', 'ambiguous', 'unexplained', 'not_compared'));

-- +goose Down
-- Development only: the refusals cannot be kept without their columns.
DELETE FROM reconcile_discrepancies WHERE reason <> 'mismatch';
ALTER TABLE reconcile_discrepancies DROP CONSTRAINT reconcile_discrepancies_explanation_check;
ALTER TABLE reconcile_discrepancies ADD CONSTRAINT reconcile_discrepancies_explanation_check
    CHECK (explanation IN ('explained', 'ambiguous', 'unexplained'));
ALTER TABLE reconcile_discrepancies DROP CONSTRAINT reconcile_discrepancies_refused_check,
    DROP CONSTRAINT reconcile_discrepancies_reason_check,
    DROP COLUMN error_status, DROP COLUMN error_code, DROP COLUMN reason;
