-- Stalls are loud: the readings behind tally_ledger_unstaged_events,
-- tally_ledger_oldest_unstaged_age_seconds and tally_export_stalled, taken
-- at every scrape on every node, must stay cheap however long export has
-- been stalled.
--
-- The ledger backlog (meter.ReadBacklog) counts the unstaged rows and finds
-- the oldest one's received_at. While export is stalled nothing is staged
-- and the unstaged rows grow without bound. usage_events_unstaged (tenant,
-- feature, occurred_at) does not give the oldest received_at: min() over it,
-- or over usage_events_received (every row), reads every unstaged row or
-- every row staged before the first unstaged one. usage_events_unstaged_received
-- answers the oldest from its left edge and the (capped) count from its
-- narrow entries alone: 6-29 ms at a million unstaged rows. It holds the
-- unstaged rows only: empty while staging keeps up.
--
-- Sustained retries (outbox.Store.OldestRetrying) is the first attempt of
-- the item retrying longest. outbox_items_retrying holds the items pending
-- after a failed attempt (or leased again after one): empty while Stripe
-- accepts, so a claim of a fresh item never writes to it.
--
-- Not built CONCURRENTLY, for the reason 00017 gives: each build scans its
-- table once and blocks its writes meanwhile.

-- +goose Up
CREATE INDEX usage_events_unstaged_received ON usage_events (received_at) WHERE item_id IS NULL;
CREATE INDEX outbox_items_retrying ON outbox_items (first_attempt_at)
    WHERE (state = 'pending' AND attempts > attempts_base) OR (state = 'leased' AND attempts > attempts_base + 1);

-- +goose Down
DROP INDEX outbox_items_retrying;
DROP INDEX usage_events_unstaged_received;
