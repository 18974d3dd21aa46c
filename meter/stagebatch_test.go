package meter_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// The parts of n cover the hash range without a gap or an overlap.
func TestPartsCoverTheHashRange(t *testing.T) {
	t.Parallel()
	lo, hi := meter.Part{}.Range()
	require.Equal(t, int32(math.MinInt32), lo)
	require.Equal(t, int32(math.MaxInt32), hi)
	for _, n := range []int{1, 2, 3, 7, 64} {
		next := int64(math.MinInt32)
		for _, p := range meter.Parts(n) {
			lo, hi := p.Range()
			require.Equal(t, next, int64(lo), "part %d of %d starts where the previous ended", p.Index, n)
			require.LessOrEqual(t, lo, hi)
			next = int64(hi) + 1
		}
		require.Equal(t, int64(math.MaxInt32)+1, next, "the parts of %d end at the top of the range", n)
	}
}

// stagedItem is an item as staging made it, with the event ids of its rows.
type stagedItem struct {
	Tenant, Kind, Ref, Exporter, Account, Mode, State, Reason string
	Version                                                   int
	Payload                                                   string
	Events                                                    []string
}

// staged reads every item with the event ids of its rows, keyed by tenant
// and ref, for comparing two databases' staging (ids differ).
func staged(t *testing.T, e *stagetest.Env) map[string]stagedItem {
	t.Helper()
	rows, err := e.Pool.Query(e.Ctx, `SELECT o.tenant_key, o.subject_kind, o.subject_ref, o.exporter, o.destination_account, o.mode,
		o.state, coalesce(o.quarantine_reason, ''), o.mapping_version, o.payload::text,
		coalesce((SELECT array_agg(u.event_id ORDER BY u.event_id) FROM usage_events u WHERE u.item_id = o.id), '{}')
		FROM outbox_items o`)
	require.NoError(t, err)
	out := map[string]stagedItem{}
	var it stagedItem
	_, err = pgx.ForEachRow(rows, []any{&it.Tenant, &it.Kind, &it.Ref, &it.Exporter, &it.Account, &it.Mode, &it.State, &it.Reason,
		&it.Version, &it.Payload, &it.Events}, func() error {
		out[it.Tenant+"|"+it.Ref] = it
		return nil
	})
	require.NoError(t, err)
	return out
}

// mix is a seeded random mix of usage: tenants calendar-anchored, anchored
// mid-day (periods that start inside a window), on a connected account and
// unmapped; features sum, last and count of several widths, and one
// unmapped; values small, negative and past Stripe's 15 digits.
type mix struct {
	rng      *rand.Rand
	tenants  []string
	features []string
	n        int
}

func newMix(seed uint64) *mix {
	return &mix{rng: rand.New(rand.NewPCG(seed, 7)),
		tenants:  []string{"t-cal", "t-mid", "t-conn", "t-none", "t-cal2", "t-mid2"},
		features: []string{"s1m", "s15m", "s1h", "l1h", "l1d", "cnt", "unmapped"}}
}

func (m *mix) mapAll(t *testing.T, e *stagetest.Env) {
	t.Helper()
	e.Feature(t, "s1m", mappings.Sum, time.Minute)
	e.Feature(t, "s15m", mappings.Sum, 15*time.Minute)
	e.Feature(t, "s1h", mappings.Sum, time.Hour)
	e.Feature(t, "l1h", mappings.Last, time.Hour)
	e.Feature(t, "l1d", mappings.Last, 24*time.Hour)
	e.Feature(t, "cnt", mappings.Count, time.Hour)
	// A mid-day anchor 20 hours ago puts a period start inside the
	// windows of every width.
	anchor := time.Now().UTC().Add(-20*time.Hour).Truncate(time.Minute).Add(-7*time.Minute).AddDate(0, -2, 0)
	e.Tenant(t, "t-cal", nil)
	e.Tenant(t, "t-cal2", nil)
	e.Tenant(t, "t-mid", &anchor)
	e.Tenant(t, "t-mid2", &anchor)
	_, _, err := e.Maps.PutTenant(e.Ctx, e.Pool, "t-conn", mappings.TenantInput{StripeCustomerID: "cus_conn", StripeAccount: "acct_conn1"}, "test")
	require.NoError(t, err)
}

