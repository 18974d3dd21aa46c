-- Console sessions end when unused for a while (TALLY_CONSOLE_SESSION_IDLE)
-- as well as at their absolute expiry (TALLY_CONSOLE_SESSION_TTL):
-- last_seen_at is when the session was last used, written at most once a
-- minute. Sessions that have ended (expired, signed out, idle, or of a
-- revoked token) are deleted by later sign-ins, a bounded batch each
-- (auth.PurgeSessions): the table is neither an outbox nor a ledger.
--
-- Sign-ins (session.open), refused sign-ins (session.refused) and sign-outs
-- (session.close) are audited: the audit log accepts their actions, beside
-- those of the token lifecycle (00015).

-- +goose Up
ALTER TABLE console_sessions ADD COLUMN last_seen_at timestamptz NOT NULL DEFAULT clock_timestamp();

ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close'));

-- +goose Down
-- NOT VALID: the refusals and sign-outs audited stay (the log is never
-- edited); new ones are refused.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open')) NOT VALID;
ALTER TABLE console_sessions DROP COLUMN last_seen_at;
