-- The audit log: every operator action (a requeue, a recovery, a mapping
-- change), who did it, when, to what, from what, to what, and why. Written in
-- the transaction of the action itself; never updated, never deleted.

-- +goose Up
CREATE TABLE audit_log (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The token's name (API), or the command and the OS user (CLI).
    actor       text NOT NULL,
    action      text NOT NULL,
    -- What was acted on: "item:4211", "feature:api_calls", "tenant:acme".
    subject     text NOT NULL,
    from_state  text,
    to_state    text,
    reason      text,
    details     jsonb NOT NULL DEFAULT '{}',
    CONSTRAINT audit_log_action_check CHECK (action IN ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant')),
    CONSTRAINT audit_log_text_check CHECK (actor <> '' AND subject <> '' AND (reason IS NULL OR char_length(reason) <= 500))
);
CREATE INDEX audit_log_subject ON audit_log (subject, id);

-- +goose StatementBegin
CREATE FUNCTION audit_log_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log rows are never updated or deleted';
END
$$;
-- +goose StatementEnd
CREATE TRIGGER audit_log_immutable BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_immutable();

-- +goose Down
DROP TRIGGER audit_log_immutable ON audit_log;
DROP FUNCTION audit_log_immutable();
DROP TABLE audit_log;
