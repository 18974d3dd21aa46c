package quarantine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Reports answers the completeness report from snapshots (report_snapshots):
// a request reads the month's latest snapshot while it is younger than
// MaxAge, and otherwise waits for one computation of the month, every
// tenant at once, that every request asking meanwhile shares — on this node
// by waiting for it in memory, across nodes by the scope's advisory lock.
// However many reports are asked for, the month's counters are read at
// most once per month and MaxAge; a report is never computed per request.
//
// A computation runs while at least one request waits for it: when the last
// one leaves (its client went away), its queries are cancelled.
type Reports struct {
	// MaxAge is how old a snapshot may be and still answer. Zero computes
	// for every request that finds no computation running.
	MaxAge time.Duration
	// Timeout bounds each statement of a computation in place of its
	// connection's statement_timeout: one computation serves every request
	// for the month, so it may run longer than one request's reads. Zero
	// keeps the connection's.
	Timeout time.Duration
	// Archived, when set, answers a month whose ledger has left the
	// database from its archive (ok true), in place of the counters.
	Archived func(ctx context.Context, q pgdb.Beginner, period string) (c Completeness, ok bool, err error)

	mu      sync.Mutex
	flights map[flightKey]*flight
	// latest is each month's snapshot as this node last read it, decoded:
	// a request whose snapshot is the same reads none of it again.
	latest  map[string]*snapshot
	metrics *reportMetrics
}

// snapshot is one computation of a month's report. It is shared by every
// request answered from it: nobody modifies it.
type snapshot struct {
	at   time.Time // computed_at
	body []byte    // the report, every tenant, as JSON (a line)
	c    Completeness
}

// DefaultReportTimeout is serve's Reports.Timeout (TALLY_REPORT_TIMEOUT).
const DefaultReportTimeout = 2 * time.Minute

// NewReports returns Reports whose snapshots answer while younger than
// maxAge, with its metrics on reg (nil: none), computing with the
// connection's statement timeout (set Timeout for another).
func NewReports(maxAge time.Duration, reg prometheus.Registerer) (*Reports, error) {
	r := &Reports{MaxAge: maxAge, flights: map[flightKey]*flight{}, latest: map[string]*snapshot{}}
	if reg != nil {
		m, err := newReportMetrics(reg)
		if err != nil {
			return nil, err
		}
		r.metrics = m
	}
	return r, nil
}

// flightKey names one computation: a refresh and a plain read of the same
// scope are separate flights, so that a refresh never takes a snapshot that
// was already too old for it (see Completeness).
type flightKey struct {
	scope   string
	refresh bool
}

// flight is one computation and the requests waiting for it.
type flight struct {
	done    chan struct{}
	snap    *snapshot
	source  string // answerComputed or answerShared
	err     error
	waiters int
	cancel  context.CancelFunc
}

// The ways a request was answered, for tally_report_answers_total.
const (
	answerSnapshot = "snapshot" // a snapshot young enough, without waiting
	answerComputed = "computed" // a computation, its own or shared
	answerShared   = "shared"   // another node's snapshot found under the lock
)

// Completeness is the completeness report of the month period ("YYYY-MM"),
// of one tenant or all (tenant ""), as of its snapshot's AsOf. Without
// refresh it answers the month's snapshot while younger than MaxAge. With
// refresh it answers a snapshot computed after the request began, or the
// result of a computation of the month already running on this node when
// it came (which began a moment earlier): an operator's "refresh" never
// starts a second reading of the counters while one runs. Its Lines are
// shared with other answers: read them, never modify them.
func (r *Reports) Completeness(ctx context.Context, db pgdb.Beginner, period, tenant string, refresh bool) (Completeness, error) {
	snap, err := r.snapshotOf(ctx, db, period, refresh)
	if err != nil {
		return Completeness{}, err
	}
	return snap.c.ofTenant(tenant), nil
}

// CompletenessJSON is Completeness as JSON: for every tenant, the
// snapshot's own bytes, encoded once for every request it answers.
func (r *Reports) CompletenessJSON(ctx context.Context, db pgdb.Beginner, period, tenant string, refresh bool) ([]byte, error) {
	snap, err := r.snapshotOf(ctx, db, period, refresh)
	if err != nil {
		return nil, err
	}
	if tenant == "" {
		return snap.body, nil
	}
	return json.Marshal(snap.c.ofTenant(tenant))
}

// snapshotOf finds the snapshot that answers a request for period: the
// month's latest while young enough (unless refresh), else the result of
// the month's computation.
func (r *Reports) snapshotOf(ctx context.Context, db pgdb.Beginner, period string, refresh bool) (*snapshot, error) {
	if _, _, err := ParsePeriod(period); err != nil {
		return nil, err
	}
	if !refresh {
		snap, err := r.fresh(ctx, db, period)
		if err != nil {
			return nil, err
		}
		if snap != nil {
			r.metrics.answered(answerSnapshot)
			return snap, nil
		}
	}
	snap, source, err := r.join(ctx, db, flightKey{scope: period, refresh: refresh})
	if err != nil {
		return nil, err
	}
	r.metrics.answered(source)
	return snap, nil
}

