-- Archives of closed billing periods (docs/archive.md): one row per
-- generation of a month's archive, written by package archive alone. The
-- files themselves live in TALLY_ARCHIVE_URL; this row keeps where, the
-- manifest (per file its rows, bytes and sha256, the id ranges archived
-- and the month's completeness totals) and its sha256, and the lifecycle:
-- written (every file and the manifest committed), verified (every file
-- re-read and every total recomputed and matched), detached (the
-- period's partitions dropped, after a verified archive only).
--
-- A row is never deleted; its manifest never changes; its state moves
-- forward only (written -> verified -> detached). Triggers refuse the
-- rest. The audit log learns the archive's actions.
--
-- A new table and a CHECK swapped on audit_log (validated: every existing
-- action is in the new list) read nothing but the audit log once.

-- +goose Up
CREATE TABLE archives (
    period          text    NOT NULL,
    generation      integer NOT NULL,
    state           text    NOT NULL DEFAULT 'written',
    -- The store and the generation's prefix, never a credential.
    location        text    NOT NULL,
    manifest        jsonb   NOT NULL,
    manifest_sha256 text    NOT NULL,
    written_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    written_by      text    NOT NULL,
    verified_at     timestamptz,
    verified_by     text,
    detached_at     timestamptz,
    detached_by     text,
    PRIMARY KEY (period, generation),
    CONSTRAINT archives_period_check CHECK (period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    CONSTRAINT archives_generation_check CHECK (generation >= 1),
    CONSTRAINT archives_state_check CHECK (state IN ('written', 'verified', 'detached')),
    CONSTRAINT archives_sha_check CHECK (manifest_sha256 ~ '^[0-9a-f]{64}$'),
    CONSTRAINT archives_verified_check CHECK ((state = 'written') = (verified_at IS NULL) AND (verified_at IS NULL) = (verified_by IS NULL)),
    CONSTRAINT archives_detached_check CHECK ((state = 'detached') = (detached_at IS NOT NULL) AND (detached_at IS NULL) = (detached_by IS NULL)),
    CONSTRAINT archives_text_check CHECK (written_by <> '' AND location <> '')
);

-- +goose StatementBegin
CREATE FUNCTION archives_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'archives: %', TG_ARGV[0] USING ERRCODE = 'restrict_violation';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER archives_no_delete BEFORE DELETE ON archives
    FOR EACH ROW EXECUTE FUNCTION archives_refuse('rows are never deleted');
CREATE TRIGGER archives_no_truncate BEFORE TRUNCATE ON archives
    FOR EACH STATEMENT EXECUTE FUNCTION archives_refuse('rows are never deleted');
CREATE TRIGGER archives_immutable BEFORE UPDATE ON archives
    FOR EACH ROW WHEN (
        (NEW.period, NEW.generation, NEW.location, NEW.manifest, NEW.manifest_sha256, NEW.written_at, NEW.written_by)
        IS DISTINCT FROM
        (OLD.period, OLD.generation, OLD.location, OLD.manifest, OLD.manifest_sha256, OLD.written_at, OLD.written_by)
        OR (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (('written', 'verified'), ('verified', 'detached')))
        OR (OLD.verified_at IS NOT NULL AND (NEW.verified_at, NEW.verified_by) IS DISTINCT FROM (OLD.verified_at, OLD.verified_by)))
    EXECUTE FUNCTION archives_refuse('a manifest is immutable and its state only moves written -> verified -> detached');

ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach', 'completeness.repair', 'archive.write', 'archive.verify', 'archive.detach'));

-- The runtime role reads the archives (the report of a detached month);
-- only the owner, who runs the archive commands, writes them.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON archives FROM tally_runtime;
        GRANT SELECT ON archives TO tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- NOT VALID: the archive actions audited stay (the log is never edited).
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check CHECK (action IN
    ('requeue', 'readdress', 'recover', 'mapping.feature', 'mapping.tenant',
     'token.create', 'token.revoke', 'session.open', 'session.refused', 'session.close',
     'discrepancy.resolve', 'ledger.detach', 'completeness.repair')) NOT VALID;
DROP TABLE archives;
DROP FUNCTION archives_refuse();
