-- Cancellations (issue 19, part 2; docs/design.md, "Cancellations"), the
-- ledger's and the state machine's side.
--
-- An outbox item can end withdrawn: its usage was cancelled before any
-- attempt of it could have reached the provider, so there is nothing to take
-- back and it is never sent. Two ways in, both in package outbox:
--   T0w: enqueued withdrawn (an event cancelled before it was staged is
--        staged straight into a withdrawn item, so that no ledger row is
--        left without an item);
--   T11: pending or quarantined → withdrawn, only while every attempt was
--        refused (refused_attempts = attempts): nothing may have reached the
--        provider. A CHECK holds the database to it too.
-- withdrawn is terminal: no edge leaves it. And a pending item may now be
-- superseded (T11r: a window's item re-addressed without a cancelled event,
-- the same predicate as T9r's); a CHECK holds every superseded item to
-- refused_attempts = attempts, which T9r has always required.
--
-- The ledger: usage_events.cancelled_at, set once by a cancellation and
-- never cleared (the immutability trigger now also guards it), and
-- usage_cancellations, one row per cancelled event (tenant, event id), with
-- what became of it.
--
-- The state CHECK and the withdrawn CHECK are added NOT VALID: every
-- existing row satisfies them (the old state list is a subset), so adding
-- them reads nothing; they bind every row written from now. The partial
-- index for the gauge's count is built by one scan of the state table
-- (about a second per five million items when cached). The new column of
-- usage_events has no default: nothing is rewritten.

-- +goose Up
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_state_check;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_state_check CHECK (state IN
    ('pending', 'leased', 'accepted', 'confirmed', 'uncertain', 'rejected', 'quarantined', 'superseded', 'withdrawn')) NOT VALID;
-- A superseded item keeps the reason it was quarantined for (T9r); one
-- superseded from pending (T11r) never had one.
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_quarantined_has_reason;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_quarantined_has_reason
    CHECK (state <> 'quarantined' OR quarantine_reason IS NOT NULL) NOT VALID;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_withdrawn_check
    CHECK (state NOT IN ('withdrawn', 'superseded') OR refused_attempts = attempts) NOT VALID;

DROP TRIGGER outbox_item_states_edges ON outbox_item_states;
CREATE TRIGGER outbox_item_states_edges BEFORE UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (
        ('pending', 'leased'),                                  -- T1
        ('leased', 'accepted'), ('leased', 'pending'),          -- T2, T3
        ('leased', 'uncertain'), ('leased', 'rejected'),        -- T4, T5
        ('leased', 'quarantined'),                              -- T6
        ('accepted', 'confirmed'),                              -- T7
        ('uncertain', 'accepted'), ('uncertain', 'pending'), ('uncertain', 'rejected'), -- T8
        ('quarantined', 'pending'), ('quarantined', 'superseded'),                      -- T9, T9r
        ('pending', 'uncertain'),                               -- T4 by the maintenance sweep
        ('accepted', 'quarantined'), ('accepted', 'rejected'),  -- T10
        ('pending', 'withdrawn'), ('quarantined', 'withdrawn'), -- T11
        ('pending', 'superseded')))                             -- T11r
    EXECUTE FUNCTION outbox_refuse('not an edge of the state machine');

CREATE INDEX outbox_item_states_withdrawn ON outbox_item_states (id) WHERE state = 'withdrawn';

ALTER TABLE usage_events ADD COLUMN cancelled_at timestamptz;
DROP TRIGGER usage_events_immutable ON usage_events;
CREATE TRIGGER usage_events_immutable BEFORE UPDATE ON usage_events
    FOR EACH ROW WHEN (
        (NEW.id, NEW.tenant, NEW.event_id, NEW.feature, NEW.value, NEW.occurred_at, NEW.timestamp_given, NEW.received_at)
        IS DISTINCT FROM
        (OLD.id, OLD.tenant, OLD.event_id, OLD.feature, OLD.value, OLD.occurred_at, OLD.timestamp_given, OLD.received_at)
        OR (OLD.item_id IS NOT NULL AND (NEW.item_id, NEW.staged_at) IS DISTINCT FROM (OLD.item_id, OLD.staged_at))
        OR (OLD.cancelled_at IS NOT NULL AND NEW.cancelled_at IS DISTINCT FROM OLD.cancelled_at))
    EXECUTE FUNCTION ledger_refuse('a ledger row is immutable; its item and its cancellation are set once');