// sqlFreshSnapshot reads a scope's snapshot when younger than @max_age, by
// the database's clock on both sides; its body only when it is not the one
// this node holds (@known, its computed_at).
const sqlFreshSnapshot = `
SELECT computed_at, CASE WHEN computed_at = @known::timestamptz THEN NULL ELSE body END
FROM report_snapshots
WHERE report = 'completeness' AND scope = @scope AND computed_at > clock_timestamp() - @max_age::interval`

// fresh is the month's snapshot when it is younger than MaxAge, nil when
// there is none.
func (r *Reports) fresh(ctx context.Context, db pgdb.Querier, period string) (*snapshot, error) {
	if r.MaxAge <= 0 {
		return nil, nil
	}
	r.mu.Lock()
	held := r.latest[period]
	r.mu.Unlock()
	var known *time.Time
	if held != nil {
		known = &held.at
	}
	var (
		at   time.Time
		body []byte
	)
	err := db.QueryRow(ctx, sqlFreshSnapshot, pgx.NamedArgs{"scope": period, "max_age": r.MaxAge, "known": known}).Scan(&at, &body)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading a completeness snapshot: %w", err)
	}
	if body == nil {
		return held, nil
	}
	return r.keep(period, at, body)
}

// keep decodes a snapshot of period read from the database and, unless
// this node holds a later one, holds it.
func (r *Reports) keep(period string, at time.Time, body []byte) (*snapshot, error) {
	snap := &snapshot{at: at}
	if err := json.Unmarshal(body, &snap.c); err != nil {
		return nil, fmt.Errorf("quarantine: reading a completeness snapshot: %w", err)
	}
	for i := range snap.c.Lines {
		if snap.c.Lines[i].Accounts == nil {
			// A snapshot taken before lines named their accounts (migration
			// 28's version): none known, never null.
			snap.c.Lines[i].Accounts = []string{}
		}
	}
	// Encoded again, once: jsonb keeps its keys in an order of its own,
	// and the answers keep the report's.
	out, err := json.Marshal(snap.c)
	if err != nil {
		return nil, err
	}
	snap.body = append(out, '\n')
	r.mu.Lock()
	if held := r.latest[period]; held == nil || !held.at.After(at) {
		r.latest[period] = snap
	}
	r.mu.Unlock()
	return snap, nil
}

// join waits for the flight of key, starting it when none runs, until it
// ends or ctx does. The flight runs on a context of its own, cancelled when
// its last waiter leaves.
func (r *Reports) join(ctx context.Context, db pgdb.Beginner, key flightKey) (snap *snapshot, source string, err error) {
	r.mu.Lock()
	f, ok := r.flights[key]
	if !ok {
		fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		f = &flight{done: make(chan struct{}), cancel: cancel}
		r.flights[key] = f
		go r.fly(fctx, db, key, f)
	}
	f.waiters++
	r.mu.Unlock()

	select {
	case <-f.done:
		return f.snap, f.source, f.err
	case <-ctx.Done():
		r.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			// Nobody waits for it any more: stop reading the counters, and
			// let the next request start afresh.
			f.cancel()
			if r.flights[key] == f {
				delete(r.flights, key)
			}
		}
		r.mu.Unlock()
		return nil, "", ctx.Err()
	}
}

// fly runs flight f of key and ends it.
func (r *Reports) fly(ctx context.Context, db pgdb.Beginner, key flightKey, f *flight) {
	at, body, source, err := r.compute(ctx, db, key)
	var snap *snapshot
	if err == nil {
		snap, err = r.keep(key.scope, at, body)
	}
	r.mu.Lock()
	f.snap, f.source, f.err = snap, source, err
	if r.flights[key] == f {
		delete(r.flights, key)
	}
	r.mu.Unlock()
	f.cancel()
	close(f.done)
}

// The statements of a computation, in its transaction. The lock is the
// scope's across every node; under it, a snapshot another node computed
// while this one waited answers (for a refresh, one computed after this
// transaction began). Otherwise the start of the computation is noted in
// the transaction (so that computed_at is the database's clock before the
// counters were read, never a time read into Go), the report computed and the
// snapshot replaced.
const (
	sqlSnapshotLock = `SELECT pg_advisory_xact_lock(hashtextextended('tally.report_snapshots:completeness:' || @scope, 0))`

	sqlSnapshotUnderLock = `
SELECT computed_at, body FROM report_snapshots
WHERE report = 'completeness' AND scope = @scope
  AND (computed_at >= transaction_timestamp() OR (NOT @refresh AND computed_at > clock_timestamp() - @max_age::interval))`

	sqlSnapshotStart = `SELECT set_config('tally.report_started', clock_timestamp()::text, true)`

	sqlSnapshotTimeout = `SELECT set_config('statement_timeout', @ms::text, true)`

	sqlSnapshotStore = `
WITH started AS (SELECT current_setting('tally.report_started')::timestamptz AS at)
INSERT INTO report_snapshots (report, scope, body, computed_at, took)
SELECT 'completeness', @scope,
       jsonb_set(@body::jsonb, '{as_of}', to_jsonb(to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))),
       at, clock_timestamp() - at
FROM started
ON CONFLICT (report, scope) DO UPDATE SET body = EXCLUDED.body, computed_at = EXCLUDED.computed_at, took = EXCLUDED.took
RETURNING computed_at, body`
)