// events makes n events dated from minutes to two days back.
func (m *mix) events(n int, back time.Duration) []meter.Event {
	out := make([]meter.Event, n)
	for i := range out {
		m.n++
		f := m.features[m.rng.IntN(len(m.features))]
		v := int64(m.rng.IntN(100) - 5)
		switch {
		case f == "cnt":
			v = 1
		case f == "s1h" && m.rng.IntN(8) == 0:
			v = 600_000_000_000_000 // sums past 15 digits split; alone it fits
		}
		ts := stagetest.Ago(time.Duration(3*60+m.rng.Int64N(int64(back/time.Second))) * time.Second)
		out[i] = stagetest.Ev(fmt.Sprintf("e%d", m.n), m.tenants[m.rng.IntN(len(m.tenants))], f, v, ts)
	}
	return out
}

// The batched, partitioned passes make exactly the items the serial pass
// makes — refs, identities, states, reasons, payloads (values, timestamps,
// late marks) and the rows of each — on a random mix, late rows included.
func TestBatchedPassesStageAsTheSerialPass(t *testing.T) {
	t.Parallel()
	serial, batched := stagetest.New(t, outbox.Config{}), stagetest.New(t, outbox.Config{})
	for _, e := range []*stagetest.Env{serial, batched} {
		// Usage of a period whose invoice closed is late: quarantined.
		e.Target.InvoiceGrace, e.Target.LateUsage = 0, meter.LateQuarantine
	}
	meter.SetBatchBounds(batched.Stager, 3, 200) // many batches, a bucket cut off now and then
	m := newMix(42)
	m.mapAll(t, serial)
	m.mapAll(t, batched)
	stage := func() {
		_, err := meter.SerialPass(serial.Ctx, serial.Stager, serial.Pool)
		require.NoError(t, err)
		for _, p := range meter.Parts(3) {
			_, err := batched.Stager.PassPart(batched.Ctx, batched.Pool, p)
			require.NoError(t, err)
		}
	}
	for round, n := range []int{2000, 300, 300} {
		evs := m.events(n, 47*time.Hour)
		serial.MustIngest(t, evs...)
		batched.MustIngest(t, evs...)
		// Some windowed usage is cancelled before it is staged: it is
		// withdrawn, and its window is staged without it.
		var cs []meter.Cancellation
		for _, e := range evs {
			if len(cs) < 10 && (e.Feature == "s15m" || e.Feature == "l1h") {
				cs = append(cs, meter.Cancellation{Tenant: e.Tenant, ID: e.ID})
			}
		}
		for _, e := range []*stagetest.Env{serial, batched} {
			_, err := cancel(t, e, cs...)
			require.NoError(t, err)
		}
		stage()
		want, got := staged(t, serial), staged(t, batched)
		require.Len(t, got, len(want), "round %d", round)
		for k, w := range want {
			require.Equal(t, w, got[k], "round %d: %s", round, k)
		}
	}
	// The mix reached what it is for.
	seen := map[string]bool{}
	for _, it := range staged(t, serial) {
		seen["kind "+it.Kind] = true
		seen["reason "+it.Reason] = true
		seen["account "+it.Account] = true
		seen["state "+it.State] = true
		if strings.Contains(it.Ref, "#") {
			seen["supplement "+strings.Split(it.Ref, ":")[1]] = true
		}
	}
	for _, want := range []string{"kind " + outbox.SubjectUsageWindow, "kind " + outbox.SubjectUsageEvent, "reason ",
		"reason no_customer", "reason feature_unmapped", "reason period_closed", "account acct_conn1", "state withdrawn",
		"supplement s1h", "supplement l1h"} {
		require.True(t, seen[want], "the mix has no %s: %v", want, seen)
	}
	var unstaged int
	require.NoError(t, batched.Pool.QueryRow(batched.Ctx, `SELECT count(*) FROM usage_events WHERE item_id IS NULL
		AND occurred_at < clock_timestamp() - interval '3 minutes' - interval '1 day'`).Scan(&unstaged))
	require.Zero(t, unstaged, "everything a day old is staged")
}

