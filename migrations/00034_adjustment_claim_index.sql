-- Meter event adjustments (cancellations) get an exporter of their own,
-- stripe_meter_event_adjustments, whose deliverer claims only its items
-- (o.exporter = 'stripe_meter_event_adjustments', written into the claim as
-- a literal), paced on a class of the account's budget of its own: Stripe
-- counts adjustments toward the basic limit and an endpoint's default 25
-- requests a second, not the meter events' 1,000 (docs/stripe.md §5).
--
-- Its claims would otherwise read the index of every pending item in due
-- order and filter the few adjustments out of it: under a backlog of
-- meter events, every claim of the adjustments' deliverer — several a
-- second — would read the whole backlog. A partial index of its pending
-- items alone serves them, as migration 11's serves the stream's; only
-- adjustments enter it (a cancellation each), so it costs the hot path of
-- meter events nothing. Leased items are few (those in flight): no index
-- is kept for the adjustments' alone.
--
-- Items staged before this migration keep the v1 exporter's name in their
-- identity (and their identifier): the v1 deliverer still sends them,
-- paced on the adjustments' class (exporter.StripeV1.PaceAdjustments).
--
-- Built in the migration's transaction, not CONCURRENTLY, for the reason
-- 00017 gives: no item has the exporter yet, so the build reads the state
-- table once and writes nothing.

-- +goose Up
CREATE INDEX outbox_item_states_adjust_pending_due ON outbox_item_states (next_attempt_at, id)
    WHERE state = 'pending' AND exporter = 'stripe_meter_event_adjustments';

-- +goose Down
DROP INDEX outbox_item_states_adjust_pending_due;
