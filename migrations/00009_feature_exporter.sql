-- Issue 8: a second exporter, Stripe's v2 meter event stream, beside v1
-- meter events. A feature mapping may name the exporter of its items; empty
-- means the node's default (TALLY_EXPORTER). The exporter is part of every
-- item's identity, so changing it is a mapping change like any other: a new
-- mapping version, kept in the history. The names mirror package exporter's
-- (and package mappings' list of them).
--
-- Each exporter's deliverer claims only its own items (o.exporter =
-- @exporter): two partial indexes lead with the exporter for those claims.
-- The unfiltered ones of migration 1 stay for claims of every exporter.

-- +goose Up
ALTER TABLE feature_mappings ADD COLUMN exporter text NOT NULL DEFAULT ''
    CONSTRAINT feature_mappings_exporter_check CHECK (exporter IN ('', 'stripe_meter_events', 'stripe_meter_event_stream'));
ALTER TABLE feature_mapping_versions ADD COLUMN exporter text NOT NULL DEFAULT ''
    CONSTRAINT feature_mapping_versions_exporter_check CHECK (exporter IN ('', 'stripe_meter_events', 'stripe_meter_event_stream'));

CREATE INDEX outbox_items_pending_due_exporter ON outbox_items (exporter, next_attempt_at, id) WHERE state = 'pending';
CREATE INDEX outbox_items_leased_expiry_exporter ON outbox_items (exporter, lease_expires_at, id) WHERE state = 'leased';

-- +goose Down
DROP INDEX outbox_items_leased_expiry_exporter;
DROP INDEX outbox_items_pending_due_exporter;
ALTER TABLE feature_mapping_versions DROP COLUMN exporter;
ALTER TABLE feature_mappings DROP COLUMN exporter;
