package auth_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// A token past its expiry, by the database's clock, is refused.
func TestVerifyRefusesAnExpiredToken(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, err := auth.Create(ctx, pool, auth.TokenSpec{Name: "neg", Role: auth.RoleIngest, ExpiresIn: -time.Hour})
	require.ErrorContains(t, err, "must be positive")

	tok, err := auth.Create(ctx, pool, auth.TokenSpec{Name: "temp", Role: auth.RoleFinance, ExpiresIn: 90 * 24 * time.Hour, By: "cli:alice"})
	require.NoError(t, err)
	require.NotNil(t, tok.ExpiresAt)
	var lifetime time.Duration
	require.NoError(t, pool.QueryRow(ctx, `SELECT expires_at - created_at FROM api_tokens WHERE name = 'temp'`).Scan(&lifetime))
	require.Equal(t, 90*24*time.Hour, lifetime.Round(time.Second), "expiry is set by the database's clock")
	_, err = auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)

	_, err = pool.Exec(ctx, `UPDATE api_tokens SET expires_at = clock_timestamp() - interval '1 second' WHERE name = 'temp'`)
	require.NoError(t, err)
	_, err = auth.Verify(ctx, pool, tok.Secret)
	require.ErrorIs(t, err, auth.ErrUnknownToken)

	forever, err := auth.Create(ctx, pool, auth.TokenSpec{Name: "forever", Role: auth.RoleFinance})
	require.NoError(t, err)
	require.Nil(t, forever.ExpiresAt)
	tokens, err := auth.ListTokens(ctx, pool)
	require.NoError(t, err)
	require.Len(t, tokens, 2)
	require.NotNil(t, tokens[0].ExpiresAt)
	require.Nil(t, tokens[1].ExpiresAt)
}

// last_used_at is noted on verification, at most once a minute.
func TestVerifyNotesLastUseOnceAMinute(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	tok, err := auth.CreateToken(ctx, pool, "svc", auth.RoleIngest, nil)
	require.NoError(t, err)
	lastUsed := func() *time.Time {
		var at *time.Time
		require.NoError(t, pool.QueryRow(ctx, `SELECT last_used_at FROM api_tokens WHERE name = 'svc'`).Scan(&at))
		return at
	}
	require.Nil(t, lastUsed(), "never used")

	_, err = auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	first := lastUsed()
	require.NotNil(t, first)
	_, err = auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	require.Equal(t, *first, *lastUsed(), "not again within the minute")

	_, err = pool.Exec(ctx, `UPDATE api_tokens SET last_used_at = last_used_at - interval '61 seconds' WHERE name = 'svc'`)
	require.NoError(t, err)
	_, err = auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	require.True(t, lastUsed().After(*first), "noted again after a minute")

	tokens, err := auth.ListTokens(ctx, pool)
	require.NoError(t, err)
	require.NotNil(t, tokens[0].LastUsedAt)
}

// A failing note of the last use does not fail the verification.
func TestVerifySucceedsWhenNotingLastUseFails(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	tok, err := auth.CreateToken(ctx, pool, "svc", auth.RoleIngest, nil)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
		CREATE FUNCTION refuse_touch() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no'; END $$;
		CREATE TRIGGER refuse_touch BEFORE UPDATE OF last_used_at ON api_tokens FOR EACH ROW EXECUTE FUNCTION refuse_touch();`)
	require.NoError(t, err)
	p, err := auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	require.Equal(t, "svc", p.Name)
	var at *time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT last_used_at FROM api_tokens`).Scan(&at))
	require.Nil(t, at, "the note failed")
}

// Creating and revoking a token is in the audit log, written in the same
// transaction: when the entry cannot be written, nothing happens.
func TestCreateAndRevokeAreAudited(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	tok, err := auth.Create(ctx, pool, auth.TokenSpec{Name: "svc", Role: auth.RoleIngest, Tenants: []string{"acme"}, ExpiresIn: time.Hour, By: "cli:alice"})
	require.NoError(t, err)
	require.NoError(t, auth.RevokeAs(ctx, pool, "svc", "cli:bob"))
	require.ErrorContains(t, auth.RevokeAs(ctx, pool, "svc", "cli:bob"), "no live token")

	entries, err := audit.List(ctx, pool, audit.Token("svc"), 10)
	require.NoError(t, err)
	require.Len(t, entries, 2)
	require.Equal(t, "cli:bob", entries[0].Actor)
	require.Equal(t, audit.ActionTokenRevoke, entries[0].Action)
	require.Equal(t, "revoked", entries[0].To)
	require.Equal(t, "cli:alice", entries[1].Actor)
	require.Equal(t, audit.ActionTokenCreate, entries[1].Action)
	require.Equal(t, "ingest", entries[1].Details["role"])
	require.Equal(t, []any{"acme"}, entries[1].Details["tenants"])
	require.Contains(t, entries[1].Details, "expires_at")
	var text string
	require.NoError(t, pool.QueryRow(ctx, `SELECT string_agg(a::text, ' ') FROM audit_log a`).Scan(&text))
	require.NotContains(t, text, tok.Secret[len(auth.TokenPrefix):])

	// The audit log refusing entries refuses the action too.
	_, err = pool.Exec(ctx, `
		CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no'; END $$;
		CREATE TRIGGER refuse_audit BEFORE INSERT ON audit_log FOR EACH ROW EXECUTE FUNCTION refuse_audit();`)
	require.NoError(t, err)
	live, err := auth.CreateToken(ctx, pool, "fin", auth.RoleFinance, nil)
	require.NoError(t, err)
	_, err = auth.Create(ctx, pool, auth.TokenSpec{Name: "other", Role: auth.RoleFinance, By: "cli:alice"})
	require.Error(t, err)
	require.Error(t, auth.RevokeAs(ctx, pool, "fin", "cli:alice"))
	_, err = auth.SeedAdminToken(ctx, pool, valueA)
	require.Error(t, err)
	tokens, err := auth.ListTokens(ctx, pool)
	require.NoError(t, err)
	require.Len(t, tokens, 2, "neither other nor the seeded token was made")
	_, err = auth.Verify(ctx, pool, live.Secret)
	require.NoError(t, err, "fin was not revoked")
}
