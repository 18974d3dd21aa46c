-- Staging looks up one tenant's feature in one window among the unstaged
-- rows, on usage_events_unstaged. Two other indexes could serve that
-- lookup by reading every unstaged row of the month for each window: the
-- backlog's usage_events_unstaged_received (the same predicate) and
-- usage_events_item (a btree answers item_id IS NULL). The planner took
-- either whenever a month's statistics were gathered while nothing in it
-- was unstaged: all three then look equally cheap. Now neither can serve
-- it: the item index holds the staged rows only (every lookup by item
-- names one), and the backlog's index has a predicate term of its own that
-- only the backlog's reads state.
--
-- Built in the migration's transaction, as 00041: each build reads every
-- ledger month once and blocks the ledger's writes meanwhile.

-- +goose Up
DROP INDEX usage_events_unstaged_received;
CREATE INDEX usage_events_unstaged_received ON usage_events (received_at)
    WHERE item_id IS NULL AND received_at > '-infinity';
DROP INDEX usage_events_item;
CREATE INDEX usage_events_item ON usage_events (item_id) WHERE item_id IS NOT NULL;

-- +goose Down
DROP INDEX usage_events_item;
CREATE INDEX usage_events_item ON usage_events (item_id);
DROP INDEX usage_events_unstaged_received;
CREATE INDEX usage_events_unstaged_received ON usage_events (received_at) WHERE item_id IS NULL;
