package meter_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type bundle struct{ *stagetest.Env }

func setup(t *testing.T) *bundle { return &bundle{stagetest.New(t, outbox.Config{})} }

func at(s string) *time.Time {
	v, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return &v
}

var (
	ago = stagetest.Ago
	ev  = stagetest.Ev
)

type itemRow struct {
	id      int64
	ref     string
	kind    string
	state   outbox.State
	reason  string
	value   int64
	events  int
	version int
	payload outbox.Payload
}

func (b *bundle) items(t *testing.T) []itemRow {
	t.Helper()
	rows, err := b.Pool.Query(b.Ctx, `SELECT o.id, o.subject_ref, o.subject_kind, o.state, coalesce(o.quarantine_reason, ''),
		(o.payload->>'value')::bigint, (SELECT count(*) FROM usage_events e WHERE e.bucket = o.bucket AND e.item_id = o.id), o.mapping_version, o.payload
		FROM outbox_items o ORDER BY o.id`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (itemRow, error) {
		var it itemRow
		err := r.Scan(&it.id, &it.ref, &it.kind, &it.state, &it.reason, &it.value, &it.events, &it.version, &it.payload)
		return it, err
	})
	require.NoError(t, err)
	return out
}

func (b *bundle) unstaged(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, "SELECT count(*) FROM usage_events WHERE item_id IS NULL").Scan(&n))
	return n
}

// The Go period function and the database's agree.
func TestPeriodStartMatchesDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rng := rand.New(rand.NewPCG(3, 4))
	var ats, anchors []time.Time
	for i := 0; i < 5000; i++ {
		ats = append(ats, time.Unix(946684800+rng.Int64N(1_500_000_000), rng.Int64N(1e6)*1000).UTC())
		a := time.Unix(rng.Int64N(2_000_000_000), 0).UTC()
		if i%4 == 0 {
			a = time.Date(2020+rng.IntN(10), time.Month(1+rng.IntN(12)), 28+rng.IntN(4), rng.IntN(24), 0, 0, 0, time.UTC)
		}
		anchors = append(anchors, a)
	}
	rows, err := b.Pool.Query(b.Ctx, `SELECT tally_period_start(t, a) FROM unnest($1::timestamptz[], $2::timestamptz[]) WITH ORDINALITY AS u(t, a, n) ORDER BY n`, ats, anchors)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	for i := range ats {
		require.True(t, meter.PeriodStart(ats[i], anchors[i]).Equal(got[i]), "%s anchored %s: go %s, sql %s",
			ats[i], anchors[i], meter.PeriodStart(ats[i], anchors[i]), got[i])
	}
}

func TestIngestDuplicatesAndChangedContent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	t1 := at("2026-11-30T10:00:00Z")
	res := b.MustIngest(t, ev("e1", "acme", "api", 5, t1), ev("e2", "acme", "api", 7, nil), ev("e1", "acme", "api", 5, t1))
	require.Equal(t, meter.Result{Accepted: 2, Duplicates: 1, Unmapped: 2}, res, "a repeat inside the batch is a duplicate; acme and api have no mapping")

	// Re-posted with the same content: duplicates, also without a timestamp.
	res = b.MustIngest(t, ev("e1", "acme", "api", 5, t1), ev("e2", "acme", "api", 7, nil), ev("e3", "acme", "api", 1, nil))
	require.Equal(t, meter.Result{Accepted: 1, Duplicates: 2, Unmapped: 1}, res, "duplicates are not counted as unmapped again")

	// The same id for another tenant is another event.
	res = b.MustIngest(t, ev("e1", "other", "api", 5, t1))
	require.Equal(t, meter.Result{Accepted: 1, Unmapped: 1}, res)

	// Changed content: the batch fails and nothing of it is stored.
	changes := []meter.Event{
		ev("e1", "acme", "api", 6, t1),
		ev("e1", "acme", "other_feature", 5, t1),
		ev("e1", "acme", "api", 5, at("2026-11-30T10:00:01Z")),
		ev("e1", "acme", "api", 5, nil),
		ev("e2", "acme", "api", 7, t1),
	}
	for i, c := range changes {
		_, err := b.Ingest(t, ev(fmt.Sprintf("new-%d", i), "acme", "api", 1, nil), c)
		var ie *meter.InvalidBatchError
		require.ErrorAs(t, err, &ie, "change %d", i)
		require.Len(t, ie.Problems, 1)
		require.Equal(t, 1, *ie.Problems[0].Index)
		require.Equal(t, "id", ie.Problems[0].Field)
	}
	_, err := b.Ingest(t, ev("x", "acme", "api", 1, t1), ev("x", "acme", "api", 2, t1))
	var ie *meter.InvalidBatchError
	require.ErrorAs(t, err, &ie, "one id twice in a batch with different content")
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, "SELECT count(*) FROM usage_events").Scan(&n))
	require.Equal(t, 4, n, "nothing of a refused batch is stored")
}

