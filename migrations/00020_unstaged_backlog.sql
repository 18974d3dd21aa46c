-- The ledger backlog's metrics (meter.ReadBacklog, read at every scrape on
-- every node) count the unstaged rows and find the oldest one's received_at.
-- While export is stalled nothing is staged and the unstaged rows grow
-- without bound. usage_events_unstaged (tenant, feature, occurred_at) serves
-- the count but not the oldest received_at: min(received_at) over it, or
-- over usage_events_received (every row), reads every unstaged row or every
-- row staged before the first unstaged one. This partial index answers the
-- oldest from its left edge and the count from its narrow entries alone.
-- It holds the unstaged rows only: empty while staging keeps up, and a row
-- leaves it when staging marks it.
--
-- Not built CONCURRENTLY, for the reason 00017 gives: the build scans the
-- ledger once and blocks its writes meanwhile.

-- +goose Up
CREATE INDEX usage_events_unstaged_received ON usage_events (received_at) WHERE item_id IS NULL;

-- +goose Down
DROP INDEX usage_events_unstaged_received;
