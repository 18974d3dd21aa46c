package auth_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

const (
	valueA = "first-admin-value-0123456789abcdefghij"
	valueB = "second-admin-value-0123456789abcdefghij"
)

// liveConfigured names the live tokens TALLY_ADMIN_TOKEN seeded.
func liveConfigured(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	tokens, err := auth.ListTokens(context.Background(), pool)
	require.NoError(t, err)
	var live []string
	for _, tok := range tokens {
		if tok.Origin == auth.OriginConfig && tok.RevokedAt == nil {
			live = append(live, tok.Name)
		}
	}
	return live
}

// A weak configured value never reaches the database.
func TestSeedAdminTokenRefusesAWeakValue(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, err := auth.SeedAdminToken(ctx, pool, strings.Repeat("admin", 7))
	require.ErrorContains(t, err, "TALLY_ADMIN_TOKEN must")
	tokens, err := auth.ListTokens(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, tokens)
}

// Rotating TALLY_ADMIN_TOKEN from A to B revokes A, and the console
// sessions opened with A end with it.
func TestSeedAdminTokenRotationEndsTheOldTokenAndItsSessions(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	a, err := auth.SeedAdminToken(ctx, pool, valueA)
	require.NoError(t, err)
	require.True(t, a.Created)
	require.Empty(t, a.Revoked)
	require.Regexp(t, `^config-admin-[0-9a-f]{8}$`, a.Name)
	p, err := auth.Verify(ctx, pool, valueA)
	require.NoError(t, err)
	require.Equal(t, auth.RoleAdmin, p.Role)
	session, err := auth.OpenSession(ctx, pool, p, time.Hour, "192.0.2.1")
	require.NoError(t, err)
	_, err = auth.LookupSession(ctx, pool, session.ID, time.Hour)
	require.NoError(t, err)

	again, err := auth.SeedAdminToken(ctx, pool, valueA)
	require.NoError(t, err)
	require.Equal(t, auth.Seeded{Name: a.Name}, again, "the same value changes nothing")

	b, err := auth.SeedAdminToken(ctx, pool, valueB)
	require.NoError(t, err)
	require.True(t, b.Created)
	require.Equal(t, []string{a.Name}, b.Revoked)
	_, err = auth.Verify(ctx, pool, valueA)
	require.ErrorIs(t, err, auth.ErrUnknownToken, "the old value stops working")
	_, err = auth.LookupSession(ctx, pool, session.ID, time.Hour)
	require.ErrorIs(t, err, auth.ErrNoSession, "the old value's console session ends")
	_, err = auth.Verify(ctx, pool, valueB)
	require.NoError(t, err)
	require.Equal(t, []string{b.Name}, liveConfigured(t, pool))

	// Both in the audit log, by the start, never with a secret.
	entries, err := audit.List(ctx, pool, "", 10)
	require.NoError(t, err)
	var got []string
	for _, e := range entries {
		got = append(got, e.Actor+" "+e.Action+" "+e.Subject)
		require.NotContains(t, e.Reason, valueB[:12])
	}
	require.Equal(t, []string{
		"start:TALLY_ADMIN_TOKEN token.revoke token:" + a.Name,
		"start:TALLY_ADMIN_TOKEN token.create token:" + b.Name,
		"console:" + a.Name + " session.open token:" + a.Name,
		"start:TALLY_ADMIN_TOKEN token.create token:" + a.Name,
	}, got)
}

// A revoked configured token stays revoked however often a node restarts
// with its value, and a token made with tally tokens is never touched.
func TestSeedAdminTokenNeverRevivesARevokedToken(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	managed, err := auth.Create(ctx, pool, auth.TokenSpec{Name: "alice", Role: auth.RoleAdmin, By: "cli:root"})
	require.NoError(t, err)
	a, err := auth.SeedAdminToken(ctx, pool, valueA)
	require.NoError(t, err)
	require.NoError(t, auth.RevokeAs(ctx, pool, a.Name, "cli:root"))

	for range 2 {
		s, err := auth.SeedAdminToken(ctx, pool, valueA)
		require.ErrorIs(t, err, auth.ErrSeedRevoked)
		require.Equal(t, a.Name, s.Name, "the answer names the revoked token")
		_, err = auth.Verify(ctx, pool, valueA)
		require.ErrorIs(t, err, auth.ErrUnknownToken)
	}
	require.Empty(t, liveConfigured(t, pool))

	// A new value is seeded; the managed admin token stays live.
	_, err = auth.SeedAdminToken(ctx, pool, valueB)
	require.NoError(t, err)
	_, err = auth.Verify(ctx, pool, managed.Secret)
	require.NoError(t, err, "tokens made with tally tokens are not the configuration's")
}

// Two nodes, one restarted with the old value and one with the new, in
// turns and at once: the newest value wins and stays, and the old one is
// never revived.
func TestSeedAdminTokenNodesAgreeOnTheNewestValue(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, err := auth.SeedAdminToken(ctx, pool, valueA) // node 1
	require.NoError(t, err)
	b, err := auth.SeedAdminToken(ctx, pool, valueB) // node 2, rotated
	require.NoError(t, err)
	for range 3 { // a rolling restart, in turns
		_, err := auth.SeedAdminToken(ctx, pool, valueA)
		require.ErrorIs(t, err, auth.ErrSeedRevoked)
		s, err := auth.SeedAdminToken(ctx, pool, valueB)
		require.NoError(t, err)
		require.False(t, s.Created)
	}
	require.Equal(t, []string{b.Name}, liveConfigured(t, pool))

	// Nodes starting together with two new values: one wins, and from
	// then on the other is revoked.
	c, d := "third-admin-value-0123456789abcdefghij", "fourth-admin-value-0123456789abcdefghij"
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = auth.SeedAdminToken(ctx, pool, []string{c, d}[i%2])
		}()
	}
	wg.Wait()
	live := liveConfigured(t, pool)
	require.Len(t, live, 1, "exactly one configured admin token is live")
	winner, loser := c, d
	if _, err := auth.Verify(ctx, pool, c); err != nil {
		winner, loser = d, c
	}
	_, err = auth.Verify(ctx, pool, winner)
	require.NoError(t, err)
	for i, err := range errs {
		if []string{c, d}[i%2] == winner {
			require.NoError(t, err)
		}
	}
	_, err = auth.SeedAdminToken(ctx, pool, loser)
	require.ErrorIs(t, err, auth.ErrSeedRevoked)
	_, err = auth.SeedAdminToken(ctx, pool, winner)
	require.NoError(t, err)
	require.Equal(t, live, liveConfigured(t, pool))
}

// A value that is already a token of another role is refused, not turned
// into an admin.
func TestSeedTokenRefusesAValueOfAnotherRole(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	ingest := "dev-ingest-value-0123456789abcdefghijkl"
	_, err := auth.SeedToken(ctx, pool, auth.OriginDev, auth.RoleIngest, ingest)
	require.NoError(t, err)
	_, err = auth.SeedAdminToken(ctx, pool, ingest)
	require.ErrorContains(t, err, "not one of role admin")
	p, err := auth.Verify(ctx, pool, ingest)
	require.NoError(t, err)
	require.Equal(t, auth.RoleIngest, p.Role)
	_, err = auth.SeedToken(ctx, pool, "elsewhere", auth.RoleIngest, ingest)
	require.ErrorContains(t, err, "unknown origin")
}