// Passes over overlapping ranges (parts of 2, parts of 3 and the whole
// range, as after a change of TALLY_STAGE_WORKERS, or a pass still running
// from before a crash) at once never stage a window twice: each feature of
// each tenant is staged by whoever takes its advisory lock, and its rows
// are marked only while unstaged.
func TestOverlappingPartsNeverStageAWindowTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Minute)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	var evs []meter.Event
	sums := map[string]int64{}
	windows := map[string]bool{}
	for i := 0; i < 4000; i++ {
		tenant := fmt.Sprintf("t%02d", i%40)
		if i < 40 {
			b.Tenant(t, tenant, nil)
		}
		f := []string{"api", "seats"}[i%3%2]
		ts := ago(time.Duration(125+i%600) * time.Minute)
		evs = append(evs, ev(fmt.Sprintf("e%d", i), tenant, f, int64(i%11-2), ts))
		width := map[string]time.Duration{"api": time.Minute, "seats": time.Hour}[f]
		windows[tenant+"|"+meter.WindowOf(*ts, width, meter.CalendarAnchor).SubjectRef(f, 0)] = true
		if f == "api" {
			sums[tenant] += int64(i%11 - 2)
		}
	}
	b.MustIngest(t, evs...)
	var passes []meter.Part
	passes = append(passes, meter.Parts(2)...)
	passes = append(passes, meter.Parts(3)...)
	passes = append(passes, meter.Part{}, meter.Part{})
	var wg sync.WaitGroup
	errs := make(chan error, len(passes))
	for _, p := range passes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(b.Ctx, testdb.URLOf(t, b.Pool))
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(b.Ctx)
			for range 2 {
				if _, err := b.Stager.PassPart(b.Ctx, conn, p); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	b.Pass(t) // what a pass skipped while another held its feature
	require.Zero(t, b.unstaged(t))
	got := map[string]int64{}
	refs := map[string]bool{}
	rows := 0
	for k, it := range staged(t, b.Env) {
		refs[k] = true
		rows += len(it.Events)
	}
	r, err := b.Pool.Query(b.Ctx, `SELECT tenant_key, sum((payload->>'value')::bigint) FROM outbox_items
		WHERE payload->>'feature' = 'api' GROUP BY 1`)
	require.NoError(t, err)
	var tn string
	var s int64
	_, err = pgx.ForEachRow(r, []any{&tn, &s}, func() error {
		got[tn] = s
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, windows, refs, "one item per window, no supplement")
	require.Equal(t, 4000, rows, "every row in exactly one item")
	require.Equal(t, sums, got, "every unit once")
}

// killer runs a pass's transactions and cancels its context at the
// statement-th statement of the transaction after commits commits: a node
// killed in the middle of a batch.
type killer struct {
	*pgxpool.Pool
	cancel    context.CancelFunc
	commits   int32
	statement int
	committed atomic.Int32
}

func (k *killer) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	tx, err := k.Pool.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &killTx{Tx: tx, k: k}, nil
}

type killTx struct {
	pgx.Tx
	k *killer
	n int
}

func (t *killTx) step() {
	if t.n++; t.n == t.k.statement && t.k.committed.Load() == t.k.commits {
		t.k.cancel()
	}
}

func (t *killTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	t.step()
	return t.Tx.Query(ctx, sql, args...)
}

func (t *killTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	t.step()
	return t.Tx.QueryRow(ctx, sql, args...)
}

func (t *killTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t.step()
	return t.Tx.Exec(ctx, sql, args...)
}

func (t *killTx) Commit(ctx context.Context) error {
	err := t.Tx.Commit(ctx)
	if err == nil {
		t.k.committed.Add(1)
	}
	return err
}

