-- The usage ledger, the mappings operators maintain, and API tokens.
-- Nothing in Tally deletes a ledger row; triggers refuse it at the database.

-- +goose Up

-- tally_period_start is the start of the billing period containing t, for
-- monthly periods anchored at anchor (calendar months UTC when the anchor is
-- 1970-01-01T00:00:00Z). Months are added to the anchor, clamped to the last
-- day of a shorter month (an anchor on the 31st starts a period on Feb 28),
-- all in UTC. package meter's PeriodStart is the same function in Go.
-- +goose StatementBegin
CREATE FUNCTION tally_period_start(t timestamptz, anchor timestamptz) RETURNS timestamptz
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    tu timestamp := t AT TIME ZONE 'UTC';
    au timestamp := anchor AT TIME ZONE 'UTC';
    n  integer := (extract(year FROM tu)::integer - extract(year FROM au)::integer) * 12
                  + extract(month FROM tu)::integer - extract(month FROM au)::integer;
    p  timestamp := au + make_interval(months => n);
BEGIN
    IF p > tu THEN
        p := au + make_interval(months => n - 1);
    END IF;
    RETURN p AT TIME ZONE 'UTC';
END
$$;
-- +goose StatementEnd

-- One sequence numbers every mapping change, feature or tenant, so that an
-- item's mapping_version — the greater of its feature's and its tenant's —
-- grows with any change that could alter its payload.
CREATE SEQUENCE mapping_version_seq AS integer;

