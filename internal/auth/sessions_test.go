package auth_test

import (
	"context"
	"crypto/sha256"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

const idle = 30 * time.Minute

func principal(t *testing.T, pool *pgxpool.Pool, name string, role auth.Role) auth.Principal {
	t.Helper()
	tok, err := auth.CreateToken(context.Background(), pool, name, role, nil)
	require.NoError(t, err)
	return tok.Principal
}

func open(t *testing.T, pool *pgxpool.Pool, p auth.Principal, ttl time.Duration) auth.NewSession {
	t.Helper()
	s, err := auth.OpenSession(context.Background(), pool, p, ttl, "192.0.2.7")
	require.NoError(t, err)
	return s
}

// seenAgo moves a session's last use into the past.
func seenAgo(t *testing.T, pool *pgxpool.Pool, s auth.NewSession, ago time.Duration) {
	t.Helper()
	sum := sha256.Sum256([]byte(s.ID))
	tag, err := pool.Exec(context.Background(), `UPDATE console_sessions SET last_seen_at = clock_timestamp() - $2::interval
		WHERE id_hash = $1`, sum[:], ago)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
}

func lastSeen(t *testing.T, pool *pgxpool.Pool, s auth.NewSession) time.Duration {
	t.Helper()
	sum := sha256.Sum256([]byte(s.ID))
	var ago time.Duration
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT clock_timestamp() - last_seen_at FROM console_sessions
		WHERE id_hash = $1`, sum[:]).Scan(&ago))
	return ago
}

// A session is found by its id until it expires, ends, or its token is
// revoked; only the id's hash is stored.
func TestSessions(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	fin := principal(t, pool, "fin", auth.RoleFinance)

	s := open(t, pool, fin, time.Hour)
	require.Len(t, s.ID, 43)
	require.Len(t, s.CSRF, 43)
	require.NotEqual(t, s.ID, s.CSRF)
	var stored []byte
	require.NoError(t, pool.QueryRow(ctx, `SELECT id_hash FROM console_sessions`).Scan(&stored))
	sum := sha256.Sum256([]byte(s.ID))
	require.Equal(t, sum[:], stored)

	_, err := auth.LookupSession(ctx, pool, s.ID+"x", idle)
	require.ErrorIs(t, err, auth.ErrNoSession)
	got, err := auth.LookupSession(ctx, pool, s.ID, idle)
	require.NoError(t, err)
	require.Equal(t, auth.Session{Principal: auth.Principal{TokenID: fin.TokenID, Name: "fin", Role: auth.RoleFinance}, CSRF: s.CSRF}, got)

	require.NoError(t, auth.EndSession(ctx, pool, s.ID, "192.0.2.7"))
	_, err = auth.LookupSession(ctx, pool, s.ID, idle)
	require.ErrorIs(t, err, auth.ErrNoSession, "ended")
	require.NoError(t, auth.EndSession(ctx, pool, s.ID, "192.0.2.7"), "ending again does nothing")

	expired := open(t, pool, fin, 0)
	_, err = auth.LookupSession(ctx, pool, expired.ID, idle)
	require.ErrorIs(t, err, auth.ErrNoSession, "expired")

	live := open(t, pool, fin, time.Hour)
	require.NoError(t, auth.Revoke(ctx, pool, "fin"))
	_, err = auth.LookupSession(ctx, pool, live.ID, idle)
	require.ErrorIs(t, err, auth.ErrNoSession, "its token is revoked")

	brief, err := auth.Create(ctx, pool, auth.TokenSpec{Name: "brief", Role: auth.RoleFinance, ExpiresIn: time.Hour, By: "test"})
	require.NoError(t, err)
	ofBrief := open(t, pool, brief.Principal, time.Hour)
	_, err = auth.LookupSession(ctx, pool, ofBrief.ID, idle)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE api_tokens SET expires_at = clock_timestamp() WHERE name = 'brief'`)
	require.NoError(t, err)
	_, err = auth.LookupSession(ctx, pool, ofBrief.ID, idle)
	require.ErrorIs(t, err, auth.ErrNoSession, "its token has expired")
}

