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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
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
	if testing.Short() || os.Getenv("TALLY_ISOLATION_TEST") == "" {
		// It loads both cores for half a minute: beside the other packages'
		// tests it would measure them, and slow their timing-sensitive
		// end-to-end runs. make test runs it on its own (make isolation).
		t.Skip("fills a large ledger and loads the machine: set TALLY_ISOLATION_TEST=1 (make isolation runs it alone)")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := &isolationRun{t: t, ctx: ctx, cancel: cancel}
	defer r.stop()
	r.start()

	idle := r.idlePosts()
	res := r.runLoad()
	r.logFigures(idle, res)
	r.checkReportsEndWithClients()
	r.checkReportOutcomes(res.summary)
	r.checkReportsShared(res.summary)
	r.checkRiver(res)
}

// isolationRun is one run of the isolation test: the node it serves (its
// configuration, database, address and log), the client that calls it and
// the tokens the client uses.
type isolationRun struct {
	t      *testing.T
	ctx    context.Context
	cancel context.CancelFunc
	rows   int

	cfg    config.Config
	logger *slog.Logger
	logs   *syncbuf.Buffer
	db     *app.DB
	parts  *app.Parts
	served chan error // set once the node serves
	base   string
	client *http.Client

	ingest  string   // the ingest token's secret
	finance []string // the finance tokens' secrets
	seq     atomic.Int64
}

// start opens the node's database, fills the ledger with r.rows rows (the
// TALLY_ISOLATION_ROWS override or isolationRows), makes the tokens and
// serves the node with app.Serve.
func (r *isolationRun) start() {
	t := r.t
	t.Helper()
	url := testdb.URL(t)
	r.rows = isolationRows
	if v := os.Getenv("TALLY_ISOLATION_ROWS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err)
		r.rows = n
	}

	r.cfg = isolationConfig(t, url)
	r.logs = &syncbuf.Buffer{}
	r.logger = slog.New(slog.NewTextHandler(r.logs, &slog.HandlerOptions{Level: slog.LevelError}))
	db, err := app.Open(r.ctx, r.cfg, r.logger, false)
	require.NoError(t, err)
	r.db = db

	start := time.Now()
	fillLedger(t, r.ctx, r.db.Pool, r.rows)
	t.Logf("ledger: %d rows in %s", r.rows, time.Since(start).Round(time.Millisecond))

	r.makeTokens()
	r.serve()
}

// isolationConfig is the node's configuration, on the database at url.
func isolationConfig(t *testing.T, url string) config.Config {
	t.Helper()
	env := map[string]string{"TALLY_DATABASE_URL": url, "TALLY_LISTEN": "127.0.0.1:0", "TALLY_LOG_LEVEL": "error",
		"TALLY_STAGE_INTERVAL": "1s", "TALLY_READ_TIMEOUT": os.Getenv("TALLY_READ_TIMEOUT"), "TALLY_REPORT_MAX_AGE": os.Getenv("TALLY_REPORT_MAX_AGE"),
		// One poster posts back to back to measure ingest's latency; the
		// per-token request quota would throttle it (quotas have their own
		// tests in api).
		"TALLY_INGEST_REQUESTS_PER_SECOND": "0"}
	fs := flag.NewFlagSet("isolation", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	return cfg
}

// makeTokens makes the ingest token and isolationTokens finance tokens.
func (r *isolationRun) makeTokens() {
	t := r.t
	t.Helper()
	ingest, err := auth.CreateToken(r.ctx, r.db.Pool, "isolation ingest", auth.RoleIngest, nil)
	require.NoError(t, err)
	r.ingest = ingest.Secret
	for i := range isolationTokens {
		tok, err := auth.CreateToken(r.ctx, r.db.Pool, fmt.Sprintf("isolation finance %d", i), auth.RoleFinance, nil)
		require.NoError(t, err)
		r.finance = append(r.finance, tok.Secret)
	}
}

// serve builds the node and serves it with app.Serve until r.ctx ends; it
// returns once the node listens, with r.base its URL.
func (r *isolationRun) serve() {
	t := r.t
	t.Helper()
	parts, err := app.Build(r.cfg)
	require.NoError(t, err)
	r.parts = parts
	addr := make(chan string, 1)
	served := make(chan error, 1)
	go func() { served <- app.Serve(r.ctx, r.cfg, r.db, parts, r.logger, func(a string) { addr <- a }) }()
	select {
	case a := <-addr:
		r.base = "http://" + a
	case err := <-served:
		t.Fatalf("serve ended: %v", err)
	}
	r.served = served
	r.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * isolationReporters}, Timeout: 2 * time.Minute}
}

