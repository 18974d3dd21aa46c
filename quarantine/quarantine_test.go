package quarantine_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type bundle struct {
	*stagetest.Env
	requeuer *quarantine.Requeuer
}

func setup(t *testing.T) *bundle { return setupWith(t, outbox.Config{}) }

func setupWith(t *testing.T, cfg outbox.Config) *bundle {
	e := stagetest.New(t, cfg)
	return &bundle{Env: e, requeuer: &quarantine.Requeuer{Outbox: e.Outbox, Stager: e.Stager}}
}

var (
	ago = stagetest.Ago
	ev  = stagetest.Ev
)

// itemOf returns the item a ledger event was staged into.
func (b *bundle) itemOf(t *testing.T, tenant, eventID string) outbox.Item {
	t.Helper()
	var id int64
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT item_id FROM usage_events WHERE tenant = $1 AND event_id = $2`, tenant, eventID).Scan(&id))
	it, err := b.Outbox.Get(b.Ctx, b.Pool, id)
	require.NoError(t, err)
	return it
}

func TestRequeueReaddressesAfterMappingFix(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.MustIngest(t, ev("a", "acme", "api", 5, ago(3*time.Hour)), ev("b", "acme", "api", 6, ago(3*time.Hour)))
	b.Pass(t)
	old := b.itemOf(t, "acme", "a")
	require.Equal(t, outbox.StateQuarantined, old.State)
	require.Equal(t, outbox.ReasonNoCustomer, old.QuarantineReason)

	// Not fixed yet: still ineligible.
	_, err := b.requeuer.Requeue(b.Ctx, b.Pool, old.ID, old.MappingVersion, "test")
	var ie *quarantine.StillIneligibleError
	require.ErrorAs(t, err, &ie)
	require.Equal(t, outbox.ReasonNoCustomer, ie.Reason)

	tn := b.Tenant(t, "acme", nil)
	// The version the operator looked at before the fix is stale now.
	_, err = b.requeuer.Requeue(b.Ctx, b.Pool, old.ID, old.MappingVersion, "test")
	require.ErrorIs(t, err, outbox.ErrMappingChanged)
	require.True(t, quarantine.IsConflict(err))

	res, err := b.requeuer.Requeue(b.Ctx, b.Pool, old.ID, tn.Version, "test")
	require.NoError(t, err)
	require.Equal(t, quarantine.ActionReaddressed, res.Action)
	require.NotNil(t, res.Successor)
	// The operator's action is in the audit log, the refusals are not.
	trail, err := audit.List(b.Ctx, b.Pool, audit.Item(old.ID), 10)
	require.NoError(t, err)
	require.Len(t, trail, 1)
	require.Equal(t, audit.ActionReaddress, trail[0].Action)
	require.Equal(t, "test", trail[0].Actor)
	require.Equal(t, "quarantined", trail[0].From)
	require.Equal(t, "superseded", trail[0].To)
	require.EqualValues(t, *res.Successor, trail[0].Details["successor"])

	closed, err := b.Outbox.Get(b.Ctx, b.Pool, old.ID)
	require.NoError(t, err)
	require.Equal(t, outbox.StateSuperseded, closed.State)
	require.Equal(t, *res.Successor, *closed.SupersededBy)
	succ, err := b.Outbox.Get(b.Ctx, b.Pool, *res.Successor)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, succ.State)
	require.Equal(t, old.SubjectRef, succ.SubjectRef)
	require.Equal(t, int64(11), succ.Payload.Value, "rebuilt from the ledger rows")
	require.Equal(t, "cus_acme", succ.Payload.Customer)
	require.Equal(t, tn.Version, succ.MappingVersion)
	require.NotEqual(t, old.Identifier, succ.Identifier)

	// Counted once: the completeness report attributes both rows to the
	// successor's state.
	c, err := quarantine.CompletenessOf(b.Ctx, b.Pool, time.Now().UTC().Add(-3*time.Hour).Format("2006-01"), "acme")
	require.NoError(t, err)
	require.True(t, c.Holds)
	require.Equal(t, quarantine.Bucket{Events: 2, Value: quarantine.ValueOf(11)}, c.Lines[0].Pending)
	require.Equal(t, quarantine.Bucket{}, c.Lines[0].Quarantined)

	_, err = b.requeuer.Requeue(b.Ctx, b.Pool, old.ID, tn.Version, "test")
	var se *outbox.StateError
	require.ErrorAs(t, err, &se, "a superseded item is not quarantined")
}

// An item one attempt of which may have reached Stripe keeps its
// identifier for good: after a timeout and then Stripe's "no meter" at the
// next attempt, the operator creates the meter and requeues it in place
// (T9), and the resend carries the same identifier, which Stripe
// deduplicates if the first attempt was recorded after all.
func TestRequeueInPlaceKeepsIdentifier(t *testing.T) {
	t.Parallel()
	b := setupWith(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	f := b.Feature(t, "api", mappings.Sum, time.Hour)
	tn := b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("a", "acme", "api", 5, ago(3*time.Hour)))
	b.Pass(t)
	leases, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	_, err = b.Outbox.Retry(b.Ctx, b.Pool, leases[0], outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		leases, err = b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
		return err == nil && len(leases) == 1
	}, 5*time.Second, 5*time.Millisecond)
	// Stripe had no meter at send time (what the deliverer records, T6).
	require.NoError(t, b.Outbox.Quarantine(b.Ctx, b.Pool, leases[0], outbox.ReasonMeterNotFound, outbox.ErrorInfo{Code: "meter_not_found", Status: 400}))

	version := max(f.Version, tn.Version)
	res, err := b.requeuer.Requeue(b.Ctx, b.Pool, leases[0].ID, version, "test")
	require.NoError(t, err)
	require.Equal(t, quarantine.RequeueResult{ItemID: leases[0].ID, Action: quarantine.ActionRequeued, MappingVersion: version}, res)
	it, err := b.Outbox.Get(b.Ctx, b.Pool, leases[0].ID)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, it.State)
	require.Equal(t, leases[0].Identifier, it.Identifier)
}

func TestRequeueRefusesWhatMayHaveReachedStripe(t *testing.T) {
	t.Parallel()
	b := setupWith(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	b.Feature(t, "api", mappings.Sum, time.Hour)
	tn := b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("a", "acme", "api", 5, ago(3*time.Hour)))
	b.Pass(t)
	// A timeout (may have landed), then at the next claim a quarantine.
	l, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
	require.NoError(t, err)
	_, err = b.Outbox.Retry(b.Ctx, b.Pool, l[0], outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)
	require.Eventually(t, func() bool { // once the short backoff has passed
		l, err = b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
		return err == nil && len(l) == 1
	}, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, b.Outbox.Quarantine(b.Ctx, b.Pool, l[0], outbox.ReasonCustomerNotFound, outbox.ErrorInfo{Code: "customer_not_found", Status: 400}))

	// The operator points the tenant at the right customer: re-addressing
	// would give the usage a new identifier, and it may be at Stripe already.
	tn2, _, err := b.Maps.PutTenant(b.Ctx, b.Pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_right"}, "test")
	require.NoError(t, err)
	require.Greater(t, tn2.Version, tn.Version)
	_, err = b.requeuer.Requeue(b.Ctx, b.Pool, l[0].ID, tn2.Version, "test")
	require.ErrorIs(t, err, outbox.ErrMayHaveReached)
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*) FROM outbox_items`).Scan(&n))
	require.Equal(t, 1, n, "the successor was rolled back with the refusal")
}

