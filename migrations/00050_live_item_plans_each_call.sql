-- tally_live_item(item, bucket) follows an item's successors within its
-- bucket. The counters' triggers call it on the shard that fires them, and
-- there a SQL function's statement, planned with its arguments as
-- parameters, cannot be routed by Citus ("could not create distributed
-- plan"): a PL/pgSQL function that plans its statement with each call's
-- values can. On one server the plan costs the same as before; the chain
-- is read only for items that were superseded.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION tally_live_item(item bigint, bk smallint) RETURNS bigint
    LANGUAGE plpgsql STABLE PARALLEL SAFE
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
BEGIN
    RETURN (
        WITH RECURSIVE chain (id, next, depth) AS (
            SELECT o.id, o.superseded_by, 0 FROM outbox_item_states o WHERE o.id = item AND o.bucket = bk
            UNION ALL
            SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.id = c.next
            WHERE o.bucket = bk AND c.depth < 1000
        )
        SELECT chain.id FROM chain WHERE chain.next IS NULL
    );
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION tally_live_item(item bigint, bk smallint) RETURNS bigint
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    WITH RECURSIVE chain (id, next, depth) AS (
        SELECT id, superseded_by, 0 FROM outbox_item_states WHERE id = item AND bucket = bk
        UNION ALL
        SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.id = c.next
        WHERE o.bucket = bk AND c.depth < 1000
    )
    SELECT id FROM chain WHERE next IS NULL
$$;
-- +goose StatementEnd