// stop undoes what start did: once the node serves, it stops it, requires
// Serve to end cleanly and, if the test failed, prints the node's log; then
// it closes the database.
func (r *isolationRun) stop() {
	if r.db != nil {
		defer r.db.Close()
	}
	if r.served == nil {
		return
	}
	r.cancel()
	require.NoError(r.t, <-r.served)
	if r.t.Failed() {
		r.t.Logf("node log:\n%s", r.logs.String())
	}
}

// post posts one event with the ingest token, requires it accepted and
// returns how long it took.
func (r *isolationRun) post() time.Duration {
	t := r.t
	t.Helper()
	body, _ := json.Marshal(map[string]any{"events": []map[string]any{{"id": fmt.Sprintf("iso-%d", r.seq.Add(1)),
		"tenant": "t1", "feature": "api_calls", "value": 1, "timestamp": time.Now().UTC().Format(time.RFC3339Nano)}}})
	req, _ := http.NewRequest(http.MethodPost, r.base+"/v1/usage", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+r.ingest)
	req.Header.Set("Content-Type", "application/json")
	began := time.Now()
	resp, err := r.client.Do(req)
	took := time.Since(began)
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusAccepted, resp.StatusCode, "every post succeeds: %s", b)
	return took
}

// idlePosts are the times of isolationIdlePosts posts with no load.
func (r *isolationRun) idlePosts() []time.Duration {
	r.t.Helper()
	idle := make([]time.Duration, 0, isolationIdlePosts)
	for range isolationIdlePosts {
		idle = append(idle, r.post())
	}
	return idle
}

// loadResult is what runLoad saw.
type loadResult struct {
	outcomes sync.Map // status (and code) → *atomic.Int64
	slowest  atomic.Int64
	summary  map[string]int64 // outcomes, once the load is over
	loaded   []time.Duration  // the posts' times under the load

	leaderBefore, leaderAfter string
	stageState                string // the staging pass's job's state
}

