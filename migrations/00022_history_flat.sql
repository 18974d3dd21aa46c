-- Cost flat as history grows: nothing on the hot path or in a routine
-- report reads history (the ledger rows and outbox items of past months,
-- which nothing deletes). Measured by BenchmarkHistory
-- (internal/testkit/history) on 20 million ledger rows and 5 million
-- confirmed items beside an empty database: docs/performance.md.
--
-- usage_events_occurred bounds the completeness report (and its snapshots)
-- to the month it reports: without it the report read every ledger row
-- ever written to find one month's. BRIN, not a B-tree: rows arrive close
-- to their occurred_at, so block ranges summarise well, and an insert
-- costs nothing until the range is summarised (autosummarize, at the next
-- range). minmax_multi keeps a late or back-dated event from widening its
-- whole range.
--
-- The gauge (outbox.Store.ReadGauge: GET /v1/outbox/summary, the console's
-- overview and tally_outbox_items) counts every state but confirmed
-- through a partial index of that state, and confirmed as the item count
-- less the others. The item count is outbox_gauge_settled.items, the
-- items below the watermark outbox_gauge_settled.below, counted once by
-- the maintenance pass as the watermark advances, plus the items from it
-- on. outbox_items_uncertain and outbox_items_rejected are the two states
-- that had no partial index; items enter them rarely (never on the claim
-- and accept path), superseded is read through outbox_items_superseded_by.
--
-- Not built CONCURRENTLY, for the reason 00017 gives.

-- +goose Up
CREATE INDEX usage_events_occurred ON usage_events USING brin (occurred_at timestamptz_minmax_multi_ops)
    WITH (autosummarize = on);
CREATE INDEX outbox_items_uncertain ON outbox_items (id) WHERE state = 'uncertain';
CREATE INDEX outbox_items_rejected ON outbox_items (id) WHERE state = 'rejected';

-- One row. items counts the outbox items with an id below below. next_below
-- is the next watermark, picked by one maintenance pass; next_xmax the
-- next transaction id when a later pass armed it. A pass that finds every
-- transaction below next_xmax ended promotes it: no transaction can still
-- add an item below next_below (see outbox.sqlGaugeAdvance).
CREATE TABLE outbox_gauge_settled (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    below      bigint  NOT NULL,
    items      bigint  NOT NULL,
    next_below bigint,
    next_xmax  xid8,
    CONSTRAINT outbox_gauge_settled_check CHECK (
        items >= 0 AND items < below AND (next_below IS NULL OR next_below > below)
        AND (next_xmax IS NULL OR next_below IS NOT NULL))
);
INSERT INTO outbox_gauge_settled (below, items) VALUES (1, 0);

-- +goose Down
DROP TABLE outbox_gauge_settled;
DROP INDEX outbox_items_rejected;
DROP INDEX outbox_items_uncertain;
DROP INDEX usage_events_occurred;
