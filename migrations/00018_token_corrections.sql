-- A permission of its own for corrections: a negative usage
-- value lowers a customer's bill, so a token posts one only when it may.
--
-- corrections says whether a token may post negative values. Tokens that
-- existed before this migration could, and keep it: the column is added
-- with true for every existing row, then its default becomes false, so a
-- token made from now on may not unless asked (tally tokens create
-- --corrections). Operator and admin tokens always may: the check keeps
-- their column true.

-- +goose Up
ALTER TABLE api_tokens ADD COLUMN corrections boolean NOT NULL DEFAULT true;
ALTER TABLE api_tokens ALTER COLUMN corrections SET DEFAULT false,
    ADD CONSTRAINT api_tokens_corrections_check CHECK (corrections OR role IN ('ingest', 'finance'));

-- +goose Down
ALTER TABLE api_tokens DROP CONSTRAINT api_tokens_corrections_check, DROP COLUMN corrections;