// count counts one report's outcome k.
func (l *loadResult) count(k string) {
	v, _ := l.outcomes.LoadOrStore(k, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

// runLoad runs isolationReporters reporters on the finance tokens and a
// staging pass while posting back to back for isolationLoad, noting River's
// leader before and after.
func (r *isolationRun) runLoad() *loadResult {
	t := r.t
	t.Helper()
	res := &loadResult{}
	res.leaderBefore = riverLeader(t, r.ctx, r.db.Pool)
	var wg sync.WaitGroup
	loadCtx, stopLoad := context.WithCancel(r.ctx)
	for i := range isolationReporters {
		wg.Add(1)
		go func(token string) {
			defer wg.Done()
			r.report(loadCtx, token, res)
		}(r.finance[i%isolationTokens])
	}

	// A staging pass River must fetch, run and complete during the load.
	inserter, err := river.NewClient(riverpgxv5.New(r.db.Pool), &river.Config{})
	require.NoError(t, err)
	staged, err := inserter.Insert(r.ctx, meter.StageArgs{}, nil)
	require.NoError(t, err)

	res.loaded = make([]time.Duration, 0, 256)
	for end := time.Now().Add(isolationLoad); time.Now().Before(end); {
		res.loaded = append(res.loaded, r.post())
	}
	res.stageState = jobState(t, r.ctx, r.db.Pool, staged.Job.ID)
	res.leaderAfter = riverLeader(t, r.ctx, r.db.Pool)
	stopLoad()
	wg.Wait()

	res.summary = map[string]int64{}
	res.outcomes.Range(func(k, v any) bool { res.summary[k.(string)] = v.(*atomic.Int64).Load(); return true })
	return res
}

// report is one reporter: until loadCtx ends it asks for isolationPeriod's
// completeness report with token, counting each outcome in res and waiting
// 200 ms after a 429.
func (r *isolationRun) report(loadCtx context.Context, token string, res *loadResult) {
	for loadCtx.Err() == nil {
		req, _ := http.NewRequestWithContext(loadCtx, http.MethodGet, r.base+"/v1/reports/completeness?period="+isolationPeriod, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		began := time.Now()
		resp, err := r.client.Do(req)
		if err != nil {
			if loadCtx.Err() == nil {
				res.count("transport error: " + err.Error())
			}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		took := time.Since(began)
		if took > time.Duration(res.slowest.Load()) {
			res.slowest.Store(int64(took))
		}
		switch resp.StatusCode {
		case http.StatusOK:
			res.count("200")
		case http.StatusTooManyRequests:
			if resp.Header.Get("Retry-After") == "" {
				res.count("429 without Retry-After")
			} else {
				res.count("429")
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
			res.count(fmt.Sprintf("%d %s", resp.StatusCode, e.Error.Code))
		}
	}
}

// logFigures prints the reports' outcomes, ingest's latency idle and under
// the load, and River's leader and staging pass.
func (r *isolationRun) logFigures(idle []time.Duration, res *loadResult) {
	t := r.t
	loaded := res.loaded
	t.Logf("ledger %d rows; %d reporters on %d finance tokens for %s; reports: %v (slowest answer %s)",
		r.rows, isolationReporters, isolationTokens, isolationLoad, res.summary, time.Duration(res.slowest.Load()).Round(time.Millisecond))
	t.Logf("ingest idle:    n=%d p50=%s p99=%s max=%s", len(idle), pct(idle, 50), pct(idle, 99), pct(idle, 100))
	t.Logf("ingest loaded:  n=%d p50=%s p99=%s max=%s", len(loaded), pct(loaded, 50), pct(loaded, 99), pct(loaded, 100))
	t.Logf("river: leader %s before, %s after; the staging pass inserted during the load: %s", res.leaderBefore, res.leaderAfter, res.stageState)
}

// checkReportsEndWithClients checks that a report whose client goes away
// ends its query at once, long before the statement timeout would: the
// reporters' last ones, then one held waiting on a lock of a table it reads
// (whatever the ledger's size) until its client leaves.
func (r *isolationRun) checkReportsEndWithClients() {
	t, ctx, db := r.t, r.ctx, r.db
	t.Helper()
	require.Eventually(t, func() bool { return reportQueries(t, ctx, db.Pool) == 0 }, 3*time.Second, 50*time.Millisecond,
		"the reporters' queries end with their clients")
	lock, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(ctx) }()
	_, err = lock.Exec(ctx, `LOCK TABLE completeness_counters IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	cctx, ccancel := context.WithCancel(ctx)
	// refresh: a computation, not the snapshot the reporters left.
	req, _ := http.NewRequestWithContext(cctx, http.MethodGet, r.base+"/v1/reports/completeness?refresh=true&period="+isolationPeriod, nil)
	req.Header.Set("Authorization", "Bearer "+r.finance[0])
	answered := make(chan error, 1)
	go func() {
		resp, err := r.client.Do(req)
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
}

// checkReportOutcomes checks that every report finished, was refused with
// 429 and Retry-After, or was cut by the statement timeout, and that the
// load was over the bounds.
func (r *isolationRun) checkReportOutcomes(summary map[string]int64) {
	t := r.t
	t.Helper()
	for k := range summary {
		require.Contains(t, []string{"200", "429", "503 statement_timeout"}, k,
			"a report finishes, is refused with 429 and Retry-After, or is cut by the statement timeout (503)")
	}
	require.NotZero(t, summary["429"], "40 reporters on 4 tokens are over the bounds")
}

// checkReportsShared checks that the reports answered were computed far
// fewer times than they were answered: from the month's snapshot, or from
// one computation every request waiting shared.
func (r *isolationRun) checkReportsShared(summary map[string]int64) {
	t := r.t
	t.Helper()
	n := reportComputations(t, r.parts.Registry)
	t.Logf("reports: %d answered 200 from %d computations of the month (TALLY_REPORT_MAX_AGE %s)", summary["200"], n, r.cfg.Pools.ReportMaxAge)
	require.NotZero(t, summary["200"], "reports are answered")
	require.Less(t, n, uint64(summary["200"]), "the ledger is read once for many reports, never per report")
}

// reportComputations is how many completeness computations the node ran
// (finished or cut), read from its metrics.
func reportComputations(t *testing.T, reg *prometheus.Registry) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "tally_report_computation_seconds" {
			return mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	t.Fatal("the node exposes no tally_report_computation_seconds")
	return 0
}

// checkRiver checks that River kept one leader through the load and ran
// the staging pass during it.
func (r *isolationRun) checkRiver(res *loadResult) {
	t := r.t
	t.Helper()
	require.NotEmpty(t, res.leaderBefore, "River has a leader before the load")
	require.Equal(t, res.leaderBefore, res.leaderAfter, "River kept its leader through the load")
	require.Equal(t, "completed", res.stageState, "River ran a staging pass during the load")
}

// fillLedger writes n usage rows of isolationPeriod, unstaged, across 100
// tenants and four features, straight into meter's ledger (usage_events):
// what months of ingest leave behind, in seconds.
func fillLedger(t *testing.T, ctx context.Context, pool *pgxpool.Pool, n int) {
	t.Helper()
	from, _, err := parseMonth(isolationPeriod)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
		INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
		SELECT 'tenant-' || (g % 100), 'fill-' || g, (ARRAY['api_calls','seats','logins','storage'])[1 + g % 4], 1 + g % 7,
		       $1::timestamptz + (g % (28*24*3600)) * interval '1 second', true, tally_bucket('tenant-' || (g % 100))
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

// reportQueries counts the completeness report's queries (of its
// counters) running on the node's connections.
func reportQueries(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state = 'active' AND query ILIKE '%FROM completeness_counters%'`).Scan(&n))
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
