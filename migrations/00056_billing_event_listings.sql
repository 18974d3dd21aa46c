-- Where the listing of each account's subscription and invoice events
-- (GET /v1/events) has reached: the database's clock when its last
-- listing began. The next lists from an hour before it, so that an event
-- listable only late is still seen. One row per account; on the
-- coordinator of a distributed database.

-- +goose Up
CREATE TABLE billing_event_listings (
    account   text        PRIMARY KEY,
    listed_to timestamptz NOT NULL,
    events    integer     NOT NULL DEFAULT 0,
    error     text,
    CONSTRAINT billing_event_listings_error_check CHECK (length(error) <= 300)
);

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        GRANT SELECT, INSERT, UPDATE ON billing_event_listings TO tally_runtime;
        REVOKE DELETE, TRUNCATE ON billing_event_listings FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE billing_event_listings;
