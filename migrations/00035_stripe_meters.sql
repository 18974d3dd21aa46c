-- Meters by id. Stripe routes a meter event to the one active meter of its
-- event name, and an event name may move to a new meter once the old one is
-- deactivated; a deactivated meter keeps its summaries. So:
--
-- stripe_meters is Tally's copy of each destination account's meters, read
-- from Stripe (the meter list, re-read hourly and whenever a
-- billing.meter.* event arrives): which meter an event name resolves to,
-- and which event names have only deactivated meters, whose items wait
-- pending until a meter of that name is active again. One row per meter;
-- rows are updated, never deleted (a meter Stripe no longer lists keeps
-- its last known status).
--
-- outbox_item_states.meter is the id of the meter an item was accepted
-- for, as the directory resolved its event name when the answer was
-- recorded; reconciliation reads that meter's summaries. NULL for items
-- accepted before this column, or while the directory did not know the
-- account's meters: those are compared with the active meter of their
-- event name, as before.
--
-- A nullable column without a default rewrites nothing.

-- +goose Up
CREATE TABLE stripe_meters (
    account     text NOT NULL,
    mode        text NOT NULL,
    id          text NOT NULL,
    event_name  text NOT NULL,
    status      text NOT NULL,
    formula     text NOT NULL,
    -- When Tally last read the meter from Stripe, and when it last saw its
    -- status change (both by the database's clock).
    seen_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    changed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account, mode, id),
    CONSTRAINT stripe_meters_status_check CHECK (status IN ('active', 'inactive')),
    CONSTRAINT stripe_meters_mode_check CHECK (mode IN ('live', 'test')),
    CONSTRAINT stripe_meters_formula_check CHECK (formula IN ('sum', 'count', 'last'))
);
CREATE INDEX stripe_meters_event_name ON stripe_meters (account, mode, event_name);

ALTER TABLE outbox_item_states ADD COLUMN meter text;

-- +goose Down
ALTER TABLE outbox_item_states DROP COLUMN meter;
DROP TABLE stripe_meters;
