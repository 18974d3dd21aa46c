-- The token lifecycle (docs/operations.md, "The token lifecycle").
--
-- origin says where a token's value comes from: NULL for a token made with
-- tally tokens create (managed with tally tokens from then on), 'config'
-- for the admin token TALLY_ADMIN_TOKEN seeds, 'dev' for the ingest token
-- tally dev keeps in its data directory. A seeded token is identified by its
-- hash: a new value makes a new token and revokes the other live tokens of
-- its origin; a revoked one is never revived. The existing seeded rows are
-- marked so that the first start after this migration treats them so.
--
-- expires_at ends a token at that time (NULL: never); last_used_at is when
-- it last verified, written at most once a minute.
--
-- The audit log records token creation and revocation and console sign-ins.

-- +goose Up
ALTER TABLE api_tokens
    ADD COLUMN origin       text,
    ADD COLUMN expires_at   timestamptz,
    ADD COLUMN last_used_at timestamptz,
    ADD CONSTRAINT api_tokens_origin_check CHECK (origin IS NULL OR origin IN ('config', 'dev'));
UPDATE api_tokens SET origin = 'config' WHERE name = 'admin (TALLY_ADMIN_TOKEN)';
UPDATE api_tokens SET origin = 'dev' WHERE name = 'dev ingest';

ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open'));

-- +goose Down
-- The entries of the new actions stay (the log is never deleted from): the
-- old check is restored for new rows only.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant')) NOT VALID;
ALTER TABLE api_tokens DROP CONSTRAINT api_tokens_origin_check,
    DROP COLUMN origin, DROP COLUMN expires_at, DROP COLUMN last_used_at;
