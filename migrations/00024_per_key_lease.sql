-- A PerKey claim in one statement (issue 17): the per-key policy's rule —
-- at most one item of an ordering key leased at a time by PerKey claimers —
-- is kept by a unique index, not only by the claim's advisory locks and a
-- second statement whose snapshot follows them.
--
-- per_key_lease says the item's current lease was taken by a PerKey claim
-- (outbox.PerKey); a BestEffort claim, which may lease many items of one
-- key, sets it false. Only the claim (T1) writes it; the index covers the
-- leased items that hold it, so a second PerKey lease of a key, taken by a
-- claimer whose snapshot did not yet see the first, fails with a unique
-- violation instead of leasing the key twice, and the claim is retried
-- (outbox.Store.Claim). An expired PerKey lease keeps its key until it is
-- taken over or the maintenance sweep settles it (T4): a key is never
-- leased twice, even after a lease expired.
--
-- Adding a column with a constant default rewrites nothing; the index
-- starts empty (every existing row holds false). Not built CONCURRENTLY,
-- for the reason 00017 gives.

-- +goose Up
ALTER TABLE outbox_item_states ADD COLUMN per_key_lease boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX outbox_item_states_per_key_lease ON outbox_item_states (ordering_key)
    WHERE state = 'leased' AND per_key_lease;

-- +goose Down
DROP INDEX outbox_item_states_per_key_lease;
ALTER TABLE outbox_item_states DROP COLUMN per_key_lease;
