-- Reports answer from snapshots, not from the ledger per request.
--
-- report_snapshots keeps the latest computation of a report for one scope
-- (the completeness report of one month, every tenant): a request answers
-- from it while it is younger than TALLY_REPORT_MAX_AGE, and at most one
-- computation of a scope runs at a time across every node (an advisory
-- lock), however many reports are asked for. computed_at is the database's
-- clock just before the computation read the ledger: the snapshot holds
-- everything committed before it. A row is replaced by the next
-- computation of its scope; it is derived data, never a ledger or outbox
-- row.
--
-- outbox_items_quarantined lets the quarantine report and the quarantine
-- list read the quarantined items alone instead of every item ever made:
-- the list reads them in id order up to its limit.

-- +goose Up
CREATE TABLE report_snapshots (
    report      text        NOT NULL,
    scope       text        NOT NULL,
    body        jsonb       NOT NULL,
    computed_at timestamptz NOT NULL,
    took        interval    NOT NULL,
    PRIMARY KEY (report, scope),
    CONSTRAINT report_snapshots_report_check CHECK (report IN ('completeness'))
);

CREATE INDEX outbox_items_quarantined ON outbox_items (id) WHERE state = 'quarantined';

-- +goose Down
DROP INDEX outbox_items_quarantined;
DROP TABLE report_snapshots;
