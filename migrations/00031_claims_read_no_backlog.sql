-- Two indexes of the pending items serve only the statements they are for
-- (issue 17), as migration 25 made the leased keys' index serve only
-- probes of one key: each predicate gains a condition that is always true
-- (the column is NOT NULL) and that only those statements say.
--   - outbox_item_states_pending_created ("created_at IS NOT NULL"): the
--     gauge's oldest pending item and its count of pending items.
--   - outbox_item_states_pending_due ("next_attempt_at IS NOT NULL"): the
--     claims' picks of the oldest due items, in its order.
-- Where its statistics said nothing was pending (the table analysed before
-- a backlog: autovacuum analyses a large table only after a tenth of it
-- changed), the planner read either index whole as a cheap list of every
-- pending item: BestEffort's pick read pending_created whole and sorted it
-- to take the oldest 100, and PerKey's "no older pending item of this key"
-- read it, and then pending_due, once per candidate instead of probing
-- pending_key — 3,200 and 303,200 state rows for a claim of 100 beside a
-- backlog of 3,000 (outbox.TestClaimReadsNoBacklogItWillNotLease), growing
-- with the backlog, which is when claims must be cheapest.
--
-- The indexes hold the same entries. Each is built before the old one is
-- dropped, in the same transaction; not CONCURRENTLY, for the reason 00017
-- gives (each build reads outbox_item_states once: seconds for millions of
-- items).

-- +goose Up
CREATE INDEX outbox_item_states_pending_created_gauge ON outbox_item_states (created_at)
    WHERE state = 'pending' AND created_at IS NOT NULL;
DROP INDEX outbox_item_states_pending_created;
ALTER INDEX outbox_item_states_pending_created_gauge RENAME TO outbox_item_states_pending_created;

CREATE INDEX outbox_item_states_pending_due_pick ON outbox_item_states (next_attempt_at, id)
    WHERE state = 'pending' AND next_attempt_at IS NOT NULL;
DROP INDEX outbox_item_states_pending_due;
ALTER INDEX outbox_item_states_pending_due_pick RENAME TO outbox_item_states_pending_due;

-- +goose Down
CREATE INDEX outbox_item_states_pending_created_all ON outbox_item_states (created_at) WHERE state = 'pending';
DROP INDEX outbox_item_states_pending_created;
ALTER INDEX outbox_item_states_pending_created_all RENAME TO outbox_item_states_pending_created;

CREATE INDEX outbox_item_states_pending_due_all ON outbox_item_states (next_attempt_at, id) WHERE state = 'pending';
DROP INDEX outbox_item_states_pending_due;
ALTER INDEX outbox_item_states_pending_due_all RENAME TO outbox_item_states_pending_due;
