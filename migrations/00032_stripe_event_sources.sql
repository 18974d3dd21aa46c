-- Stripe's events from every account Tally exports to, however they
-- arrive.
--
-- stripe_events records, besides each readable report, how the event first
-- arrived (arrival: destination, posted to /v1/stripe/events; listing, found
-- by the hourly listing of GET /v2/core/events) and the account it is about
-- (its context's account, else the node's destination), and its status:
--   recorded    read in full; its evidence is recorded (every row before);
--   foreign     about an account Tally does not export to: nothing to read;
--   unreadable  about an account Tally exports to, but Stripe refused to
--               let Tally read it (a 4xx): fetch_code and fetch_status say
--               how, and the listing fetches it again while Stripe keeps it
--               (30 days).
--
-- stripe_event_listings keeps, per account and mode, where the listing
-- resumes (the created time of the newest report it has seen) and when it
-- last succeeded.
--
-- The partial index on accepted items' provider_ref lets a report whose
-- sample names only a request's id (Request-Id) find the one v1 item of
-- that request; it holds accepted items only, the ones a report can move.
-- It is built in the migration's transaction, not CONCURRENTLY, for the
-- reason 00017 gives (one read of the state table).

-- +goose Up
ALTER TABLE stripe_events
    ADD COLUMN account      text,
    ADD COLUMN context      text,
    ADD COLUMN arrival      text NOT NULL DEFAULT 'destination',
    ADD COLUMN status       text NOT NULL DEFAULT 'recorded',
    ADD COLUMN read_at      timestamptz,
    ADD COLUMN fetch_code   text,
    ADD COLUMN fetch_status integer,
    ADD COLUMN fetch_tries  integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT stripe_events_arrival_check CHECK (arrival IN ('destination', 'listing')),
    ADD CONSTRAINT stripe_events_status_check CHECK (status IN ('recorded', 'foreign', 'unreadable')),
    ADD CONSTRAINT stripe_events_fetch_code_check CHECK (fetch_code IS NULL OR fetch_code ~ '^[a-z0-9][a-z0-9_.:-]{0,63}$');
UPDATE stripe_events SET read_at = received_at;

CREATE INDEX stripe_events_unreadable ON stripe_events (created) WHERE status = 'unreadable';
CREATE INDEX stripe_events_arrival ON stripe_events (arrival, received_at);

CREATE TABLE stripe_event_listings (
    account      text NOT NULL,
    mode         text NOT NULL CHECK (mode IN ('live', 'test')),
    -- The created time of the newest report the listing has seen; NULL
    -- until it has seen one.
    last_created timestamptz,
    listed_at    timestamptz,
    -- The last listing's failure, content-free; NULL once one succeeds.
    failed_at    timestamptz,
    fail_code    text,
    fail_status  integer,
    PRIMARY KEY (account, mode),
    CONSTRAINT stripe_event_listings_fail_code_check CHECK (fail_code IS NULL OR fail_code ~ '^[a-z0-9][a-z0-9_.:-]{0,63}$')
);

CREATE INDEX outbox_item_states_accepted_ref ON outbox_item_states (provider_ref) WHERE state = 'accepted';

-- +goose Down
DROP INDEX outbox_item_states_accepted_ref;
DROP TABLE stripe_event_listings;
DROP INDEX stripe_events_arrival;
DROP INDEX stripe_events_unreadable;
ALTER TABLE stripe_events DROP CONSTRAINT stripe_events_fetch_code_check, DROP CONSTRAINT stripe_events_status_check,
    DROP CONSTRAINT stripe_events_arrival_check,
    DROP COLUMN fetch_tries, DROP COLUMN fetch_status, DROP COLUMN fetch_code, DROP COLUMN read_at,
    DROP COLUMN status, DROP COLUMN arrival, DROP COLUMN context, DROP COLUMN account;
