package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	neturl "net/url"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/pgbouncer"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

// The harness the end-to-end tests share: `tally serve` processes, HTTP
// calls that ride out a restarting node, and the checks and failure
// descriptions read from the database.

// node is one `tally serve` process of the end-to-end tests.
type node struct {
	t    testing.TB
	env  []string
	addr string
	cmd  *exec.Cmd
	out  *bytes.Buffer
}

func (n *node) start() {
	n.t.Helper()
	nodeTests.Store(n.addr, n.t)
	n.t.Cleanup(func() { nodeTests.CompareAndDelete(n.addr, n.t) })
	n.out = new(bytes.Buffer)
	n.cmd = exec.Command(binary, "serve")
	n.cmd.Env = append(os.Environ(), n.env...)
	n.cmd.Stdout, n.cmd.Stderr = n.out, n.out
	require.NoError(n.t, n.cmd.Start())
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if code, _ := get("http://" + n.addr + "/healthz"); code == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			// What it said is why: a refused setting, a port taken.
			n.t.Fatalf("tally serve never answered /healthz:\n%s", tail(n.out.String(), 3000))
		}
	}
}

// serve starts n, stopped when the test ends, and returns its base URL
// and a pool on url, its database, closed when the test ends.
func (n *node) serve(ctx context.Context, url string) (string, *pgxpool.Pool) {
	n.t.Helper()
	n.start()
	n.t.Cleanup(n.stop)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(n.t, err)
	n.t.Cleanup(pool.Close)
	return "http://" + n.addr, pool
}

func (n *node) kill() {
	_ = n.cmd.Process.Signal(syscall.SIGKILL)
	_ = n.cmd.Wait()
}

func (n *node) stop() {
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	_ = n.cmd.Wait()
}

// post sends a JSON body (none when body is nil) with a token until the
// node answers (it may be down for a moment while it restarts) and returns
// the status and body. Every answer is checked against the OpenAPI
// document (openAPITransport): a mismatch fails t.
func post(t *testing.T, method, url, token string, body any) (int, string) {
	t.Helper()
	var b []byte
	if body != nil {
		var err error
		b, err = json.Marshal(body)
		require.NoError(t, err)
	}
	client := &http.Client{Transport: openAPITransport{t: t}}
	deadline := time.Now().Add(60 * time.Second)
	for {
		var rd io.Reader
		if b != nil {
			rd = bytes.NewReader(b)
		}
		req, _ := http.NewRequest(method, url, rd)
		req.Header.Set("Authorization", "Bearer "+token)
		if b != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := client.Do(req)
		if err == nil {
			var out bytes.Buffer
			_, _ = out.ReadFrom(resp.Body)
			resp.Body.Close()
			if resp.StatusCode < 500 {
				return resp.StatusCode, out.String()
			}
		}
		require.True(t, time.Now().Before(deadline), "the node never answered %s", url)
		time.Sleep(50 * time.Millisecond)
	}
}

// e2eEvent is one usage event as POST /v1/usage takes it.
type e2eEvent struct {
	ID        string `json:"id"`
	Tenant    string `json:"tenant"`
	Feature   string `json:"feature"`
	Value     int64  `json:"value"`
	Timestamp string `json:"timestamp"`
}