func TestLedgerIsImmutable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.MustIngest(t, ev("e1", "acme", "api", 5, ago(3*time.Hour)))
	for _, q := range []string{
		"DELETE FROM usage_events",
		"TRUNCATE usage_events CASCADE",
		"UPDATE usage_events SET value = 6",
		"UPDATE usage_events SET occurred_at = now()",
	} {
		_, err := b.Pool.Exec(b.Ctx, q)
		require.Error(t, err, q)
	}
}

func TestStageSumWindowAndSupplement(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := b.Feature(t, "api", mappings.Sum, time.Hour)
	tn := b.Tenant(t, "acme", nil)
	hour := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t, ev("a", "acme", "api", 5, in(1)), ev("b", "acme", "api", 7, in(30)), ev("c", "acme", "api", -2, in(59)),
		ev("d", "acme", "api", 100, in(61)))

	res := b.Pass(t)
	require.Equal(t, meter.PassResult{Items: 2, Events: 4}, res)
	items := b.items(t)
	require.Len(t, items, 2)
	w := meter.WindowOf(hour, time.Hour, meter.CalendarAnchor)
	require.Equal(t, w.SubjectRef("api", 0), items[0].ref)
	require.Equal(t, int64(10), items[0].value, "5 + 7 - 2: a correction is part of the sum")
	require.Equal(t, 3, items[0].events)
	require.Equal(t, in(59).Unix(), items[0].payload.Timestamp, "the latest occurred_at")
	require.Equal(t, "cus_acme", items[0].payload.Customer)
	require.Equal(t, "api", items[0].payload.EventName)
	require.Equal(t, max(f.Version, tn.Version), items[0].version)
	require.Equal(t, outbox.StatePending, items[0].state)
	require.Equal(t, int64(100), items[1].value)

	// Late usage for a staged window: a supplement.
	b.MustIngest(t, ev("late1", "acme", "api", 4, in(10)), ev("late2", "acme", "api", 1, in(20)))
	require.Equal(t, meter.PassResult{Items: 1, Events: 2}, b.Pass(t))
	b.MustIngest(t, ev("late3", "acme", "api", 9, in(15)))
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, b.Pass(t))
	items = b.items(t)
	require.Len(t, items, 4)
	require.Equal(t, w.SubjectRef("api", 1), items[2].ref)
	require.Equal(t, int64(5), items[2].value)
	require.Equal(t, w.SubjectRef("api", 2), items[3].ref)
	require.Equal(t, int64(9), items[3].value)
	require.Zero(t, b.unstaged(t))
	require.Equal(t, meter.PassResult{}, b.Pass(t), "nothing left")
}

func TestStageWaitsForGrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Minute)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("now", "acme", "api", 1, nil))
	require.Equal(t, meter.PassResult{}, b.Pass(t), "the window is open")
	require.Equal(t, 1, b.unstaged(t))
}

func TestStageLastWindow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.Tenant(t, "acme", nil)
	hour := time.Now().UTC().Add(-5 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	// Posted out of order: the latest occurred_at wins, not the last posted.
	b.MustIngest(t, ev("a", "acme", "seats", 10, in(50)), ev("b", "acme", "seats", 3, in(5)), ev("c", "acme", "seats", 7, in(20)))
	b.Pass(t)
	items := b.items(t)
	require.Len(t, items, 1)
	require.Equal(t, int64(10), items[0].value)
	require.Equal(t, 3, items[0].events)
}

