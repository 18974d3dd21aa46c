-- The maintenance sweep can move only an item that has been attempted:
-- past the attempt cap, or past the horizon with an attempt that may have
-- reached the provider. Without an index of those alone it read every
-- pending item on every pass, the backlog never sent included. This index
-- holds the pending items with an attempt; a pending item enters it only
-- when a retry puts it back, so ingest and staging pay nothing for it.
--
-- Built in the migration's transaction, not CONCURRENTLY, for the reason
-- 00017 gives: the build reads the state table once and blocks its writes
-- meanwhile.

-- +goose Up
CREATE INDEX outbox_item_states_pending_attempted ON outbox_item_states (id)
    WHERE state = 'pending' AND attempts > 0;

-- +goose Down
DROP INDEX outbox_item_states_pending_attempted;
