package auth_test

import (
	"context"
	"crypto/sha256"
	"os"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// Posting corrections is a permission of its own: an ingest or finance
// principal has it only when its token was made with it, an operator or an
// admin always, a principal of no role never.
func TestMayCorrectOnlyWithThePermissionOrAboveFinance(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		p    auth.Principal
		want bool
	}{
		{auth.Principal{}, false},
		{auth.Principal{Corrections: true}, false},
		{auth.Principal{Role: auth.RoleIngest}, false},
		{auth.Principal{Role: auth.RoleFinance}, false},
		{auth.Principal{Role: auth.RoleIngest, Corrections: true}, true},
		{auth.Principal{Role: auth.RoleFinance, Corrections: true}, true},
		{auth.Principal{Role: auth.RoleOperator}, true},
		{auth.Principal{Role: auth.RoleAdmin}, true},
	} {
		require.Equal(t, c.want, c.p.MayCorrect(), "%+v", c.p)
	}
}

// A token made without the permission has none, and says so when verified
// and listed; one made with it has it, and its creation's audit entry says
// so; an operator's or admin's token has it whatever was asked, and the
// database keeps it so.
func TestCreateGivesTheCorrectionsPermissionOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	want := map[string]bool{}
	for _, c := range []struct {
		spec auth.TokenSpec
		want bool
	}{
		{auth.TokenSpec{Name: "plain", Role: auth.RoleIngest}, false},
		{auth.TokenSpec{Name: "plain-finance", Role: auth.RoleFinance}, false},
		{auth.TokenSpec{Name: "fixer", Role: auth.RoleIngest, Tenants: []string{"acme"}, Corrections: true}, true},
		{auth.TokenSpec{Name: "fin-fixer", Role: auth.RoleFinance, Corrections: true}, true},
		{auth.TokenSpec{Name: "op", Role: auth.RoleOperator}, true},
		{auth.TokenSpec{Name: "admin", Role: auth.RoleAdmin}, true},
	} {
		c.spec.By = "cli:alice"
		tok, err := auth.Create(ctx, pool, c.spec)
		require.NoError(t, err, c.spec.Name)
		require.Equal(t, c.want, tok.Corrections, c.spec.Name)
		p, err := auth.Verify(ctx, pool, tok.Secret)
		require.NoError(t, err, c.spec.Name)
		require.Equal(t, c.want, p.Corrections, c.spec.Name)
		require.Equal(t, c.want, p.MayCorrect(), c.spec.Name)
		want[c.spec.Name] = c.want
	}
	fixture, err := auth.CreateToken(ctx, pool, "fixture", auth.RoleIngest, nil)
	require.NoError(t, err)
	require.False(t, fixture.Corrections, "a fixture's ingest token may not correct either")
	want["fixture"] = false

	tokens, err := auth.ListTokens(ctx, pool)
	require.NoError(t, err)
	got := map[string]bool{}
	for _, tok := range tokens {
		got[tok.Name] = tok.Corrections
	}
	require.Equal(t, want, got)

	entries, err := audit.List(ctx, pool, audit.Token("fixer"), 10)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, true, entries[0].Details["corrections"])
	entries, err = audit.List(ctx, pool, audit.Token("plain"), 10)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.NotContains(t, entries[0].Details, "corrections")

	_, err = pool.Exec(ctx, `UPDATE api_tokens SET corrections = false WHERE name = 'op'`)
	require.ErrorContains(t, err, "api_tokens_corrections_check", "an operator's token always may")
}

// The tokens seeded from outside may correct: TALLY_ADMIN_TOKEN's as every
// admin token, tally dev's ingest token so that a developer can try it.
func TestSeededTokensMayCorrect(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, err := auth.SeedAdminToken(ctx, pool, valueA)
	require.NoError(t, err)
	dev := "dev-ingest-value-0123456789abcdefghijkl"
	_, err = auth.SeedToken(ctx, pool, auth.OriginDev, auth.RoleIngest, dev)
	require.NoError(t, err)
	for _, secret := range []string{valueA, dev} {
		p, err := auth.Verify(ctx, pool, secret)
		require.NoError(t, err)
		require.True(t, p.Corrections, p.Name)
	}
}

// Migration 18 keeps what the tokens that existed before it could do: they
// may post corrections. A token made after it may not unless asked; going
// down and up again leaves the rows able.
func TestMigrationKeepsExistingTokensAbleToCorrect(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("../../migrations"), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = p.ApplyVersion(ctx, 18, false)
	require.NoError(t, err)
	var n int
	require.NoError(t, pool.QueryRow(ctx,
		`SELECT count(*) FROM information_schema.columns WHERE table_name = 'api_tokens' AND column_name = 'corrections'`).Scan(&n))
	require.Zero(t, n, "down drops the column")

	const before = "an-ingest-token-made-before-migration-18"
	hash := sha256.Sum256([]byte(before))
	_, err = pool.Exec(ctx, `INSERT INTO api_tokens (name, role, tenants, token_hash) VALUES ('old', 'ingest', '{acme}', $1)`, hash[:])
	require.NoError(t, err)
	_, err = p.ApplyVersion(ctx, 18, true)
	require.NoError(t, err)

	old, err := auth.Verify(ctx, pool, before)
	require.NoError(t, err)
	require.True(t, old.Corrections, "a token from before the migration keeps the permission")
	require.True(t, old.MayCorrect())
	tok, err := auth.CreateToken(ctx, pool, "new", auth.RoleIngest, nil)
	require.NoError(t, err)
	p2, err := auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	require.False(t, p2.Corrections, "a token made after it may not unless asked")
}
