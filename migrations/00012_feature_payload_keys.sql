-- A Stripe meter names the payload key of the customer
-- (customer_mapping.event_payload_key) and of the value
-- (value_settings.event_payload_key); Stripe's defaults are
-- stripe_customer_id and value. A feature mapping carries the keys of the
-- meter it was set against, so that its items send them; they are part of
-- the mapping, and a change of them is a new mapping version like any other.
--
-- Existing mappings and their history get Stripe's defaults, which is what
-- every item sent them until now. The defaults are then dropped from the
-- columns: package mappings (DefaultCustomerPayloadKey,
-- DefaultValuePayloadKey) is their one source, and every writer names the
-- keys. The checks mirror package mappings' validation: 1 to 100
-- characters, no control character (U+0001-U+001F, U+007F-U+009F; Postgres
-- text holds no U+0000), and two different keys.

-- +goose Up
ALTER TABLE feature_mappings
    ADD COLUMN customer_payload_key text NOT NULL DEFAULT 'stripe_customer_id'
        CONSTRAINT feature_mappings_customer_payload_key_check
        CHECK (char_length(customer_payload_key) BETWEEN 1 AND 100 AND customer_payload_key !~ '[\x01-\x1f\x7f-\x9f]'),
    ADD COLUMN value_payload_key text NOT NULL DEFAULT 'value'
        CONSTRAINT feature_mappings_value_payload_key_check
        CHECK (char_length(value_payload_key) BETWEEN 1 AND 100 AND value_payload_key !~ '[\x01-\x1f\x7f-\x9f]'),
    ADD CONSTRAINT feature_mappings_payload_keys_check CHECK (customer_payload_key <> value_payload_key);
ALTER TABLE feature_mappings ALTER COLUMN customer_payload_key DROP DEFAULT, ALTER COLUMN value_payload_key DROP DEFAULT;

ALTER TABLE feature_mapping_versions
    ADD COLUMN customer_payload_key text NOT NULL DEFAULT 'stripe_customer_id'
        CONSTRAINT feature_mapping_versions_customer_payload_key_check
        CHECK (char_length(customer_payload_key) BETWEEN 1 AND 100 AND customer_payload_key !~ '[\x01-\x1f\x7f-\x9f]'),
    ADD COLUMN value_payload_key text NOT NULL DEFAULT 'value'
        CONSTRAINT feature_mapping_versions_value_payload_key_check
        CHECK (char_length(value_payload_key) BETWEEN 1 AND 100 AND value_payload_key !~ '[\x01-\x1f\x7f-\x9f]'),
    ADD CONSTRAINT feature_mapping_versions_payload_keys_check CHECK (customer_payload_key <> value_payload_key);
ALTER TABLE feature_mapping_versions ALTER COLUMN customer_payload_key DROP DEFAULT, ALTER COLUMN value_payload_key DROP DEFAULT;

-- +goose Down
ALTER TABLE feature_mapping_versions DROP COLUMN value_payload_key, DROP COLUMN customer_payload_key;
ALTER TABLE feature_mappings DROP COLUMN value_payload_key, DROP COLUMN customer_payload_key;
