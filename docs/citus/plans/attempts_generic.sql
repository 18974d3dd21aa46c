-- pgx prepares statements: does the plan cache switch INSERT ... SELECT unnest($n) to a generic plan after five runs?
BEGIN;
PREPARE att(bigint[], smallint[], bigint[], text[], timestamptz[], text[], text[], bool[]) AS
INSERT INTO outbox_attempts (item_id, bucket, lease_token, lease_owner, leased_at, outcome, state_after, refused)
SELECT * FROM unnest($1, $2, $3, $4, $5, $6, $7, $8);
SELECT format('EXECUTE att(''{29}'', ''{95}'', ''{%s}'', ''{probe}'', ''{2026-12-06T00:00:00Z}'', ''{abandoned}'', ''{leased}'', ''{false}'')', 100 + g) FROM generate_series(1, 10) g \gexec
SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 'att';
ROLLBACK;