func TestRequeueAggregationChanged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.MustIngest(t, ev("a", "acme", "api", 5, ago(3*time.Hour)))
	b.Pass(t)
	old := b.itemOf(t, "acme", "a")
	f := b.Feature(t, "api", mappings.Count, time.Hour)
	tn := b.Tenant(t, "acme", nil)
	_, err := b.requeuer.Requeue(b.Ctx, b.Pool, old.ID, max(f.Version, tn.Version), "test")
	require.ErrorIs(t, err, meter.ErrAggregationChanged)
}

func TestQuarantineReportAndCSV(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t,
		ev("u1", "acme", "mystery", 3, ago(3*time.Hour)), ev("u2", "acme", "mystery", -1, ago(3*time.Hour)),
		ev("n1", "nobody", "api", 4, ago(3*time.Hour)), ev("n2", "nobody", "api", 5, ago(3*time.Hour)),
		ev("ok", "acme", "api", 9, ago(3*time.Hour)))
	b.Pass(t)
	rep, err := quarantine.Quarantined(b.Ctx, b.Pool, quarantine.Filter{})
	require.NoError(t, err)
	require.Len(t, rep.Groups, 2)
	byReason := map[string]quarantine.ReasonTotal{}
	for _, tot := range rep.Totals {
		byReason[tot.Reason] = tot
	}
	require.Equal(t, quarantine.ReasonTotal{Reason: "feature_unmapped", Items: 2, Events: 2, Value: quarantine.ValueOf(2)}, byReason["feature_unmapped"])
	require.Equal(t, quarantine.ReasonTotal{Reason: "no_customer", Items: 1, Events: 2, Value: quarantine.ValueOf(9)}, byReason["no_customer"])

	only, err := quarantine.Quarantined(b.Ctx, b.Pool, quarantine.Filter{Reason: "no_customer", Tenant: "nobody"})
	require.NoError(t, err)
	require.Len(t, only.Groups, 1)
	none, err := quarantine.Quarantined(b.Ctx, b.Pool, quarantine.Filter{Period: "2001-01"})
	require.NoError(t, err)
	require.Empty(t, none.Groups)

	var buf bytes.Buffer
	require.NoError(t, rep.CSV(&buf))
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Equal(t, "reason,tenant,feature,period,items,events,value", lines[0])
	require.Len(t, lines, 3)
	var table bytes.Buffer
	require.NoError(t, rep.Table(&table))
	require.Contains(t, table.String(), "feature_unmapped")
}

