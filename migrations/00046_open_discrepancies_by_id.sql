-- The console's list of open discrepancies across runs reads them newest
-- first, a page at a time, keyed by id (reconcile.ListOpen): this index
-- walks the current discrepancies (not cleared by a later run) by id, as
-- reconcile_discrepancies_current walks them by key and hour. It holds the
-- same rows, so it grows with the current discrepancies, never with the
-- cleared history.
--
-- Built in the migration's transaction: the table holds a row per
-- discrepant hour, small beside the ledger.

-- +goose Up
CREATE INDEX reconcile_discrepancies_current_id ON reconcile_discrepancies (id) WHERE cleared_by_run IS NULL;

-- +goose Down
DROP INDEX reconcile_discrepancies_current_id;
