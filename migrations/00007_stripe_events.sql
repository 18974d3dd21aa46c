-- Stripe's meter error reports, received as thin events on
-- POST /v1/stripe/events: each event once (its id), and per failed event it
-- names, the evidence against the item with that identifier. Discrepancies
-- note which of their items Stripe reported as failed.

-- +goose Up
CREATE TABLE stripe_events (
    id          text PRIMARY KEY,
    type        text NOT NULL,
    livemode    boolean NOT NULL,
    created     timestamptz NOT NULL,
    received_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    meter       text,
    error_count bigint NOT NULL DEFAULT 0
);

CREATE TABLE meter_error_evidence (
    event_id    text NOT NULL REFERENCES stripe_events (id),
    identifier  text NOT NULL,
    -- The item with that identifier; NULL when Tally has none (another
    -- sender's event: Tally must be the only sender for its meters).
    item_id     bigint REFERENCES outbox_items (id),
    code        text NOT NULL,
    message     text,
    PRIMARY KEY (event_id, identifier, code),
    CONSTRAINT meter_error_evidence_message_check CHECK (message IS NULL OR char_length(message) <= 200)
);
CREATE INDEX meter_error_evidence_item ON meter_error_evidence (item_id) WHERE item_id IS NOT NULL;

ALTER TABLE reconcile_discrepancies ADD COLUMN reported_items bigint[] NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE reconcile_discrepancies DROP COLUMN reported_items;
DROP TABLE meter_error_evidence;
DROP TABLE stripe_events;