func TestSafeCell(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"=SUM(A1)": "'=SUM(A1)", "+1": "'+1", "-2": "'-2", "@x": "'@x", "\tx": "'\tx", "\rx": "'\rx",
		"acme": "acme", "": "", "a=b": "a=b",
	} {
		require.Equal(t, want, quarantine.SafeCell(in))
	}
}

// TestConservationProperty runs random workloads — tenants with and without
// mappings and anchors, features of every aggregation and none, windows,
// late rows, corrections, duplicates, a mapping change half-way, and
// concurrent stagers on separate connections — and then proves that every
// ledger row is in exactly one item and that the conservation identity holds
// for every tenant, feature and period.
func TestConservationProperty(t *testing.T) {
	t.Parallel()
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprintf("seed-%d", seed), func(t *testing.T) {
			t.Parallel()
			runConservation(t, seed)
		})
	}
}

// postedKey names a posted event.
type postedKey struct{ tenant, id string }

// workload makes the random events of one conservation run from its seeded
// source and remembers every event posted, by tenant and identifier.
type workload struct {
	rng      *rand.Rand
	tenants  []string
	features []string
	posted   map[postedKey]meter.Event
	next     int
}

// event is a new random event: a random tenant and feature (mapped or
// not), a random value (a tenth of them corrections), a timestamp in a
// closed window.
func (w *workload) event() meter.Event {
	w.next++
	// Between 2h10m and 40 days ago: every window is closed, some rows
	// fall in last month, some outside Stripe's 35 days.
	age := 130*time.Minute + time.Duration(w.rng.Int64N(int64(40*24*time.Hour)))
	if w.rng.IntN(3) > 0 {
		age = 130*time.Minute + time.Duration(w.rng.Int64N(int64(12*time.Hour)))
	}
	v := int64(w.rng.IntN(50))
	if w.rng.IntN(10) == 0 {
		v = -v // a correction
	}
	return ev(fmt.Sprintf("e%d", w.next), w.tenants[w.rng.IntN(len(w.tenants))], w.features[w.rng.IntN(len(w.features))], v, ago(age))
}

// batch is 150 new events and, again and unchanged, about one in forty of
// the events posted before; it remembers the new ones as posted.
func (w *workload) batch() []meter.Event {
	var batch []meter.Event
	for i := 0; i < 150; i++ {
		e := w.event()
		batch = append(batch, e)
		w.posted[postedKey{e.Tenant, e.ID}] = e
	}
	// Duplicates: earlier events posted again, unchanged.
	for _, e := range w.posted {
		if w.rng.IntN(40) == 0 {
			batch = append(batch, e)
		}
	}
	return batch
}

