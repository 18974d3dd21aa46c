-- The index of the keys that hold a lease serves only probes of one key
-- (issue 17). Its predicate gains "ordering_key IS NOT NULL", which every
-- probe implies (ordering_key = $key is strict) and which a statement with
-- no condition on the key does not: the planner can no longer read the
-- whole index as a cheap list of every leased item. It did, for the
-- expired half of every claim ("the oldest expired leases"): with one
-- leased row in its statistics it chose a full scan of this index, a heap
-- fetch of every leased item and a sort over the range scan of
-- outbox_item_states_leased_expiry, which reads only the expired ones —
-- about a buffer a leased item on every claim, 90-115 buffers of ~2,900 in
-- a PerKey claim of 100 under four claimers, and the whole in-flight set of
-- the stream exporter (up to TALLY_STREAM_INFLIGHT) on each of its claims.
--
-- ordering_key is NOT NULL, so the index holds the same entries. Built
-- before the old one is dropped, in the same transaction; not CONCURRENTLY,
-- for the reason 00017 gives (the leased items are few).

-- +goose Up
CREATE INDEX outbox_item_states_leased_key_probe ON outbox_item_states (ordering_key)
    WHERE state = 'leased' AND ordering_key IS NOT NULL;
DROP INDEX outbox_item_states_leased_key;
ALTER INDEX outbox_item_states_leased_key_probe RENAME TO outbox_item_states_leased_key;

-- +goose Down
CREATE INDEX outbox_item_states_leased_key_all ON outbox_item_states (ordering_key) WHERE state = 'leased';
DROP INDEX outbox_item_states_leased_key;
ALTER INDEX outbox_item_states_leased_key_all RENAME TO outbox_item_states_leased_key;
