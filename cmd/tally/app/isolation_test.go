package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
)

// The isolation test's sizes. TALLY_ISOLATION_ROWS overrides the ledger's.
const (
	isolationRows      = 1_000_000
	isolationReporters = 40
	isolationTokens    = 4
	isolationIdlePosts = 100
	isolationLoad      = 20 * time.Second
	// isolationPeriod is the month the ledger is filled for and reported.
	isolationPeriod = "2026-10"
)

// TestReportsOfReadOnlyTokensDoNotStopIngestOrRiver fills a ledger of a
// million rows, serves it with app.Serve, and runs 40 completeness
// reporters (four finance tokens, ten each, each retrying 200 ms after a
// 429) while one client posts single events. It prints ingest's p50 and
// p99 idle and under that load, and asserts what isolation promises: every
// post succeeds; every report finishes, is refused with 429 and
// Retry-After, or is cut by the statement timeout with a clean error; and
// River keeps its leader (elected once) and runs a staging pass during the
// load.
func TestReportsOfReadOnlyTokensDoNotStopIngestOrRiver(t *testing.T) {
	if testing.Short() {
		t.Skip("fills a large ledger")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.URL(t)
	rows := isolationRows
	if v := os.Getenv("TALLY_ISOLATION_ROWS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err)
		rows = n
	}

	env := map[string]string{"TALLY_DATABASE_URL": url, "TALLY_LISTEN": "127.0.0.1:0", "TALLY_LOG_LEVEL": "error",
		"TALLY_STAGE_INTERVAL": "1s", "TALLY_READ_TIMEOUT": os.Getenv("TALLY_READ_TIMEOUT"),
		// One poster posts back to back to measure ingest's latency; the
		// per-token request quota would throttle it (quotas have their own
		// tests in api).
		"TALLY_INGEST_REQUESTS_PER_SECOND": "0"}
	fs := flag.NewFlagSet("isolation", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	logs := &bytes.Buffer{}
	var logMu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&logMu, logs}, &slog.HandlerOptions{Level: slog.LevelError}))
	db, err := app.Open(ctx, cfg, logger, false)
	require.NoError(t, err)
	defer db.Close()

	start := time.Now()
	fillLedger(t, ctx, db.Pool, rows)
	t.Logf("ledger: %d rows in %s", rows, time.Since(start).Round(time.Millisecond))

	ingest, err := auth.CreateToken(ctx, db.Pool, "isolation ingest", auth.RoleIngest, nil)
	require.NoError(t, err)
	var finance []string
	for i := range isolationTokens {
		tok, err := auth.CreateToken(ctx, db.Pool, fmt.Sprintf("isolation finance %d", i), auth.RoleFinance, nil)
		require.NoError(t, err)
		finance = append(finance, tok.Secret)
	}

	parts, err := app.Build(cfg)
	require.NoError(t, err)
	addr := make(chan string, 1)
	served := make(chan error, 1)
	go func() { served <- app.Serve(ctx, cfg, db, parts, logger, func(a string) { addr <- a }) }()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-served:
		t.Fatalf("serve ended: %v", err)
	}
	defer func() {
		cancel()
		require.NoError(t, <-served)
		if t.Failed() {
			logMu.Lock()
			t.Logf("node log:\n%s", logs.String())
			logMu.Unlock()
		}
	}()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * isolationReporters}, Timeout: 2 * time.Minute}

	var seq atomic.Int64
	post := func() time.Duration {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"events": []map[string]any{{"id": fmt.Sprintf("iso-%d", seq.Add(1)),
			"tenant": "t1", "feature": "api_calls", "value": 1, "timestamp": time.Now().UTC().Format(time.RFC3339Nano)}}})
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/usage", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+ingest.Secret)
		req.Header.Set("Content-Type", "application/json")
		began := time.Now()
		resp, err := client.Do(req)
		took := time.Since(began)
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusAccepted, resp.StatusCode, "every post succeeds: %s", b)
		return took
	}

	idle := make([]time.Duration, 0, isolationIdlePosts)
	for range isolationIdlePosts {
		idle = append(idle, post())
	}

	leaderBefore := riverLeader(t, ctx, db.Pool)
	var (
		outcomes sync.Map // status (and code) → *atomic.Int64
		slowest  atomic.Int64
		wg       sync.WaitGroup
	)
	count := func(k string) {
		v, _ := outcomes.LoadOrStore(k, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	loadCtx, stopLoad := context.WithCancel(ctx)
	for i := range isolationReporters {
		wg.Add(1)
		go func(token string) {
			defer wg.Done()
			for loadCtx.Err() == nil {
				req, _ := http.NewRequestWithContext(loadCtx, http.MethodGet, base+"/v1/reports/completeness?period="+isolationPeriod, nil)
				req.Header.Set("Authorization", "Bearer "+token)
				began := time.Now()
				resp, err := client.Do(req)
				if err != nil {
					if loadCtx.Err() == nil {
						count("transport error: " + err.Error())
					}
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				took := time.Since(began)
				if took > time.Duration(slowest.Load()) {
					slowest.Store(int64(took))
				}
				switch resp.StatusCode {
				case http.StatusOK:
					count("200")
				case http.StatusTooManyRequests:
					if resp.Header.Get("Retry-After") == "" {
						count("429 without Retry-After")
					} else {
						count("429")
					}
					select {
					case <-loadCtx.Done():
					case <-time.After(200 * time.Millisecond):
					}
				default:
					var e struct {
						Error struct{ Code string } `json:"error"`
					}
					_ = json.Unmarshal(b, &e)
					count(fmt.Sprintf("%d %s", resp.StatusCode, e.Error.Code))
				}
			}
		}(finance[i%isolationTokens])
	}

	// A staging pass River must fetch, run and complete during the load.
	inserter, err := river.NewClient(riverpgxv5.New(db.Pool), &river.Config{})
	require.NoError(t, err)
	staged, err := inserter.Insert(ctx, meter.StageArgs{}, nil)
	require.NoError(t, err)

	loaded := make([]time.Duration, 0, 256)
	for end := time.Now().Add(isolationLoad); time.Now().Before(end); {
		loaded = append(loaded, post())
	}
	stageState := jobState(t, ctx, db.Pool, staged.Job.ID)
	leaderAfter := riverLeader(t, ctx, db.Pool)
	stopLoad()
	wg.Wait()

	summary := map[string]int64{}
	outcomes.Range(func(k, v any) bool { summary[k.(string)] = v.(*atomic.Int64).Load(); return true })
	t.Logf("ledger %d rows; %d reporters on %d finance tokens for %s; reports: %v (slowest answer %s)",
		rows, isolationReporters, isolationTokens, isolationLoad, summary, time.Duration(slowest.Load()).Round(time.Millisecond))
	t.Logf("ingest idle:    n=%d p50=%s p99=%s max=%s", len(idle), pct(idle, 50), pct(idle, 99), pct(idle, 100))
	t.Logf("ingest loaded:  n=%d p50=%s p99=%s max=%s", len(loaded), pct(loaded, 50), pct(loaded, 99), pct(loaded, 100))
	t.Logf("river: leader %s before, %s after; the staging pass inserted during the load: %s", leaderBefore, leaderAfter, stageState)

	// A report whose client goes away ends its query at once, long before
	// the statement timeout would: the reporters' last ones, then one held
	// waiting on a lock of a table it reads (whatever the ledger's size)
	// until its client leaves.
	require.Eventually(t, func() bool { return reportQueries(t, ctx, db.Pool) == 0 }, 3*time.Second, 50*time.Millisecond,
		"the reporters' queries end with their clients")
	lock, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(ctx) }()
	_, err = lock.Exec(ctx, `LOCK TABLE tenant_mappings IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	cctx, ccancel := context.WithCancel(ctx)
	req, _ := http.NewRequestWithContext(cctx, http.MethodGet, base+"/v1/reports/completeness?period="+isolationPeriod, nil)
	req.Header.Set("Authorization", "Bearer "+finance[0])
	answered := make(chan error, 1)
	go func() {
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		answered <- err
	}()
	require.Eventually(t, func() bool { return reportQueries(t, ctx, db.Pool) == 1 }, 5*time.Second, 20*time.Millisecond,
		"the report's query runs, waiting on the lock")
	ccancel()
	require.Error(t, <-answered, "the report outlasted its client")
	left := time.Now()
	require.Eventually(t, func() bool { return reportQueries(t, ctx, db.Pool) == 0 }, 3*time.Second, 10*time.Millisecond,
		"the report's query ends with its client")
	t.Logf("a report whose client left: its query ended within %s (the lock still held)", time.Since(left).Round(time.Millisecond))
	require.NoError(t, lock.Rollback(ctx))

	for k := range summary {
		require.Contains(t, []string{"200", "429", "503 statement_timeout"}, k,
			"a report finishes, is refused with 429 and Retry-After, or is cut by the statement timeout (503)")
	}
	require.NotZero(t, summary["429"], "40 reporters on 4 tokens are over the bounds")
	require.NotEmpty(t, leaderBefore, "River has a leader before the load")
	require.Equal(t, leaderBefore, leaderAfter, "River kept its leader through the load")
	require.Equal(t, "completed", stageState, "River ran a staging pass during the load")
}

// fillLedger writes n usage rows of isolationPeriod, unstaged, across 100
// tenants and four features, straight into meter's ledger (usage_events):
// what months of ingest leave behind, in seconds.
func fillLedger(t *testing.T, ctx context.Context, pool *pgxpool.Pool, n int) {
	t.Helper()
	from, _, err := parseMonth(isolationPeriod)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
		INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given)
		SELECT 'tenant-' || (g % 100), 'fill-' || g, (ARRAY['api_calls','seats','logins','storage'])[1 + g % 4], 1 + g % 7,
		       $1::timestamptz + (g % (28*24*3600)) * interval '1 second', true
		FROM generate_series(1, $2::bigint) g`, from, n)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ANALYZE usage_events`)
	require.NoError(t, err)
}

func parseMonth(p string) (time.Time, time.Time, error) {
	from, err := time.Parse("2006-01", p)
	return from, from.AddDate(0, 1, 0), err
}

// riverLeader is River's elected leader and when it was elected, if its
// term has not expired: a leader that stepped down and was elected again
// has a new election time.
func riverLeader(t *testing.T, ctx context.Context, pool *pgxpool.Pool) string {
	t.Helper()
	var id string
	err := pool.QueryRow(ctx, `SELECT coalesce(max(leader_id || ' elected ' || to_char(elected_at, 'HH24:MI:SS.US')), '')
		FROM river_leader WHERE expires_at > now()`).Scan(&id)
	require.NoError(t, err)
	return id
}

// reportQueries counts the ledger queries running on the node's
// connections.
func reportQueries(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state = 'active' AND query ILIKE '%usage_events%'`).Scan(&n))
	return n
}

func jobState(t *testing.T, ctx context.Context, pool *pgxpool.Pool, id int64) string {
	t.Helper()
	var state string
	require.NoError(t, pool.QueryRow(ctx, `SELECT state::text FROM river_job WHERE id = $1`, id).Scan(&state))
	return state
}

// pct is the p-th percentile of ds (100: the largest).
func pct(ds []time.Duration, p int) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	i = max(1, min(i, len(s)))
	return s[i-1].Round(100 * time.Microsecond)
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