// stageConcurrently runs three stager passes at once, each on its own
// connection.
func stageConcurrently(t *testing.T, b *bundle) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(b.Ctx, testdb.URLOf(t, b.Pool))
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(b.Ctx)
			_, err = b.Stager.Pass(b.Ctx, conn)
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// runConservation is one run of TestConservationProperty, its workload
// drawn from seed.
func runConservation(t *testing.T, seed uint64) {
	b := setup(t)
	w := &workload{rng: rand.New(rand.NewPCG(seed, 99)), posted: map[postedKey]meter.Event{}}
	b.Feature(t, "calls", mappings.Sum, time.Hour)
	b.Feature(t, "minutes", mappings.Sum, 15*time.Minute)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.Feature(t, "logins", mappings.Count, time.Hour)
	anchor := time.Now().UTC().AddDate(0, -2, 0).Truncate(time.Hour).Add(30 * time.Minute)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "beta", &anchor)
	w.tenants = []string{"acme", "beta", "gamma"} // gamma has no mapping
	w.features = []string{"calls", "minutes", "seats", "logins", "unmapped"}

	for round := 0; round < 8; round++ {
		b.MustIngest(t, w.batch()...)
		if round == 4 {
			b.Feature(t, "calls", mappings.Sum, 15*time.Minute) // a mapping change half-way
		}
		stageConcurrently(t, b)
	}
	b.Pass(t)
	want := checkLedgerHoldsPosted(t, b, w.posted)
	checkConservation(t, b, w.posted, want)
}

// checkLedgerHoldsPosted checks that every ledger row is in exactly one
// item and that the ledger holds exactly what was posted, once; it returns
// the sum of the posted values.
func checkLedgerHoldsPosted(t *testing.T, b *bundle, posted map[postedKey]meter.Event) int64 {
	t.Helper()
	var rows, unstaged int
	var total int64
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*), count(*) FILTER (WHERE item_id IS NULL), coalesce(sum(value), 0) FROM usage_events`).
		Scan(&rows, &unstaged, &total))
	var want int64
	for _, e := range posted {
		want += e.Value
	}
	require.Equal(t, len(posted), rows)
	require.Equal(t, want, total)
	require.Zero(t, unstaged, "every closed window and every unmapped event older than its default window is staged")
	return want
}

// checkConservation checks the conservation identity for every tenant,
// feature and period the posted events touch, and that the periods
// together ingested want, the sum of the posted values.
func checkConservation(t *testing.T, b *bundle, posted map[postedKey]meter.Event, want int64) {
	t.Helper()
	months := map[string]bool{}
	for _, e := range posted {
		months[e.Timestamp.Format("2006-01")] = true
		months[e.Timestamp.AddDate(0, -1, 0).Format("2006-01")] = true // anchored periods start in the month before
	}
	var lines int
	var ingested quarantine.Value
	for m := range months {
		c, err := quarantine.CompletenessOf(b.Ctx, b.Pool, m, "")
		require.NoError(t, err)
		for _, l := range c.Lines {
			require.True(t, l.Holds, "%s %s %s: %+v", l.Tenant, l.Feature, l.Period, l)
			ingested = ingested.Plus(l.Ingested.Value)
			lines++
		}
	}
	require.Equal(t, quarantine.ValueOf(want).String(), ingested.String(), "every event is in exactly one period")
	require.Positive(t, lines)
}

// A supplement after a re-address is #1: the successor keeps its
// predecessor's ref, and refs, not items, are counted.
func TestSupplementNumberAfterReaddress(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	hour := time.Now().UTC().Add(-4 * time.Hour).Truncate(time.Hour)
	at := func(m int) *time.Time { v := hour.Add(time.Duration(m) * time.Minute); return &v }
	b.MustIngest(t, ev("a", "acme", "api", 5, at(10)))
	b.Pass(t)
	old := b.itemOf(t, "acme", "a")
	tn := b.Tenant(t, "acme", nil)
	_, err := b.requeuer.Requeue(b.Ctx, b.Pool, old.ID, tn.Version, "test")
	require.NoError(t, err)
	b.MustIngest(t, ev("late", "acme", "api", 2, at(20)))
	b.Pass(t)
	late := b.itemOf(t, "acme", "late")
	require.Equal(t, old.SubjectRef+"#1", late.SubjectRef)
}