CREATE TABLE usage_cancellations (
    id              bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant          text    NOT NULL,
    event_id        text    NOT NULL,
    event_row       bigint  NOT NULL REFERENCES usage_events (id),
    -- withdrawn: the event never reached Stripe (unstaged, or its item was
    -- withdrawn or re-addressed without it); adjustment: a meter event
    -- adjustment item cancels it; supplement: a negative supplement offsets
    -- it; refused: it cannot be taken back (reason); not_billed: Stripe
    -- refused the event itself, nothing to take back.
    outcome         text    NOT NULL,
    reason          text,
    -- The item that carried the event when it was cancelled, and the item
    -- that takes it back (the adjustment, the supplement, the withdrawn or
    -- refused item).
    carried_by      bigint  REFERENCES outbox_item_bodies (id),
    item_id         bigint  REFERENCES outbox_item_bodies (id),
    requested_by    text    NOT NULL,
    requested_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT usage_cancellations_event_key UNIQUE (tenant, event_id),
    CONSTRAINT usage_cancellations_row_key UNIQUE (event_row),
    CONSTRAINT usage_cancellations_outcome_check CHECK (outcome IN ('withdrawn', 'adjustment', 'supplement', 'refused', 'not_billed')),
    CONSTRAINT usage_cancellations_reason_check CHECK ((outcome = 'refused') = (reason IS NOT NULL))
);
CREATE TRIGGER usage_cancellations_append_only BEFORE UPDATE OR DELETE ON usage_cancellations
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('cancellations are never changed or deleted');
CREATE TRIGGER usage_cancellations_no_truncate BEFORE TRUNCATE ON usage_cancellations
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('cancellations are never deleted');

-- +goose Down
-- Refused while any item is withdrawn or any event cancelled (nothing is
-- ever deleted to make it pass: restore a backup instead).
DROP TABLE usage_cancellations;
DROP TRIGGER usage_events_immutable ON usage_events;
CREATE TRIGGER usage_events_immutable BEFORE UPDATE ON usage_events
    FOR EACH ROW WHEN (
        (NEW.id, NEW.tenant, NEW.event_id, NEW.feature, NEW.value, NEW.occurred_at, NEW.timestamp_given, NEW.received_at)
        IS DISTINCT FROM
        (OLD.id, OLD.tenant, OLD.event_id, OLD.feature, OLD.value, OLD.occurred_at, OLD.timestamp_given, OLD.received_at)
        OR (OLD.item_id IS NOT NULL AND (NEW.item_id, NEW.staged_at) IS DISTINCT FROM (OLD.item_id, OLD.staged_at)))
    EXECUTE FUNCTION ledger_refuse('a ledger row is immutable; its item is set once');
ALTER TABLE usage_events DROP COLUMN cancelled_at;
DROP INDEX outbox_item_states_withdrawn;
DROP TRIGGER outbox_item_states_edges ON outbox_item_states;
CREATE TRIGGER outbox_item_states_edges BEFORE UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (
        ('pending', 'leased'),                                  -- T1
        ('leased', 'accepted'), ('leased', 'pending'),          -- T2, T3
        ('leased', 'uncertain'), ('leased', 'rejected'),        -- T4, T5
        ('leased', 'quarantined'),                              -- T6
        ('accepted', 'confirmed'),                              -- T7
        ('uncertain', 'accepted'), ('uncertain', 'pending'), ('uncertain', 'rejected'), -- T8
        ('quarantined', 'pending'), ('quarantined', 'superseded'),                      -- T9, T9r
        ('pending', 'uncertain'),                               -- T4 by the maintenance sweep
        ('accepted', 'quarantined'), ('accepted', 'rejected'))) -- T10
    EXECUTE FUNCTION outbox_refuse('not an edge of the state machine');
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_withdrawn_check;
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_quarantined_has_reason;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_quarantined_has_reason
    CHECK (state NOT IN ('quarantined', 'superseded') OR quarantine_reason IS NOT NULL);
ALTER TABLE outbox_item_states DROP CONSTRAINT outbox_items_state_check;
ALTER TABLE outbox_item_states ADD CONSTRAINT outbox_items_state_check CHECK (state IN
    ('pending', 'leased', 'accepted', 'confirmed', 'uncertain', 'rejected', 'quarantined', 'superseded'));