func TestStagePerEventAtIngest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("a|1", "acme", "calls", 1, nil), ev("b", "acme", "calls", 1, ago(time.Minute)))
	items := b.items(t)
	require.Len(t, items, 2, "staged in the ingest transaction, without waiting for a window")
	require.Equal(t, meter.EventSubjectRef("calls", "a|1"), items[0].ref)
	require.Equal(t, outbox.SubjectUsageEvent, items[0].kind)
	require.Equal(t, 1, items[0].events)
	require.Zero(t, b.unstaged(t))
}

func TestStageEveryReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t,
		ev("unmapped", "acme", "mystery", 3, ago(3*time.Hour)),        // feature_unmapped
		ev("no-customer", "nobody", "api", 4, ago(3*time.Hour)),       // no_customer
		ev("too-old", "acme", "api", 5, ago(40*24*time.Hour)),         // timestamp_window
		ev("too-old-event", "acme", "calls", 1, ago(40*24*time.Hour)), // timestamp_window, per event
		ev("correction", "acme", "calls", -1, nil),                    // count_value: a count meter counts events
		ev("fresh-unmapped", "acme", "mystery", 1, nil),               // feature_unmapped at once
	)
	b.Pass(t)
	got := map[string]string{}
	for _, it := range b.items(t) {
		require.Equal(t, outbox.StateQuarantined, it.state)
		got[it.payload.Feature+"/"+it.reason] = it.ref
	}
	require.Contains(t, got, "mystery/feature_unmapped")
	require.Contains(t, got, "api/no_customer")
	require.Contains(t, got, "api/timestamp_window")
	require.Contains(t, got, "calls/timestamp_window")
	require.Contains(t, got, "calls/count_value")
	require.Zero(t, b.unstaged(t), "unmapped usage is quarantined at the next pass, not after its default window")
	require.True(t, strings.HasPrefix(got["mystery/feature_unmapped"], "event:"), "unmapped usage is quarantined per event")

	// no_account: this node has no destination account.
	b.Target.Account = ""
	b.MustIngest(t, ev("no-account", "acme", "api", 8, ago(3*time.Hour)))
	b.Pass(t)
	var reason string
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT quarantine_reason FROM outbox_items o JOIN usage_events e ON e.item_id = o.id
		WHERE e.event_id = 'no-account'`).Scan(&reason))
	require.Equal(t, "no_account", reason)
}

func TestEventRefsNeverCollide(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "a:b", mappings.Count, time.Hour)
	b.Feature(t, "a", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("c", "acme", "a:b", 1, nil), ev("b:c", "acme", "a", 1, nil))
	items := b.items(t)
	require.Len(t, items, 2)
	require.NotEqual(t, items[0].ref, items[1].ref)
}

func TestPerEventWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	// Ahead of what Stripe accepts: not quarantined, staged once it is due.
	b.MustIngest(t, ev("early", "acme", "calls", 1, ago(-10*time.Minute)))
	require.Empty(t, b.items(t))
	require.Equal(t, meter.PassResult{}, b.Pass(t))
	require.Equal(t, 1, b.unstaged(t))

	// A tenant without a customer yet: its per-event usage, fresh or old,
	// is quarantined at once (in the ingest transaction), so that finance
	// sees it in the quarantine report; a mapping made later re-addresses
	// it on requeue.
	res := b.MustIngest(t, ev("fresh", "nobody", "calls", 1, nil), ev("old", "nobody", "calls", 1, ago(3*time.Hour)))
	require.Equal(t, 2, res.Unmapped, "the answer says how many accepted events have no mapping")
	items := b.items(t)
	require.Len(t, items, 2)
	for _, it := range items {
		require.Equal(t, "no_customer", it.reason)
	}
	// Once the customer is mapped, nothing is missing: new usage is staged
	// at once, pending.
	b.Tenant(t, "nobody", nil)
	res = b.MustIngest(t, ev("mapped", "nobody", "calls", 1, nil))
	require.Zero(t, res.Unmapped)
	items = b.items(t)
	require.Len(t, items, 3)
	require.Equal(t, outbox.StatePending, items[2].state)

	// Without a destination account, usage waits for its default window
	// and the grace: an operator can still supply the account.
	b.Target.Account = ""
	b.MustIngest(t, ev("no-account", "nobody", "calls", 1, nil))
	b.Pass(t)
	require.Len(t, b.items(t), 3)
	require.Equal(t, 2, b.unstaged(t), "the early event and the one waiting for an account")
}

func TestLastLateRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.Tenant(t, "acme", nil)
	hour := time.Now().UTC().Add(-5 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t, ev("a", "acme", "seats", 10, in(30)))
	b.Pass(t)
	// Late and older than the staged last value: it joins that item, and no
	// supplement re-sends an older value as the window's last.
	b.MustIngest(t, ev("older", "acme", "seats", 3, in(5)))
	require.Equal(t, meter.PassResult{Events: 1}, b.Pass(t))
	items := b.items(t)
	require.Len(t, items, 1)
	require.Equal(t, 2, items[0].events)
	require.Equal(t, int64(10), items[0].value)
	// Late and newer: a supplement with the new last value.
	b.MustIngest(t, ev("newer", "acme", "seats", 12, in(45)))
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, b.Pass(t))
	items = b.items(t)
	require.Len(t, items, 2)
	require.Equal(t, int64(12), items[1].value)
	require.True(t, strings.HasSuffix(items[1].ref, "#1"))
}

func TestStageStalledWithoutDestination(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.Stager.Target = func(context.Context) (meter.Target, bool) { return meter.Target{}, false }
	b.MustIngest(t, ev("a", "acme", "calls", 1, ago(3*time.Hour)))
	res := b.Pass(t)
	require.True(t, res.Stalled)
	require.Empty(t, b.items(t))
	require.Equal(t, 1, b.unstaged(t), "usage stays in the ledger, pending")
}

func TestStagePeriodCut(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	// The tenant's periods start at :30 past the hour, three hours ago.
	anchorAt := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
	b.Tenant(t, "acme", &anchorAt)
	hour := anchorAt.Add(-30 * time.Minute)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t, ev("before", "acme", "api", 1, in(10)), ev("after", "acme", "api", 2, in(40)))
	b.Pass(t)
	items := b.items(t)
	require.Len(t, items, 2, "the window is cut at the period boundary")
	require.NotEqual(t, items[0].payload.Period, items[1].payload.Period)
	require.Equal(t, anchorAt.Format(time.RFC3339), items[1].payload.Period)
}

func TestConcurrentStagersNeverDoubleCount(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Minute)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "beta", nil)
	var evs []meter.Event
	var total int64
	for i := 0; i < 3000; i++ {
		tenant := []string{"acme", "beta"}[i%2]
		evs = append(evs, ev(fmt.Sprintf("e%d", i), tenant, "api", int64(i%13-3), ago(time.Duration(5+i%300)*time.Minute)))
		total += int64(i%13 - 3)
	}
	b.MustIngest(t, evs...)
	errs := make(chan error, 6)
	for w := 0; w < 6; w++ {
		go func() {
			conn, err := pgx.Connect(b.Ctx, testdb.URLOf(t, b.Pool))
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(b.Ctx)
			for i := 0; i < 3; i++ {
				if _, err := b.Stager.Pass(b.Ctx, conn); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for w := 0; w < 6; w++ {
		require.NoError(t, <-errs)
	}
	b.Pass(t)
	require.Zero(t, b.unstaged(t))
	var sum int64
	var rows int
	for _, it := range b.items(t) {
		sum += it.value
		rows += it.events
	}
	require.Equal(t, total, sum, "every unit in exactly one item")
	require.Equal(t, 3000, rows)
}

var _ = errors.Is

// Two requests posting the same ids in opposite orders wait for each other:
// the ingest writes in (tenant, id) order.
func TestConcurrentIngestNeverDeadlocks(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for round := 0; round < 10; round++ {
		var fwd, rev []meter.Event
		for i := 0; i < 200; i++ {
			fwd = append(fwd, ev(fmt.Sprintf("r%d-%03d", round, i), "acme", "api", 1, ago(3*time.Hour)))
		}
		for i := len(fwd) - 1; i >= 0; i-- {
			rev = append(rev, fwd[i])
		}
		errs := make(chan error, 2)
		for _, batch := range [][]meter.Event{fwd, rev} {
			go func() {
				_, err := b.Ingest(t, batch...)
				errs <- err
			}()
		}
		require.NoError(t, <-errs)
		require.NoError(t, <-errs)
	}
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, "SELECT count(*) FROM usage_events").Scan(&n))
	require.Equal(t, 2000, n)
}

// A feature mapping that names an exporter addresses its feature's items to
// it; a feature without one takes the node's (Target.Exporter). Both the
// stager's windows and the per-event items staged at ingest do so, the
// identifier follows the exporter, and changing the exporter is a new
// mapping version whose later items (and a rebuilt quarantined item) take
// the new exporter.
func TestStagePerFeatureExporter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, mappings.ExporterStripeMeterEvents, b.Target.Exporter, "the node's default")
	stream := mappings.ExporterStripeMeterEventStream
	api := b.FeatureWith(t, "api", mappings.FeatureInput{EventName: "api", Aggregation: mappings.Sum, Exporter: stream})
	require.Equal(t, stream, api.Exporter)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.FeatureWith(t, "calls", mappings.FeatureInput{EventName: "calls", Aggregation: mappings.Count, Exporter: stream})
	b.Feature(t, "logins", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)

	hour := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t, ev("a1", "acme", "api", 5, in(1)), ev("s1", "acme", "seats", 3, in(2)),
		ev("c1", "acme", "calls", 1, nil), ev("l1", "acme", "logins", 1, nil))
	require.Len(t, b.Items(t), 2, "the per-event items are staged at ingest")
	require.Equal(t, meter.PassResult{Items: 2, Events: 2}, b.Pass(t))

	want := map[string]string{"api": stream, "seats": mappings.ExporterStripeMeterEvents,
		"calls": stream, "logins": mappings.ExporterStripeMeterEvents}
	items := b.Items(t)
	require.Len(t, items, 4)
	for _, it := range items {
		require.Equal(t, want[it.Feature], it.Exporter, it.SubjectRef)
		kind := outbox.SubjectUsageWindow
		if strings.HasPrefix(it.SubjectRef, "event:") {
			kind = outbox.SubjectUsageEvent
		}
		id := outbox.Identity{TenantKey: "acme", SubjectKind: kind, SubjectRef: it.SubjectRef, Exporter: it.Exporter,
			DestinationAccount: b.Target.Account, Mode: b.Target.Mode, MappingVersion: it.MappingVersion}
		require.Equal(t, id.Identifier(), it.Identifier, "the identifier hashes the exporter")
		other := id
		other.Exporter = want["seats"]
		if it.Exporter == stream {
			require.NotEqual(t, other.Identifier(), it.Identifier)
		}
	}

	// Back to the node's default: a new version, and the window's late
	// usage (a supplement) goes to the default exporter under it.
	f, changed, err := b.Maps.PutFeature(b.Ctx, b.Pool, "api", mappings.FeatureInput{EventName: "api", Aggregation: mappings.Sum}, "test")
	require.NoError(t, err)
	require.True(t, changed)
	require.Greater(t, f.Version, api.Version)
	require.Empty(t, f.Exporter)
	b.MustIngest(t, ev("a2", "acme", "api", 4, in(10)))
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, b.Pass(t))
	items = b.Items(t)
	require.Len(t, items, 5)
	last := items[4]
	require.Equal(t, meter.WindowOf(hour, time.Hour, meter.CalendarAnchor).SubjectRef("api", 1), last.SubjectRef)
	require.Equal(t, mappings.ExporterStripeMeterEvents, last.Exporter)
	require.Equal(t, f.Version, last.MappingVersion)

	// A quarantined item (no customer) of a feature exported by the stream
	// is rebuilt for the exporter the mapping names now.
	b.MustIngest(t, ev("c2", "nobody", "calls", 1, ago(3*time.Hour)))
	b.Pass(t)
	items = b.Items(t)
	require.Len(t, items, 6)
	q := items[5]
	require.Equal(t, outbox.StateQuarantined, q.State)
	require.Equal(t, stream, q.Exporter)
	qi, err := b.Outbox.Get(b.Ctx, b.Pool, q.ID)
	require.NoError(t, err)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	pair, err := b.Maps.Lookup(b.Ctx, b.Pool, "nobody", "calls")
	require.NoError(t, err)
	err = pgx.BeginFunc(b.Ctx, b.Pool, func(tx pgx.Tx) error {
		ni, err := b.Stager.Rebuild(b.Ctx, tx, qi, pair)
		require.NoError(t, err)
		require.Equal(t, mappings.ExporterStripeMeterEvents, ni.Exporter)
		require.Equal(t, pair.Version(), ni.MappingVersion)
		return nil
	})
	require.NoError(t, err)
}