// A pass killed in the middle of its second batch leaves the first batch's
// windows staged whole and nothing of the second's: each batch is one
// transaction. The next pass stages the rest, each window once.
func TestPassKilledBetweenBatches(t *testing.T) {
	t.Parallel()
	var evs []meter.Event
	for i := 0; i < 600; i++ {
		evs = append(evs, ev(fmt.Sprintf("e%d", i), fmt.Sprintf("t%d", i%6), "api", 1, ago(time.Duration(125+i%300)*time.Minute)))
	}
	for _, statement := range []int{1, 3, 4, 6, 7} {
		// Kill at the statement-th statement of the second batch (the
		// locks, the buckets, the rows, the counts, the checks, the
		// items, the marks), on a fresh copy each time.
		b := setup(t)
		b.Feature(t, "api", mappings.Sum, time.Hour)
		for i := range 6 {
			b.Tenant(t, fmt.Sprintf("t%d", i), nil)
		}
		b.MustIngest(t, evs...)
		meter.SetBatchBounds(b.Stager, 2, 1000) // three batches of two tenants
		ctx, cancel := context.WithCancel(b.Ctx)
		k := &killer{Pool: b.Pool, cancel: cancel, commits: 1, statement: statement}
		res, err := b.Stager.PassPart(ctx, k, meter.Part{})
		cancel()
		require.ErrorIs(t, err, context.Canceled, "statement %d", statement)
		require.Equal(t, 200, res.Events, "statement %d: the first batch's two tenants", statement)
		var partial int
		require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*) FROM (SELECT tenant FROM usage_events GROUP BY tenant
			HAVING count(item_id) NOT IN (0, count(*))) x`).Scan(&partial))
		require.Zero(t, partial, "statement %d: a tenant's rows are all staged or none", statement)
		var staged, tenants int
		require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*), count(DISTINCT tenant) FROM usage_events WHERE item_id IS NOT NULL`).
			Scan(&staged, &tenants))
		require.Equal(t, 200, staged, "statement %d", statement)
		require.Equal(t, 2, tenants, "statement %d", statement)

		// The killed session is closed in the background; until it is,
		// it holds its features' locks.
		require.Eventually(t, func() bool {
			var held int
			require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'`).Scan(&held))
			return held == 0
		}, 10*time.Second, 10*time.Millisecond)
		res = b.Pass(t)
		require.Equal(t, 400, res.Events, "statement %d: the next pass stages the rest", statement)
		require.Zero(t, b.unstaged(t))
		var items, refs int
		require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*), count(DISTINCT (tenant_key, split_part(subject_ref, '#', 1)))
			FROM outbox_items`).Scan(&items, &refs))
		require.Equal(t, refs, items, "statement %d: no window staged twice", statement)
		var sum int64
		require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT sum((payload->>'value')::bigint) FROM outbox_items`).Scan(&sum))
		require.Equal(t, int64(600), sum, "statement %d: every unit once", statement)
	}
}

// A batch that fails (here: the database refuses acme's items) is staged
// again one window a transaction: the other tenant's windows are staged,
// acme's rows stay unstaged and the error names each of its windows.
func TestFailedBatchIsStagedOneWindowATransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "beta", nil)
	hour := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t, ev("a1", "acme", "api", 5, in(1)), ev("a2", "acme", "api", 7, in(70)),
		ev("b1", "beta", "api", 3, in(2)), ev("b2", "beta", "api", 4, in(75)))
	_, err := b.Pool.Exec(b.Ctx, `
		CREATE FUNCTION refuse_acme() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		    IF NEW.tenant_key = 'acme' THEN RAISE EXCEPTION 'acme refused'; END IF;
		    RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_acme BEFORE INSERT ON outbox_item_bodies FOR EACH ROW EXECUTE FUNCTION refuse_acme();`)
	require.NoError(t, err)

	res, err := b.Stager.Pass(b.Ctx, b.Pool)
	require.ErrorContains(t, err, "acme/api")
	require.ErrorContains(t, err, "acme refused")
	for _, w := range []meter.Window{meter.WindowOf(*in(1), time.Hour, meter.CalendarAnchor), meter.WindowOf(*in(70), time.Hour, meter.CalendarAnchor)} {
		require.ErrorContains(t, err, w.SubjectRef("api", 0), "each of acme's windows failed on its own")
	}
	require.NotContains(t, err.Error(), "beta")
	require.Equal(t, meter.PassResult{Items: 2, Events: 2}, res, "beta's two windows")
	require.Equal(t, 2, b.unstaged(t), "acme's rows wait")
}