// compute makes the snapshot of key's month under the scope's lock, or
// takes the one another node made meanwhile, and returns its computed_at,
// its body and which it was (answerComputed or answerShared).
func (r *Reports) compute(ctx context.Context, db pgdb.Beginner, key flightKey) (at time.Time, body []byte, source string, err error) {
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlSnapshotLock, pgx.NamedArgs{"scope": key.scope}); err != nil {
			return err
		}
		maxAge := max(r.MaxAge, 0)
		err := tx.QueryRow(ctx, sqlSnapshotUnderLock, pgx.NamedArgs{"scope": key.scope, "refresh": key.refresh || maxAge == 0,
			"max_age": maxAge}).Scan(&at, &body)
		if err == nil {
			source = answerShared
			return nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		if _, err := tx.Exec(ctx, sqlSnapshotStart); err != nil {
			return err
		}
		if r.Timeout > 0 {
			if _, err := tx.Exec(ctx, sqlSnapshotTimeout, pgx.NamedArgs{"ms": strconv.FormatInt(r.Timeout.Milliseconds(), 10)}); err != nil {
				return err
			}
		}
		// Every computation is timed, the ones cut short too.
		began := time.Now()
		defer func() { r.metrics.took(time.Since(began)) }()
		c, err := r.completenessOf(ctx, tx, key.scope)
		if err != nil {
			return err
		}
		if at, body, err = c.stored(ctx, tx, key.scope); err != nil {
			return err
		}
		source = answerComputed
		return nil
	})
	if err != nil {
		return time.Time{}, nil, "", fmt.Errorf("quarantine: computing the completeness report: %w", err)
	}
	return at, body, source, nil
}

// completenessOf is period's report, priced: from its archive once its
// ledger has left (r.Archived), else from the counters.
func (r *Reports) completenessOf(ctx context.Context, tx pgx.Tx, period string) (Completeness, error) {
	if r.Archived != nil {
		c, ok, err := r.Archived(ctx, tx, period)
		if err != nil {
			return Completeness{}, err
		}
		if ok {
			c.Period, c.Archived, c.AsOf = period, true, ""
			return c, c.addMoney(ctx, tx)
		}
	}
	c, err := CompletenessOf(ctx, tx, period, "")
	if err != nil {
		return Completeness{}, err
	}
	return c, c.addMoney(ctx, tx)
}

// stored writes c as the snapshot of scope and returns its computed_at and
// the body written: c with its AsOf, computed_at, set by the database.
func (c Completeness) stored(ctx context.Context, tx pgx.Tx, scope string) (at time.Time, body []byte, err error) {
	in, err := json.Marshal(c)
	if err != nil {
		return time.Time{}, nil, err
	}
	err = tx.QueryRow(ctx, sqlSnapshotStore, pgx.NamedArgs{"scope": scope, "body": in}).Scan(&at, &body)
	return at, body, err
}

// ofTenant is the report narrowed to one tenant's lines ("" keeps all),
// its Holds recomputed over them.
func (c Completeness) ofTenant(tenant string) Completeness {
	if tenant == "" {
		return c
	}
	out := c
	out.Lines, out.Holds = []Line{}, true
	for _, l := range c.Lines {
		if l.Tenant == tenant {
			out.Lines = append(out.Lines, l)
			out.Holds = out.Holds && l.Holds
		}
	}
	out.sumAmounts()
	return out
}

// reportMetrics count how reports were answered and time their
// computations, without a tenant.
type reportMetrics struct {
	answers  *prometheus.CounterVec
	duration prometheus.Histogram
}

func newReportMetrics(reg prometheus.Registerer) (*reportMetrics, error) {
	m := &reportMetrics{
		answers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tally_report_answers_total",
			Help: "Completeness reports answered, by source: snapshot (young enough, no wait), computed (this node read the counters, for this request alone or for several waiting together), shared (another node's computation, found under the lock)."},
			[]string{"source"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "tally_report_computation_seconds",
			Help:    "Time each computation of a completeness report took, finished or cut short (reading the counters of one month, every tenant).",
			Buckets: []float64{0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60}}),
	}
	for _, c := range []prometheus.Collector{m.answers, m.duration} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, s := range []string{answerSnapshot, answerComputed, answerShared} {
		m.answers.WithLabelValues(s)
	}
	return m, nil
}

func (m *reportMetrics) answered(source string) {
	if m != nil {
		m.answers.WithLabelValues(source).Inc()
	}
}

func (m *reportMetrics) took(d time.Duration) {
	if m != nil {
		m.duration.Observe(d.Seconds())
	}
}
