-- Reconciliation: runs of the reconciler, the discrepancies each found, and
-- the indexes that find a key's accepted items and its items by hour.
-- Runs and discrepancies are records finance reads; nothing deletes them.

-- +goose Up
CREATE TABLE reconcile_runs (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status              text NOT NULL,
    trigger             text NOT NULL,
    -- Who asked: a token's name, "schedule" or "tally reconcile".
    requested_by        text NOT NULL,
    settle              interval NOT NULL,
    since               timestamptz,
    destination_account text,
    mode                text,
    -- The last ordering key finished: a run works through keys in order and
    -- commits each key's confirmations, discrepancies and this cursor
    -- together.
    cursor              text NOT NULL DEFAULT '',
    keys_total          integer NOT NULL DEFAULT 0,
    keys_done           integer NOT NULL DEFAULT 0,
    hours_compared      integer NOT NULL DEFAULT 0,
    hours_matched       integer NOT NULL DEFAULT 0,
    hours_skipped       integer NOT NULL DEFAULT 0,
    items_confirmed     bigint  NOT NULL DEFAULT 0,
    discrepancies       integer NOT NULL DEFAULT 0,
    stripe_calls        integer NOT NULL DEFAULT 0,
    error_code          text,
    error               text,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at          timestamptz,
    heartbeat_at        timestamptz,
    finished_at         timestamptz,
    CONSTRAINT reconcile_runs_status_check CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'interrupted')),
    CONSTRAINT reconcile_runs_trigger_check CHECK (trigger IN ('schedule', 'api', 'command')),
    CONSTRAINT reconcile_runs_error_check CHECK (error IS NULL OR char_length(error) <= 200),
    CONSTRAINT reconcile_runs_running_check CHECK (status <> 'running' OR (started_at IS NOT NULL AND heartbeat_at IS NOT NULL))
);
-- At most one run works at a time.
CREATE UNIQUE INDEX reconcile_runs_one_running ON reconcile_runs ((true)) WHERE status = 'running';

CREATE TABLE reconcile_discrepancies (
    run_id              bigint NOT NULL REFERENCES reconcile_runs (id),
    destination_account text   NOT NULL,
    mode                text   NOT NULL,
    event_name          text   NOT NULL,
    meter               text   NOT NULL,
    customer            text   NOT NULL,
    hour                timestamptz NOT NULL,
    formula             text   NOT NULL,
    -- What Tally holds as accepted or confirmed for the hour, by the formula,
    -- and what Stripe's summary says; provider is NULL for a last meter with
    -- no event in the hour.
    expected            numeric NOT NULL,
    provider            numeric,
    difference          numeric,
    expected_items      bigint[] NOT NULL,
    uncertain_items     bigint[] NOT NULL,
    -- The uncertain items whose landing would explain the difference exactly
    -- (explanation = 'explained'), or none: 'ambiguous' when several sets
    -- would, 'unexplained' when none does.
    explained_by        bigint[] NOT NULL,
    explanation         text   NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, destination_account, mode, event_name, customer, hour),
    CONSTRAINT reconcile_discrepancies_formula_check CHECK (formula IN ('sum', 'count', 'last')),
    CONSTRAINT reconcile_discrepancies_explanation_check CHECK (explanation IN ('explained', 'ambiguous', 'unexplained'))
);

-- The keys with accepted items, and a key's items by event time.
CREATE INDEX outbox_items_accepted_key ON outbox_items (ordering_key, mode, accepted_at) WHERE state = 'accepted';
CREATE INDEX outbox_items_key_time ON outbox_items (ordering_key, ((payload ->> 'timestamp')::bigint));

-- +goose Down
DROP INDEX outbox_items_key_time;
DROP INDEX outbox_items_accepted_key;
DROP TABLE reconcile_discrepancies;
DROP TABLE reconcile_runs;
