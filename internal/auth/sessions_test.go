package auth_test

import (
	"context"
	"crypto/sha256"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// A session is found by its id until it expires, ends, or its token is
// revoked; only the id's hash is stored.
func TestSessions(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	tok, err := auth.CreateToken(ctx, pool, "fin", auth.RoleFinance, nil)
	require.NoError(t, err)

	s, err := auth.OpenSession(ctx, pool, tok.TokenID, time.Hour)
	require.NoError(t, err)
	require.Len(t, s.ID, 43)
	require.Len(t, s.CSRF, 43)
	require.NotEqual(t, s.ID, s.CSRF)
	var stored []byte
	require.NoError(t, pool.QueryRow(ctx, `SELECT id_hash FROM console_sessions`).Scan(&stored))
	sum := sha256.Sum256([]byte(s.ID))
	require.Equal(t, sum[:], stored)

	got, err := auth.LookupSession(ctx, pool, s.ID)
	require.NoError(t, err)
	require.Equal(t, auth.Session{Principal: auth.Principal{TokenID: tok.TokenID, Name: "fin", Role: auth.RoleFinance}, CSRF: s.CSRF}, got)
	_, err = auth.LookupSession(ctx, pool, s.ID+"x")
	require.ErrorIs(t, err, auth.ErrNoSession)

	require.NoError(t, auth.EndSession(ctx, pool, s.ID))
	_, err = auth.LookupSession(ctx, pool, s.ID)
	require.ErrorIs(t, err, auth.ErrNoSession, "ended")
	require.NoError(t, auth.EndSession(ctx, pool, s.ID), "ending again does nothing")

	expired, err := auth.OpenSession(ctx, pool, tok.TokenID, 0)
	require.NoError(t, err)
	_, err = auth.LookupSession(ctx, pool, expired.ID)
	require.ErrorIs(t, err, auth.ErrNoSession, "expired")

	live, err := auth.OpenSession(ctx, pool, tok.TokenID, time.Hour)
	require.NoError(t, err)
	require.NoError(t, auth.Revoke(ctx, pool, "fin"))
	_, err = auth.LookupSession(ctx, pool, live.ID)
	require.ErrorIs(t, err, auth.ErrNoSession, "its token is revoked")
}
