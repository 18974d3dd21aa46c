package auth_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// A revoked token is refused by a VerifiedCache at the latest VerifiedTTL
// after it was last verified, and a token refused as unknown works again
// once UnknownTTL has passed.
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
	require.ErrorIs(t, err, auth.ErrUnknownToken, "a refusal is remembered within its TTL")
	clock.Store(int64(auth.VerifiedTTL + auth.UnknownTTL))
	_, err = c.Verify(ctx, pool, tok.Secret)
	require.NoError(t, err, "asked again once the refusal's TTL passed")
}

// countingQuerier counts the statements run through it.
type countingQuerier struct {
	pgdb.Querier
	n atomic.Int64
}

func (q *countingQuerier) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	q.n.Add(1)
	return q.Querier.QueryRow(ctx, sql, args...)
}

// A client repeating an unknown token costs one lookup every UnknownTTL,
// not one a request; a configured value seeded after it was refused works
// once UnknownTTL has passed; and a flood of distinct unknown tokens keeps
// at most MaxUnknown of them, each costing its own lookup.
func TestVerifiedCacheRemembersAnUnknownTokenBriefly(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	q := &countingQuerier{Querier: pool}
	var clock atomic.Int64
	start := time.Now()
	var c auth.VerifiedCache
	c.SetNow(func() time.Time { return start.Add(time.Duration(clock.Load())) })

	secret := auth.TokenPrefix + strings.Repeat("k", 43)
	for range 50 {
		_, err := c.Verify(ctx, q, secret)
		require.ErrorIs(t, err, auth.ErrUnknownToken)
	}
	require.EqualValues(t, 1, q.n.Load(), "one lookup for 50 requests with one unknown token")

	_, err := auth.SeedToken(ctx, pool, auth.OriginConfig, auth.RoleAdmin, secret)
	require.NoError(t, err)
	clock.Store(int64(auth.UnknownTTL - time.Millisecond))
	_, err = c.Verify(ctx, q, secret)
	require.ErrorIs(t, err, auth.ErrUnknownToken, "still refused within the TTL")
	clock.Store(int64(auth.UnknownTTL))
	p, err := c.Verify(ctx, q, secret)
	require.NoError(t, err, "the seeded token works once the TTL passed")
	require.Equal(t, auth.RoleAdmin, p.Role)
	require.EqualValues(t, 2, q.n.Load())

	before := q.n.Load()
	flood := auth.MaxUnknown + 500
	for i := range flood {
		_, err := c.Verify(ctx, q, fmt.Sprintf("%s%043d", auth.TokenPrefix, i))
		require.ErrorIs(t, err, auth.ErrUnknownToken)
	}
	require.Equal(t, auth.MaxUnknown, c.UnknownLen(), "bounded under a flood of distinct tokens")
	require.EqualValues(t, flood, q.n.Load()-before, "each distinct token is one lookup")
}
