package auth_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// A revoked token is refused by a VerifiedCache at the latest VerifiedTTL
// after it was last verified, and an unknown token is never remembered: a
// token created after a refusal works at once.
func TestVerifiedCacheRefusesARevokedTokenWithinItsTTL(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	var clock atomic.Int64
	start := time.Now()
	var c auth.VerifiedCache
	c.SetNow(func() time.Time { return start.Add(time.Duration(clock.Load())) })

	_, err := c.Verify(ctx, pool, "")
	require.ErrorIs(t, err, auth.ErrUnknownToken)
	tok, err := auth.CreateToken(ctx, pool, "svc", auth.RoleIngest, []string{"acme"})
	require.NoError(t, err)
	p, err := c.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err)
	require.Equal(t, []string{"acme"}, p.Tenants)

	require.NoError(t, auth.Revoke(ctx, pool, "svc"))
	clock.Store(int64(auth.VerifiedTTL - time.Millisecond))
	_, err = c.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err, "remembered within its TTL")
	clock.Store(int64(auth.VerifiedTTL))
	_, err = c.Verify(ctx, pool, tok.Secret)
	require.ErrorIs(t, err, auth.ErrUnknownToken, "asked again once its TTL passed")

	_, err = c.Verify(ctx, pool, tok.Secret+"x")
	require.ErrorIs(t, err, auth.ErrUnknownToken)
	_, err = pool.Exec(ctx, "UPDATE api_tokens SET revoked_at = NULL WHERE name = 'svc'")
	require.NoError(t, err)
	_, err = c.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err, "a refusal is not remembered")
}
