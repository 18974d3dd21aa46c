-- +goose Up
-- tally_bucket from immutable builtins only, so that the planner inlines it
-- into every bucket CHECK instead of calling a SQL function per row:
-- tally_utf8 wraps convert_to, which is stable, and cannot be inlined.
-- In a UTF8 database (Tally's) decode(…, 'escape') of the text with its
-- backslashes doubled is its UTF-8 bytes, so every bucket is unchanged.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION tally_bucket(tenant text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (('x' || left(encode(sha256(decode(replace(tenant, '\', '\\'), 'escape')), 'hex'), 4))::bit(16)::integer & 1023)::smallint $$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION tally_bucket(tenant text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (('x' || left(encode(sha256(tally_utf8(tenant)), 'hex'), 4))::bit(16)::integer & 1023)::smallint $$;
-- +goose StatementEnd