func keys(m map[string]int) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// outboxSummary describes what a stuck outbox holds, for a failure message.
func outboxSummary(ctx context.Context, pool *pgxpool.Pool) string {
	var b bytes.Buffer
	rows, err := pool.Query(ctx, `
		SELECT state, count(*), count(*) FILTER (WHERE next_attempt_at > clock_timestamp()),
		       min(attempts), max(attempts), coalesce(min(last_error), '')
		FROM outbox_items GROUP BY state`)
	if err != nil {
		return err.Error()
	}
	for rows.Next() {
		var st, le string
		var c, future, mina, maxa int
		if err := rows.Scan(&st, &c, &future, &mina, &maxa, &le); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&b, "%s: %d (%d not yet due, attempts %d..%d, e.g. %q)\n", st, c, future, mina, maxa, le)
	}
	var unstaged int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE item_id IS NULL`).Scan(&unstaged)
	fmt.Fprintf(&b, "unstaged events: %d", unstaged)
	return b.String()
}

// openWork counts the events not yet staged, then the items still open.
// Staging creates an item in the transaction that stages its events, so
// in that order no staged event's item can be missed; one statement
// would not promise it on Citus, where each count reads its own shards.
func openWork(ctx context.Context, pool *pgxpool.Pool) (unstaged, open int, err error) {
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE item_id IS NULL`).Scan(&unstaged); err != nil {
		return 0, 0, err
	}
	err = pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state IN ('pending', 'leased')`).Scan(&open)
	return unstaged, open, err
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// checkAggregates compares, for every customer and meter, the simulator's
// aggregate with the ledger's by the features' formulas (api_calls sum,
// logins count, seats last) and returns how many pairs it checked.
func checkAggregates(t *testing.T, ctx context.Context, pool *pgxpool.Pool, sim *stripesim.Server) int {
	t.Helper()
	rows, err := pool.Query(ctx, `
		SELECT tenant, feature, sum(value), count(*), (array_agg(value ORDER BY occurred_at DESC, id DESC))[1]
		FROM usage_events GROUP BY tenant, feature`)
	require.NoError(t, err)
	var (
		tenant, feature string
		sum, last       int64
		count, checked  int
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &feature, &sum, &count, &last}, func() error {
		ssum, scount, slast := sim.Aggregate(stripesim.DefaultAccount, feature, "cus_"+tenant)
		switch feature {
		case "api_calls":
			require.Equal(t, sum, ssum, "%s %s", tenant, feature)
		case "logins":
			require.Equal(t, count, scount, "%s %s", tenant, feature)
		case "seats":
			require.Equal(t, last, slast, "%s %s", tenant, feature)
		}
		checked++
		return nil
	})
	require.NoError(t, err)
	return checked
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// postOnce sends one JSON request and reports the status (0: no answer).
// The answer is checked against the OpenAPI document: a mismatch fails the
// test of the node that answered (openAPITransport).
func postOnce(url, token string, body any) (int, string) {
	b, _ := json.Marshal(body)
	req, err := http.NewRequest(http.MethodPost, url, bytesReader(b))
	if err != nil {
		return 0, err.Error()
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	client := &http.Client{Timeout: 10 * time.Second, Transport: openAPITransport{}}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	return resp.StatusCode, ""
}

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// pooledDatabase returns the settings of a node reaching url's database as
// a managed Postgres is reached: through PgBouncer in transaction mode,
// started for the test, as a login role of the runtime role (made for the
// test), migrating as url's role, the owner, through the pooler too. With
// direct, River and the notifications connect past the pooler
// (TALLY_DATABASE_DIRECT_URL); without, they poll. PgBouncer and the
// direct URL reach Postgres over TLS, verifying its certificate
// (testdb.TLS).
func pooledDatabase(t *testing.T, url string, direct bool) []string {
	t.Helper()
	ctx := context.Background()
	url = testdb.TLS(t, url)
	bouncer := pgbouncer.Start(t, url)
	u, err := neturl.Parse(url)
	require.NoError(t, err)
	var secret [8]byte
	_, _ = rand.Read(secret[:])
	role, password := "e2e_runtime_"+hex.EncodeToString(secret[:4]), hex.EncodeToString(secret[:])
	u.User = neturl.UserPassword(role, password)
	admin, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer admin.Close(ctx)
	_, err = admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN PASSWORD '"+password+"' IN ROLE "+migrations.RuntimeRole)
	require.NoError(t, err)
	t.Cleanup(func() {
		// The node did go through the pooler.
		require.Contains(t, bouncer.Log(), "login attempt: db="+u.Path[1:]+" user="+role)
		if c, err := pgx.Connect(context.Background(), url); err == nil {
			// PgBouncer's server connections, still open, are encrypted.
			var plain, all int
			require.NoError(t, c.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE NOT s.ssl), count(*)
				FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.usename = $1`, role).Scan(&plain, &all))
			require.Positive(t, all)
			require.Zero(t, plain, "a session of the runtime role in the clear")
			_, _ = c.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
			_ = c.Close(context.Background())
		}
	})
	env := []string{"TALLY_DATABASE_POOLED=true", "TALLY_DATABASE_URL=" + bouncer.URL(u.String()),
		"TALLY_DATABASE_OWNER_URL=" + bouncer.URL(url)}
	if direct {
		env = append(env, "TALLY_DATABASE_DIRECT_URL="+u.String())
	}
	return env
}

// loadPasses is a load test's stage interval, maintenance interval, lease
// and poll interval: its own on one server; on Citus the slower ones every
// load test uses there, since three servers share the machine's cores, a
// claim cut at its send window's end costs its connection, and every new
// connection costs the coordinator its metadata and worker connections.
func loadPasses(citus bool, stage, maintenance, lease, poll string) (string, string, string, string) {
	if citus {
		return "1s", "5s", "6s", "250ms"
	}
	return stage, maintenance, lease, poll
}
