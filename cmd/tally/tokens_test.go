package main

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestParseLifetime(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"", "d", "0d", "-1d", "1.5d", "0s", "-5m", "soon", "100001d"} {
		_, err := parseLifetime(bad)
		require.ErrorContains(t, err, "--expires-in must be", "%q", bad)
	}
	for in, want := range map[string]time.Duration{"90d": 90 * 24 * time.Hour, "1d": 24 * time.Hour, "720h": 720 * time.Hour, "90m": 90 * time.Minute} {
		got, err := parseLifetime(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
}

// tally tokens create --expires-in sets an expiry and --corrections the
// permission to post corrections, tokens list shows them and the last use,
// and creation and revocation by the CLI are in the audit log.
func TestTokensCommandsExpiryCorrectionsLastUseAndAudit(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	code, _, errs := tally(t, url, "tokens", "create", "--role", "finance", "--name", "temp", "--expires-in", "soon")
	require.Equal(t, 2, code, errs)
	require.Contains(t, errs, "--expires-in must be")

	code, out, errs := tally(t, url, "tokens", "create", "--role", "finance", "--name", "temp", "--expires-in", "90d")
	require.Equal(t, 0, code, errs)
	require.Contains(t, errs, ", expiring "+time.Now().UTC().Add(90*24*time.Hour).Format("2006-01-02"))
	secret := strings.TrimSpace(out)
	require.NotContains(t, errs, "corrections")
	code, _, errs = tally(t, url, "tokens", "create", "--role", "ingest", "--name", "forever")
	require.Equal(t, 0, code, errs)
	code, _, errs = tally(t, url, "tokens", "create", "--role", "ingest", "--name", "fixer", "--corrections")
	require.Equal(t, 0, code, errs)
	require.Contains(t, errs, `"fixer", allowed to post corrections.`)
	code, _, errs = tally(t, url, "tokens", "create", "--role", "operator", "--name", "op")
	require.Equal(t, 0, code, errs)
	require.Contains(t, errs, "allowed to post corrections", "an operator always may")

	// A use of temp shows in the list.
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	code, out, errs = tally(t, url, "tokens", "list")
	require.Equal(t, 0, code, errs)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 5, out)
	require.Regexp(t, `^NAME +ROLE +TENANTS +CREATED +REVOKED +EXPIRES +LAST USED +CORRECTIONS$`, lines[0])
	require.Regexp(t, `^temp +finance +\(all\) +\S+ +`+time.Now().UTC().Add(90*24*time.Hour).Format("2006-01-02")+`T\S+ +never +no$`, lines[1])
	require.Regexp(t, `^forever +ingest +\(all\) +\S+ +never +never +no$`, lines[2])
	require.Regexp(t, `^fixer +ingest +\(all\) +\S+ +never +never +yes$`, lines[3])
	require.Regexp(t, `^op +operator +\(all\) +\S+ +never +never +yes$`, lines[4])
	require.NotContains(t, out, secret)

	code, out, errs = tally(t, url, "tokens", "revoke", "temp")
	require.Equal(t, 0, code, errs)
	require.Equal(t, "revoked temp\n", out)
	code, _, errs = tally(t, url, "tokens", "revoke", "temp")
	require.Equal(t, 1, code, errs)

	rows, err := pool.Query(ctx, `SELECT action, actor FROM audit_log WHERE subject = 'token:temp' ORDER BY id`)
	require.NoError(t, err)
	var got []string
	for rows.Next() {
		var action, actor string
		require.NoError(t, rows.Scan(&action, &actor))
		require.True(t, strings.HasPrefix(actor, "cli:"), actor)
		got = append(got, action)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"token.create", "token.revoke"}, got)
}

// serveOnce starts tally serve on url with the admin token, waits until it
// answers, checks which admin tokens work, stops it and returns its output.
func serveOnce(t *testing.T, url, admin string) string {
	t.Helper()
	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + admin, "STRIPE_API_KEY="}
	n.start()
	t.Cleanup(n.kill)
	n.stop()
	return n.out.String()
}

// TALLY_ADMIN_TOKEN across restarts of two nodes: a new value replaces the
// old, a node restarted with the old value leaves it revoked and says so,
// and a weak value stops serve before it listens.
func TestServeAdminTokenRotationAcrossRestarts(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	const (
		oldValue = "rotation-old-admin-0123456789abcdefghij"
		newValue = "rotation-new-admin-0123456789abcdefghij"
	)
	works := func(addr, token string) int {
		code, _ := post(t, http.MethodGet, "http://"+addr+"/v1/outbox/summary", token, nil)
		return code
	}

	serveOnce(t, url, oldValue)
	serveOnce(t, url, newValue)
	out := serveOnce(t, url, oldValue) // the node not yet rolled
	require.Contains(t, out, "TALLY_ADMIN_TOKEN is a revoked token and is not revived")
	require.NotContains(t, out, oldValue)

	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + newValue, "STRIPE_API_KEY="}
	n.start()
	t.Cleanup(n.kill)
	require.Equal(t, http.StatusOK, works(n.addr, newValue), n.out.String())
	require.Equal(t, http.StatusUnauthorized, works(n.addr, oldValue), "the old value stays revoked")
	n.stop()

	weak := strings.Repeat("admin", 8)
	cmd := exec.Command(binary, "serve", "--listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "TALLY_DATABASE_URL="+url, "TALLY_ADMIN_TOKEN="+weak)
	b, err := cmd.CombinedOutput()
	require.Error(t, err, "%s", b)
	require.Contains(t, string(b), "TALLY_ADMIN_TOKEN must use at least 10 different characters")
	require.NotContains(t, string(b), weak)
}
