package quarantine

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// snapshotEnv is a staging path with one mapped tenant and feature, and
// the month of the usage the tests post.
type snapshotEnv struct {
	*stagetest.Env
	at    *time.Time // every event's timestamp
	month string     // its calendar month
	seq   int
}

func newSnapshotEnv(t *testing.T) *snapshotEnv {
	t.Helper()
	e := &snapshotEnv{Env: stagetest.New(t, outbox.Config{})}
	e.Tenant(t, "acme", nil)
	e.Tenant(t, "beta", nil)
	e.Feature(t, "api", mappings.Sum, time.Hour)
	// Ten minutes ago, to the second: its month is the report's.
	e.at = stagetest.Ago(10 * time.Minute)
	e.month = e.at.Format("2006-01")
	return e
}

// post ingests one event of value v for tenant.
func (e *snapshotEnv) post(t *testing.T, tenant string, v int64) {
	t.Helper()
	e.seq++
	e.MustIngest(t, stagetest.Ev(fmt.Sprintf("%s-%d", tenant, e.seq), tenant, "api", v, e.at))
}

// ingested sums the report's ingested value over its lines.
func ingested(c Completeness) string {
	sum := Value{}
	for _, l := range c.Lines {
		sum = sum.Plus(l.Ingested.Value)
	}
	return sum.String()
}

func jsonOf(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

// advisoryWaiters counts the sessions waiting for an advisory lock.
func advisoryWaiters(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&n))
	return n
}

// holdScope takes the scope's lock on a connection of its own, as a node
// computing it would, and returns the function that lets it go.
func holdScope(t *testing.T, pool *pgxpool.Pool, month string) (release func()) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), testdb.URLOf(t, pool))
	require.NoError(t, err)
	_, err = conn.Exec(context.Background(), `SELECT pg_advisory_lock(hashtextextended('tally.report_snapshots:completeness:' || $1, 0))`, month)
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { _ = conn.Close(context.Background()) }) }
	t.Cleanup(release)
	return release
}

// computations is how many computations reg's Reports timed.
func computations(t *testing.T, reg *prometheus.Registry) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "tally_report_computation_seconds" {
			return mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	t.Fatal("no tally_report_computation_seconds")
	return 0
}

func TestReportsAnswerFromTheSnapshotUntilItAgesAndRefreshComputes(t *testing.T) {
	t.Parallel()
	e := newSnapshotEnv(t)
	reg := prometheus.NewRegistry()
	r, err := NewReports(time.Hour, reg)
	require.NoError(t, err)
	ctx := e.Ctx

	e.post(t, "acme", 5)
	first, err := r.Completeness(ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, "5", ingested(first))
	require.NotEmpty(t, first.AsOf)
	live, err := CompletenessOf(ctx, e.Pool, e.month, "")
	require.NoError(t, err)
	require.NoError(t, live.addMoney(ctx, e.Pool))
	live.AsOf = first.AsOf
	require.JSONEq(t, jsonOf(t, live), jsonOf(t, first), "the snapshot is the report computed from the ledger, priced")

	e.post(t, "acme", 7)
	cached, err := r.Completeness(ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, first, cached, "younger than MaxAge: the snapshot answers, without the new event")
	require.EqualValues(t, 1, computations(t, reg))
	require.EqualValues(t, 1, testutil.ToFloat64(r.metrics.answers.WithLabelValues(answerSnapshot)))

	// Another node reads the same snapshot, and holds it.
	other, err := NewReports(time.Hour, nil)
	require.NoError(t, err)
	seen, err := other.Completeness(ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, first.AsOf, seen.AsOf)

	refreshed, err := r.Completeness(ctx, e.Pool, e.month, "", true)
	require.NoError(t, err)
	require.Equal(t, "12", ingested(refreshed), "a refresh reads the ledger now")
	require.Greater(t, refreshed.AsOf, first.AsOf)
	seen, err = other.Completeness(ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, refreshed.AsOf, seen.AsOf, "the other node answers the newer snapshot, not the one it holds")
	body, err := other.CompletenessJSON(ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, jsonOf(t, refreshed)+"\n", string(body), "the snapshot's bytes are the report's JSON")

	// An hour later by the database's clock (the snapshot made older
	// instead of waiting), the next request computes.
	_, err = e.Pool.Exec(ctx, `UPDATE report_snapshots SET computed_at = computed_at - interval '61 minutes'`)
	require.NoError(t, err)
	e.post(t, "beta", 1)
	aged, err := r.Completeness(ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, "13", ingested(aged))
	require.EqualValues(t, 3, computations(t, reg))

	beta, err := r.Completeness(ctx, e.Pool, e.month, "beta", false)
	require.NoError(t, err)
	require.Len(t, beta.Lines, 1, "one tenant's lines, from the month's snapshot of every tenant")
	require.Equal(t, "beta", beta.Lines[0].Tenant)
	require.True(t, beta.Holds)
	require.EqualValues(t, 3, computations(t, reg))

	_, err = r.Completeness(ctx, e.Pool, "2026-13", "", false)
	require.Error(t, err, "a malformed month is refused before anything is read")
}