// A session unused for its idle timeout has ended, though its absolute
// expiry is hours away; one used within it lives, and the use moves its
// last_seen_at — written at most once a minute, not on every page.
func TestSessionEndsWhenIdle(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	fin := principal(t, pool, "fin", auth.RoleFinance)

	idled := open(t, pool, fin, 8*time.Hour)
	seenAgo(t, pool, idled, idle+time.Second)
	_, err := auth.LookupSession(ctx, pool, idled.ID, idle)
	require.ErrorIs(t, err, auth.ErrNoSession, "unused for longer than the idle timeout")
	_, err = auth.LookupSession(ctx, pool, idled.ID, 0)
	require.NoError(t, err, "without an idle timeout only the absolute expiry counts")

	used := open(t, pool, fin, 8*time.Hour)
	seenAgo(t, pool, used, idle-time.Minute)
	_, err = auth.LookupSession(ctx, pool, used.ID, idle)
	require.NoError(t, err)
	require.Less(t, lastSeen(t, pool, used), time.Minute, "the use is recorded")

	recent := open(t, pool, fin, 8*time.Hour)
	seenAgo(t, pool, recent, 30*time.Second)
	_, err = auth.LookupSession(ctx, pool, recent.ID, idle)
	require.NoError(t, err)
	require.GreaterOrEqual(t, lastSeen(t, pool, recent), 30*time.Second, "seen under a minute ago: not written again")

	// A short idle timeout is tracked at a tenth of itself.
	short := open(t, pool, fin, 8*time.Hour)
	seenAgo(t, pool, short, 2*time.Second)
	_, err = auth.LookupSession(ctx, pool, short.ID, 10*time.Second)
	require.NoError(t, err)
	require.Less(t, lastSeen(t, pool, short), time.Second)
}

// A purge deletes ended sessions — expired, signed out, idle, of a revoked
// token — at most limit of them, and never a live one.
func TestPurgeSessionsKeepsLiveOnes(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	fin := principal(t, pool, "fin", auth.RoleFinance)
	gone := principal(t, pool, "gone", auth.RoleOperator)

	live := open(t, pool, fin, time.Hour)
	nearlyIdle := open(t, pool, fin, time.Hour)
	seenAgo(t, pool, nearlyIdle, idle-time.Minute)
	open(t, pool, fin, 0) // expired
	ended := open(t, pool, fin, time.Hour)
	require.NoError(t, auth.EndSession(ctx, pool, ended.ID, "192.0.2.7"))
	seenAgo(t, pool, open(t, pool, fin, time.Hour), idle+time.Second)
	open(t, pool, gone, time.Hour)
	require.NoError(t, auth.Revoke(ctx, pool, "gone"))
	expiredToken := principal(t, pool, "expired", auth.RoleFinance)
	open(t, pool, expiredToken, time.Hour)
	_, err := pool.Exec(ctx, `UPDATE api_tokens SET expires_at = clock_timestamp() WHERE name = 'expired'`)
	require.NoError(t, err)

	n, err := auth.PurgeSessions(ctx, pool, idle, 3)
	require.NoError(t, err)
	require.EqualValues(t, 3, n, "at most the limit")
	n, err = auth.PurgeSessions(ctx, pool, idle, 3)
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "the rest")
	n, err = auth.PurgeSessions(ctx, pool, idle, 3)
	require.NoError(t, err)
	require.Zero(t, n)

	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM console_sessions`).Scan(&left))
	require.Equal(t, 2, left)
	for _, s := range []auth.NewSession{live, nearlyIdle} {
		_, err := auth.LookupSession(ctx, pool, s.ID, idle)
		require.NoError(t, err, "a live session is kept")
	}
}

// Sign-ins, refusals and sign-outs are in the audit log with the address;
// a refusal names no token, and ending an ended session records nothing.
func TestSessionsAreAudited(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	fin := principal(t, pool, "fin", auth.RoleFinance)

	require.NoError(t, auth.RecordRefusedSignIn(ctx, pool, "198.51.100.9"))
	s := open(t, pool, fin, time.Hour)
	require.NoError(t, auth.EndSession(ctx, pool, s.ID, "192.0.2.8"))
	require.NoError(t, auth.EndSession(ctx, pool, s.ID, "192.0.2.8"))

	entries, err := audit.List(ctx, pool, "", 10)
	require.NoError(t, err)
	require.Len(t, entries, 3)
	type row struct{ actor, action, subject, reason, address string }
	var got []row
	for _, e := range entries {
		got = append(got, row{e.Actor, e.Action, e.Subject, e.Reason, e.Details["address"].(string)})
	}
	require.Equal(t, []row{
		{"console:fin", auth.ActionSignOut, "token:fin", "", "192.0.2.8"},
		{"console:fin", auth.ActionSignIn, "token:fin", "", "192.0.2.7"},
		{"console:anonymous", auth.ActionSignInRefused, "address:198.51.100.9", "sign-in refused", "198.51.100.9"},
	}, got)
}