CREATE TABLE feature_mappings (
    feature        text    PRIMARY KEY,
    event_name     text    NOT NULL,
    aggregation    text    NOT NULL,
    window_seconds integer NOT NULL,
    version        integer NOT NULL UNIQUE,
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_by     text    NOT NULL,
    CONSTRAINT feature_mappings_feature_check CHECK (feature ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT feature_mappings_event_name_check CHECK (event_name ~ '^[A-Za-z0-9_.:-]{1,100}$'),
    CONSTRAINT feature_mappings_aggregation_check CHECK (aggregation IN ('sum', 'last', 'count')),
    CONSTRAINT feature_mappings_window_check CHECK (window_seconds BETWEEN 60 AND 86400 AND 86400 % window_seconds = 0)
);

-- Every version of every feature mapping, as it was set.
CREATE TABLE feature_mapping_versions (
    version        integer PRIMARY KEY,
    feature        text    NOT NULL,
    event_name     text    NOT NULL,
    aggregation    text    NOT NULL,
    window_seconds integer NOT NULL,
    changed_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    changed_by     text    NOT NULL
);
CREATE INDEX feature_mapping_versions_feature ON feature_mapping_versions (feature, version);

CREATE TABLE tenant_mappings (
    tenant             text    PRIMARY KEY,
    stripe_customer_id text    NOT NULL,
    period_anchor      timestamptz,
    version            integer NOT NULL UNIQUE,
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_by         text    NOT NULL,
    CONSTRAINT tenant_mappings_tenant_check CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT tenant_mappings_customer_check CHECK (stripe_customer_id ~ '^cus_[A-Za-z0-9]{1,250}$')
);

CREATE TABLE tenant_mapping_versions (
    version            integer PRIMARY KEY,
    tenant             text    NOT NULL,
    stripe_customer_id text    NOT NULL,
    period_anchor      timestamptz,
    changed_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    changed_by         text    NOT NULL
);
CREATE INDEX tenant_mapping_versions_tenant ON tenant_mapping_versions (tenant, version);

-- The ledger: every accepted usage event, immutable. item_id is set once, by
-- the stager or the ingest itself, to the outbox item that carries the event.
CREATE TABLE usage_events (
    id              bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant          text    NOT NULL,
    event_id        text    NOT NULL,
    feature         text    NOT NULL,
    value           bigint  NOT NULL,
    occurred_at     timestamptz NOT NULL,
    timestamp_given boolean NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    item_id         bigint  REFERENCES outbox_items (id),
    staged_at       timestamptz,
    CONSTRAINT usage_events_tenant_event_key UNIQUE (tenant, event_id),
    CONSTRAINT usage_events_tenant_check CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT usage_events_feature_check CHECK (feature ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    CONSTRAINT usage_events_event_id_check CHECK (char_length(event_id) BETWEEN 1 AND 128 AND event_id ~ '^[[:print:]]+$'),
    CONSTRAINT usage_events_staged_check CHECK ((item_id IS NULL) = (staged_at IS NULL))
);
-- The stager's work list, and the reports' way from an item to its rows.
CREATE INDEX usage_events_unstaged ON usage_events (tenant, feature, occurred_at) WHERE item_id IS NULL;
CREATE INDEX usage_events_item ON usage_events (item_id);

-- An item re-addressed by an operator (T9r) points to its successor; the
-- ledger rows keep pointing to the item they were staged into, the root.
CREATE INDEX outbox_items_superseded_by ON outbox_items (superseded_by) WHERE superseded_by IS NOT NULL;

-- tally_live_item follows superseded_by from an item to the item that
-- carries its usage now.
-- +goose StatementBegin
CREATE FUNCTION tally_live_item(item bigint) RETURNS bigint LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH RECURSIVE chain (id, next, depth) AS (
        SELECT id, superseded_by, 0 FROM outbox_items WHERE id = item
        UNION ALL
        SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_items o JOIN chain c ON o.id = c.next WHERE c.depth < 1000
    )
    SELECT id FROM chain WHERE next IS NULL
$$;
-- +goose StatementEnd

-- tally_root_item follows superseded_by backwards to the item the ledger
-- rows were staged into.
-- +goose StatementBegin
CREATE FUNCTION tally_root_item(item bigint) RETURNS bigint LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH RECURSIVE chain (id, depth) AS (
        SELECT item, 0
        UNION ALL
        SELECT o.id, c.depth + 1 FROM outbox_items o JOIN chain c ON o.superseded_by = c.id WHERE c.depth < 1000
    )
    SELECT id FROM chain ORDER BY depth DESC LIMIT 1
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION ledger_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: %', TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'restrict_violation';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER usage_events_no_delete BEFORE DELETE ON usage_events
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('rows are never deleted');
CREATE TRIGGER usage_events_no_truncate BEFORE TRUNCATE ON usage_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse('rows are never deleted');
CREATE TRIGGER usage_events_immutable BEFORE UPDATE ON usage_events
    FOR EACH ROW WHEN (
        (NEW.id, NEW.tenant, NEW.event_id, NEW.feature, NEW.value, NEW.occurred_at, NEW.timestamp_given, NEW.received_at)
        IS DISTINCT FROM
        (OLD.id, OLD.tenant, OLD.event_id, OLD.feature, OLD.value, OLD.occurred_at, OLD.timestamp_given, OLD.received_at)
        OR (OLD.item_id IS NOT NULL AND (NEW.item_id, NEW.staged_at) IS DISTINCT FROM (OLD.item_id, OLD.staged_at)))
    EXECUTE FUNCTION ledger_refuse('a ledger row is immutable; its item is set once');
CREATE TRIGGER feature_mapping_versions_append_only BEFORE UPDATE OR DELETE ON feature_mapping_versions
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('mapping history is append-only');
CREATE TRIGGER tenant_mapping_versions_append_only BEFORE UPDATE OR DELETE ON tenant_mapping_versions
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse('mapping history is append-only');

-- API tokens: only a hash is stored. Roles nest: ingest < finance < operator
-- < admin. Only an ingest token may be scoped to tenants.
CREATE TABLE api_tokens (
    id         bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text    NOT NULL UNIQUE,
    role       text    NOT NULL,
    tenants    text[],
    token_hash bytea   NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    revoked_at timestamptz,
    CONSTRAINT api_tokens_role_check CHECK (role IN ('ingest', 'finance', 'operator', 'admin')),
    CONSTRAINT api_tokens_hash_check CHECK (octet_length(token_hash) = 32),
    CONSTRAINT api_tokens_scope_check CHECK (tenants IS NULL OR (role = 'ingest' AND cardinality(tenants) > 0)),
    CONSTRAINT api_tokens_name_check CHECK (name ~ '^[[:print:]]{1,100}$')
);

-- +goose Down
DROP TABLE api_tokens;
DROP TABLE usage_events;
DROP TABLE tenant_mapping_versions;
DROP TABLE tenant_mappings;
DROP TABLE feature_mapping_versions;
DROP TABLE feature_mappings;
DROP SEQUENCE mapping_version_seq;
DROP FUNCTION ledger_refuse();
DROP FUNCTION tally_root_item(bigint);
DROP FUNCTION tally_live_item(bigint);
DROP INDEX outbox_items_superseded_by;
DROP FUNCTION tally_period_start(timestamptz, timestamptz);