func TestConcurrentReportsShareOneComputation(t *testing.T) {
	t.Parallel()
	e := newSnapshotEnv(t)
	e.post(t, "acme", 5)
	reg := prometheus.NewRegistry()
	// MaxAge zero: without sharing, every request would compute.
	r, err := NewReports(0, reg)
	require.NoError(t, err)

	release := holdScope(t, e.Pool, e.month)
	const n = 20
	var wg sync.WaitGroup
	got := make([]Completeness, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = r.Completeness(e.Ctx, e.Pool, e.month, "", false)
		}()
	}
	require.Eventually(t, func() bool { return r.waiting(flightKey{scope: e.month}) == n }, 10*time.Second, 5*time.Millisecond)
	// The computation may reach the lock a moment after the twenty wait on
	// it: one waits there, never more.
	require.Eventually(t, func() bool { return advisoryWaiters(t, e.Pool) == 1 }, 10*time.Second, 5*time.Millisecond,
		"one computation waits for the scope's lock")
	require.Never(t, func() bool { return advisoryWaiters(t, e.Pool) > 1 }, 200*time.Millisecond, 10*time.Millisecond,
		"one computation waits for the scope's lock, not twenty")
	release()
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, got[0], got[i])
	}
	require.Equal(t, "5", ingested(got[0]))
	require.EqualValues(t, 1, computations(t, reg))
	require.EqualValues(t, n, testutil.ToFloat64(r.metrics.answers.WithLabelValues(answerComputed)))
}

func TestTwoNodesComputeAMonthOnce(t *testing.T) {
	t.Parallel()
	e := newSnapshotEnv(t)
	e.post(t, "acme", 5)
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	a, err := NewReports(time.Hour, regA)
	require.NoError(t, err)
	b, err := NewReports(time.Hour, regB)
	require.NoError(t, err)

	for _, refresh := range []bool{false, true} {
		release := holdScope(t, e.Pool, e.month)
		var wg sync.WaitGroup
		var ca, cb Completeness
		var ea, eb error
		wg.Add(2)
		go func() { defer wg.Done(); ca, ea = a.Completeness(e.Ctx, e.Pool, e.month, "", refresh) }()
		go func() { defer wg.Done(); cb, eb = b.Completeness(e.Ctx, e.Pool, e.month, "", refresh) }()
		require.Eventually(t, func() bool { return advisoryWaiters(t, e.Pool) == 2 }, 10*time.Second, 5*time.Millisecond)
		release()
		wg.Wait()
		require.NoError(t, ea)
		require.NoError(t, eb)
		require.Equal(t, ca, cb, "refresh=%v: the second node answers the first one's snapshot", refresh)
		e.post(t, "acme", 1)
		// Age the snapshot so that the next round, not refreshing, computes.
		_, err = e.Pool.Exec(e.Ctx, `UPDATE report_snapshots SET computed_at = computed_at - interval '2 hours'`)
		require.NoError(t, err)
	}
	require.EqualValues(t, 2, computations(t, regA)+computations(t, regB), "one computation a round")
	require.EqualValues(t, 2, testutil.ToFloat64(a.metrics.answers.WithLabelValues(answerShared))+
		testutil.ToFloat64(b.metrics.answers.WithLabelValues(answerShared)))
}

func TestAReportWhoseClientsLeftStopsReading(t *testing.T) {
	t.Parallel()
	e := newSnapshotEnv(t)
	e.post(t, "acme", 5)
	r, err := NewReports(time.Hour, nil)
	require.NoError(t, err)

	release := holdScope(t, e.Pool, e.month)
	ctx, cancel := context.WithCancel(e.Ctx)
	done := make(chan error, 1)
	go func() {
		_, err := r.Completeness(ctx, e.Pool, e.month, "", false)
		done <- err
	}()
	require.Eventually(t, func() bool { return advisoryWaiters(t, e.Pool) == 1 }, 10*time.Second, 5*time.Millisecond)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.Eventually(t, func() bool { return advisoryWaiters(t, e.Pool) == 0 }, 5*time.Second, 5*time.Millisecond,
		"the computation's query is cancelled once nobody waits for it")
	require.Zero(t, r.waiting(flightKey{scope: e.month}))

	// The next request starts afresh, not with the cancelled computation.
	release()
	c, err := r.Completeness(e.Ctx, e.Pool, e.month, "", false)
	require.NoError(t, err)
	require.Equal(t, "5", ingested(c))
}

// waiting is how many requests wait for the flight of key (0: none runs).
func (r *Reports) waiting(key flightKey) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f, ok := r.flights[key]; ok {
		return f.waiters
	}
	return 0
}

func TestAComputationMayOutlastTheConnectionsStatementTimeout(t *testing.T) {
	t.Parallel()
	e := newSnapshotEnv(t)
	e.post(t, "acme", 5)
	// The reads pool's connections: every statement cut after 200 ms.
	cfg := e.Pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = "200"
	reads, err := pgxpool.NewWithConfig(e.Ctx, cfg)
	require.NoError(t, err)
	defer reads.Close()

	// computeHeld computes while another session holds a lock the
	// computation's query waits for, for 600 ms.
	computeHeld := func(r *Reports) error {
		lock, err := e.Pool.Begin(e.Ctx)
		require.NoError(t, err)
		_, err = lock.Exec(e.Ctx, `LOCK TABLE tenant_mappings IN ACCESS EXCLUSIVE MODE`)
		require.NoError(t, err)
		go func() {
			time.Sleep(600 * time.Millisecond)
			_ = lock.Rollback(e.Ctx)
		}()
		_, err = r.Completeness(e.Ctx, reads, e.month, "", true)
		return err
	}

	r, err := NewReports(time.Hour, nil)
	require.NoError(t, err)
	require.ErrorContains(t, computeHeld(r), "57014", "without Timeout, the connection's statement timeout cuts it")

	r.Timeout = 10 * time.Second
	require.NoError(t, computeHeld(r), "with Timeout, it runs as long as the computation needs, up to Timeout")
}
