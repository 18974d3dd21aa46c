-- The web console: sign-in sessions (the cookie holds a random id; only its
-- SHA-256 is stored) and the outbox snapshots its charts draw, one per
-- five minutes at most, written by the maintenance pass.

-- +goose Up
CREATE TABLE console_sessions (
    id_hash     bytea PRIMARY KEY,
    token_id    bigint NOT NULL REFERENCES api_tokens (id),
    csrf        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at  timestamptz NOT NULL
);

CREATE TABLE outbox_snapshots (
    at       timestamptz NOT NULL,
    state    text NOT NULL,
    items    bigint NOT NULL,
    -- Outcomes recorded since the previous snapshot, by the attempt log.
    PRIMARY KEY (at, state)
);

-- +goose Down
DROP TABLE outbox_snapshots;
DROP TABLE console_sessions;
