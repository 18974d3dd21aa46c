package auth_test

import (
	"context"
	"crypto/sha256"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func TestRolesNest(t *testing.T) {
	t.Parallel()
	order := []auth.Role{auth.RoleIngest, auth.RoleFinance, auth.RoleOperator, auth.RoleAdmin}
	for i, r := range order {
		for j, min := range order {
			require.Equal(t, i >= j, r.Allows(min), "%s allows %s", r, min)
		}
	}
	require.False(t, auth.Role("root").Allows(auth.RoleIngest))
	_, err := auth.ParseRole("root")
	require.Error(t, err)
}

func TestTokens(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	tok, err := auth.CreateToken(ctx, pool, "svc", auth.RoleIngest, []string{"acme"})
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(tok.Secret, auth.TokenPrefix))
	require.Len(t, tok.Secret, len(auth.TokenPrefix)+43)

	p, err := auth.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	require.Equal(t, "svc", p.Name)
	require.True(t, p.MayPostFor("acme"))
	require.False(t, p.MayPostFor("beta"))

	// Only the hash is at rest.
	var stored []byte
	var text string
	require.NoError(t, pool.QueryRow(ctx, `SELECT token_hash, row_to_json(t)::text FROM api_tokens t WHERE name = 'svc'`).Scan(&stored, &text))
	sum := sha256.Sum256([]byte(tok.Secret))
	require.Equal(t, sum[:], stored)
	require.NotContains(t, text, tok.Secret[len(auth.TokenPrefix):])

	for _, wrong := range []string{"", tok.Secret + "x", tok.Secret[:len(tok.Secret)-1], strings.Repeat("a", 600)} {
		_, err := auth.Verify(ctx, pool, wrong)
		require.ErrorIs(t, err, auth.ErrUnknownToken)
	}
	_, err = auth.CreateToken(ctx, pool, "svc", auth.RoleAdmin, nil)
	require.ErrorContains(t, err, "exists already")
	_, err = auth.CreateToken(ctx, pool, "fin", auth.RoleFinance, []string{"acme"})
	require.ErrorContains(t, err, "only an ingest token")

	require.NoError(t, auth.Revoke(ctx, pool, "svc"))
	_, err = auth.Verify(ctx, pool, tok.Secret)
	require.ErrorIs(t, err, auth.ErrUnknownToken)
	require.Error(t, auth.Revoke(ctx, pool, "svc"))
}

// The list is every token, oldest first, revoked ones too, with its scope
// (nil: every tenant) and never a secret.
func TestListTokens(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, err := auth.CreateToken(ctx, pool, "svc", auth.RoleIngest, []string{"acme", "beta"})
	require.NoError(t, err)
	_, err = auth.CreateToken(ctx, pool, "fin", auth.RoleFinance, nil)
	require.NoError(t, err)
	require.NoError(t, auth.Revoke(ctx, pool, "svc"))

	tokens, err := auth.ListTokens(ctx, pool)
	require.NoError(t, err)
	require.Len(t, tokens, 2)
	require.Equal(t, "svc", tokens[0].Name)
	require.Equal(t, auth.RoleIngest, tokens[0].Role)
	require.Equal(t, []string{"acme", "beta"}, tokens[0].Tenants)
	require.NotNil(t, tokens[0].RevokedAt)
	require.Equal(t, "fin", tokens[1].Name)
	require.Equal(t, auth.RoleFinance, tokens[1].Role)
	require.Nil(t, tokens[1].Tenants, "every tenant")
	require.Nil(t, tokens[1].RevokedAt)
	require.False(t, tokens[1].CreatedAt.Before(tokens[0].CreatedAt))
}
