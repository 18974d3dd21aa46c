package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/quarantine"
)

// TestCancelAdjustmentsSurviveKills is issue 19's crash test of
// cancellations: count events are accepted by Stripe, then cancelled
// through POST /v1/usage/cancellations while `tally serve` is killed by
// SIGKILL again and again, each time while the simulator holds the answer
// of an adjustment it applied (Faults.ReplyDelay): a kill lands after
// Stripe applied an adjustment and before Tally recorded it.
// Faults before and after executing, lost replies and 429s come on top.
//
// Whatever Stripe answers a second cancellation of one identifier — a 400
// (the simulator's default) or a 200 that proves nothing
// (Options.CancelAgainSucceeds, the worst plausible reading: docs/stripe.md
// §9) — every cancelled event must be cancelled in Stripe and no other
// event; each cancellation must have one item, ending accepted or, when
// Stripe's answer could not be read, quarantined provider_refused for a
// human — nothing open, nothing uncertain; Stripe's count per customer must
// equal the ledger's events less the cancelled ones; a reconcile run must
// find no discrepancy; and the completeness identity must hold with the
// cancelled usage in its own column.
func TestCancelAdjustmentsSurviveKills(t *testing.T) {
	if testing.Short() {
		t.Skip("kills a node again and again: a load test")
	}
	t.Parallel()
	for _, again := range []bool{false, true} {
		t.Run(fmt.Sprintf("CancelAgainSucceeds=%v", again), func(t *testing.T) {
			t.Parallel()
			runCancelKills(t, again)
		})
	}
}

const (
	cancelKillTenants = 5
	cancelKillEvents  = 200 // 40 per tenant
	cancelKillKills   = 3
)

func runCancelKills(t *testing.T, again bool) {
	ctx := context.Background()
	sim := stripesim.New(stripesim.Options{Seed: 19, CancelAgainSucceeds: again})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	for i := range cancelKillTenants {
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_t%02d", i))
	}

	url := testdb.URL(t)
	stage, maintenance, lease, poll := loadPasses(testdb.OnCitus(), "100ms", "1s", "4s", "50ms")
	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{
		"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + exportAdmin,
		"STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + srv.URL,
		"TALLY_STAGE_INTERVAL=" + stage, "TALLY_MAINTENANCE_INTERVAL=" + maintenance,
		"TALLY_OUTBOX_BACKOFF_BASE=50ms", "TALLY_OUTBOX_BACKOFF_CAP=300ms", "TALLY_OUTBOX_RATE_LIMIT_DELAY=100ms",
		"TALLY_OUTBOX_MAX_ATTEMPTS=60", "TALLY_OUTBOX_LEASE=" + lease, "TALLY_STRIPE_TIMEOUT=1s",
		"TALLY_RATE_TEST=1000", "TALLY_ADJUST_RATE_TEST=1000", "TALLY_BASIC_RATE_TEST=3000", "TALLY_POLL_INTERVAL=" + poll,
		"TALLY_SHUTDOWN_TIMEOUT=5s", "TALLY_LOG_LEVEL=warn",
	}
	base, pool := n.serve(ctx, url)

	code, body := post(t, http.MethodPut, base+"/v1/mappings/features/logins", exportAdmin, map[string]string{"event_name": "logins", "aggregation": "count"})
	require.Equal(t, http.StatusOK, code, body)
	for i := range cancelKillTenants {
		code, body := post(t, http.MethodPut, fmt.Sprintf("%s/v1/mappings/tenants/t%02d", base, i), exportAdmin,
			map[string]string{"stripe_customer_id": fmt.Sprintf("cus_t%02d", i)})
		require.Equal(t, http.StatusOK, code, body)
	}

	// The events, an hour ago and before, accepted by Stripe without faults.
	now := time.Now().UTC().Truncate(time.Second)
	events := make([]e2eEvent, cancelKillEvents)
	for i := range events {
		events[i] = e2eEvent{ID: fmt.Sprintf("e%04d", i), Tenant: fmt.Sprintf("t%02d", i%cancelKillTenants), Feature: "logins", Value: 1,
			Timestamp: now.Add(-time.Hour - time.Duration(i)*time.Second).Format(time.RFC3339)}
	}
	code, body = post(t, http.MethodPost, base+"/v1/usage", exportAdmin, map[string]any{"events": events})
	require.Equal(t, http.StatusAccepted, code, body)
	cancelKillWait(t, ctx, pool, n, func() bool {
		var accepted int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state = 'accepted'`).Scan(&accepted)
		return accepted == cancelKillEvents
	})

	t.Logf("%s: events accepted", time.Since(now))
	// From now on every answer is held 150 ms after Stripe acted on it,
	// with the usual faults besides.
	sim.Configure(stripesim.DefaultAccount, stripesim.Limits{Faults: stripesim.Faults{
		FailBeforeRecord: 0.05, FailAfterRecord: 0.05, LoseReply: 0.05, RateLimitFault: 0.05,
		Latency: 5 * time.Millisecond, LatencyJitter: 10 * time.Millisecond, ReplyDelay: 150 * time.Millisecond,
	}})

	// The killer: each kill waits (up to 45 s: on three loaded nodes the
	// first adjustments go out late) until Stripe holds the answer of an
	// adjustment it carried out — a call of the running process, so its
	// item is leased — then kills within the first 60 ms of the 150 ms
	// hold. Waiting for a leased item instead let a kill land after the
	// answers had been written (a slow poll), or just after a restart,
	// when the dead process's leases still showed: no kill between Stripe
	// acting and Tally hearing, in 1 of 10 runs.
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		rng := rand.New(rand.NewPCG(19, 3))
		for i := 0; i < cancelKillKills; i++ {
			for end := time.Now().Add(45 * time.Second); time.Now().Before(end) && sim.HeldSuccesses() == 0; {
				time.Sleep(time.Millisecond)
			}
			time.Sleep(time.Duration(rng.IntN(60)) * time.Millisecond)
			n.kill()
			n.start()
		}
	}()

	// Every other event is cancelled, 20 to a request, while the node is
	// killed: a request the node did not answer is sent again, and answers
	// the first outcome.
	cancelled := map[string]bool{}
	for i := 0; i < cancelKillEvents; i += 40 {
		var batch []meter.Cancellation
		for j := i; j < i+40; j += 2 {
			batch = append(batch, meter.Cancellation{Tenant: events[j].Tenant, ID: events[j].ID})
			cancelled[events[j].ID] = true
		}
		code, body := post(t, http.MethodPost, base+"/v1/usage/cancellations", exportAdmin, map[string]any{"cancellations": batch})
		require.Equal(t, http.StatusOK, code, body)
		var res struct {
			Cancellations []meter.CancelResult `json:"cancellations"`
		}
		require.NoError(t, json.Unmarshal([]byte(body), &res), body)
		require.Len(t, res.Cancellations, len(batch))
		for _, c := range res.Cancellations {
			require.Equal(t, meter.CancelAdjustment, c.Outcome, "%+v", c)
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("%s: cancellations posted", time.Since(now))
	select {
	case <-killed:
	case <-time.After(3 * time.Minute):
		t.Fatal("the killer never finished")
	}
	cancelKillWait(t, ctx, pool, n, func() bool {
		var open int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state IN ('pending', 'leased')`).Scan(&open)
		return open == 0
	})
	sim.Configure(stripesim.DefaultAccount, stripesim.Limits{})
	t.Logf("%s: adjustments settled", time.Since(now))

	// The kills landed between sending and recording.
	var abandoned int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_attempts a JOIN outbox_items o ON o.id = a.item_id AND o.bucket = a.bucket
		WHERE a.outcome = 'abandoned' AND o.subject_kind = 'usage_cancellation'`).Scan(&abandoned))
	t.Logf("%d adjustment leases died with a killed process; %d adjustments carried out unheard", abandoned, sim.Unheard())
	require.Positive(t, abandoned, "no kill caught an adjustment in flight")
	if sim.Unheard() == 0 {
		var b strings.Builder
		rows, err := pool.Query(ctx, `SELECT DISTINCT o.identifier FROM outbox_attempts a JOIN outbox_items o ON o.id = a.item_id AND o.bucket = a.bucket
			WHERE a.outcome = 'abandoned' AND o.subject_kind = 'usage_cancellation'`)
		require.NoError(t, err)
		idents, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		for _, id := range idents {
			fmt.Fprintf(&b, "%s:\n%s", id, cancelKillHistory(t, pool, sim, id))
		}
		t.Fatalf("no kill came between Stripe applying an adjustment and Tally hearing it; the abandoned:\n%s", b.String())
	}
	require.NotContains(t, n.out.String(), "panic")

	// One cancellation and one item per cancelled event; each item settled
	// as accepted or, unreadable, quarantined provider_refused.
	kept500 := map[string]bool{} // cancellation identifiers with a 500 Stripe answered after cancelling
	for _, r := range sim.Requests() {
		if r.Path == "/v1/billing/meter_event_adjustments" && r.Status == http.StatusInternalServerError {
			kept500[exporter.IdentifierOf(r.IdempotencyKey)] = true
		}
	}
	rows, err := pool.Query(ctx, `
		SELECT c.event_id, c.outcome, o.state, coalesce(o.quarantine_reason, ''), o.payload ->> 'cancels', b.identifier, o.identifier
		FROM usage_cancellations c
		JOIN outbox_items o ON o.id = c.item_id AND o.bucket = c.bucket
		JOIN outbox_item_bodies b ON b.id = c.carried_by AND b.bucket = c.bucket`)
	require.NoError(t, err)
	var (
		eventID, outcome, state, reason, cancels, carried, self string
		states                                                  = map[string]int{}
		cancelledIdents                                         = map[string]bool{}
	)
	_, err = pgx.ForEachRow(rows, []any{&eventID, &outcome, &state, &reason, &cancels, &carried, &self}, func() error {
		require.True(t, cancelled[eventID], "%s was not cancelled", eventID)
		require.Equal(t, meter.CancelAdjustment, outcome)
		require.Equal(t, carried, cancels, "the adjustment names the event's identifier")
		require.False(t, cancelledIdents[cancels], "%s cancelled by two items", cancels)
		cancelledIdents[cancels] = true
		switch state {
		case "accepted":
		case "quarantined":
			// Only when Stripe's answer to the attempt that cancelled is
			// unreadable (a 500 kept for its key): a lost reply or a kill
			// is learnt from the earlier attempts' keys.
			require.Equal(t, "provider_refused", reason, eventID)
			if !kept500[self] {
				t.Errorf("%s quarantined though no key of it was answered 500:\n%s", eventID, cancelKillHistory(t, pool, sim, self))
			}
		default:
			t.Fatalf("adjustment of %s ended %s", eventID, state)
		}
		states[state]++
		return nil
	})
	require.NoError(t, err)
	require.Len(t, cancelledIdents, len(cancelled), "one cancellation per cancelled event")
	var items int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE subject_kind = 'usage_cancellation'`).Scan(&items))
	require.Equal(t, len(cancelled), items, "no cancellation item beside the recorded ones")
	t.Logf("adjustments: %v", states)
	if again {
		require.Zero(t, states["quarantined"], "a second cancel answered 200 is accepted")
	}

	// Stripe: every cancelled event cancelled, no other; none twice; the
	// count per customer is the ledger's less the cancelled events.
	for _, ev := range sim.Events(stripesim.DefaultAccount) {
		want := stripesim.EventRecorded
		if cancelledIdents[ev.Identifier] {
			want = stripesim.EventCancelled
		}
		require.Equal(t, want, ev.Status, ev.Identifier)
	}
	require.Empty(t, sim.RecordedTwice())
	for i := range cancelKillTenants {
		_, count, _ := sim.Aggregate(stripesim.DefaultAccount, "logins", fmt.Sprintf("cus_t%02d", i))
		require.Equal(t, (cancelKillEvents-len(cancelled))/cancelKillTenants, count, "t%02d", i)
	}

	// Stripe's summaries agree with Tally's ledger.
	run := reconcileCLI(t, n.env)
	require.Equal(t, "succeeded", run.Status, "%+v", run)
	require.Zero(t, run.Discrepancies, "%+v", run)
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state = 'accepted'`).Scan(&left))
	require.Zero(t, left, "the run confirms every accepted event and adjustment: %+v", run)

	t.Logf("%s: reconciled", time.Since(now))
	// Completeness: ingested = the buckets, the cancelled usage in its own.
	months := map[string]bool{}
	for _, ev := range events {
		months[ev.Timestamp[:7]] = true
	}
	var cancelledEvents int64
	for m := range months {
		rep, err := quarantine.CompletenessOf(ctx, pool, m, "")
		require.NoError(t, err)
		require.True(t, rep.Holds, "%+v", rep)
		for _, l := range rep.Lines {
			cancelledEvents += l.Cancelled.Events
		}
	}
	require.Equal(t, int64(len(cancelled)), cancelledEvents)
}

// cancelKillWait waits up to two minutes for done; past that it fails
// with the outbox's summary, the attempts of the most-tried pending item
// and the node's output.
func cancelKillWait(t *testing.T, ctx context.Context, pool *pgxpool.Pool, n *node, done func() bool) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); !done(); time.Sleep(100 * time.Millisecond) {
		if !time.Now().After(deadline) {
			continue
		}
		rows, err := pool.Query(ctx, `SELECT a.item_id, a.outcome, coalesce(a.error_status, 0), coalesce(a.error_message, ''), a.recorded_at
			FROM outbox_attempts a
			WHERE a.item_id = (SELECT id FROM outbox_items WHERE state = 'pending' ORDER BY attempts DESC LIMIT 1)
			ORDER BY a.recorded_at`)
		require.NoError(t, err)
		var (
			id               int64
			outcome, message string
			status           int
			at               time.Time
		)
		_, err = pgx.ForEachRow(rows, []any{&id, &outcome, &status, &message, &at}, func() error {
			t.Logf("item %d at %s: %s %d %s", id, at.Format("15:04:05.000"), outcome, status, message)
			return nil
		})
		require.NoError(t, err)
		t.Fatalf("the outbox never settled: %s\n--- tally serve output ---\n%s", outboxSummary(ctx, pool), tail(n.out.String(), 4000))
	}
}

// cancelKillHistory tells an adjustment item's story, for a failure: its
// attempts as Tally recorded them and every call Stripe saw for its keys.
func cancelKillHistory(t *testing.T, pool *pgxpool.Pool, sim *stripesim.Server, identifier string) string {
	var b strings.Builder
	rows, err := pool.Query(context.Background(), `
		SELECT a.lease_token, a.outcome, a.refused, coalesce(a.error_code, ''), coalesce(a.error_status, 0),
			to_char(a.leased_at, 'HH24:MI:SS.MS'), to_char(a.recorded_at, 'HH24:MI:SS.MS')
		FROM outbox_attempts a JOIN outbox_items o ON o.id = a.item_id AND o.bucket = a.bucket
		WHERE o.identifier = $1 ORDER BY a.lease_token`, identifier)
	require.NoError(t, err)
	var (
		token                           int64
		outcome, code, leased, recorded string
		refused                         bool
		status                          int
	)
	_, err = pgx.ForEachRow(rows, []any{&token, &outcome, &refused, &code, &status, &leased, &recorded}, func() error {
		fmt.Fprintf(&b, "  attempt lease %d leased %s recorded %s: %s refused=%v %s %d\n", token, leased, recorded, outcome, refused, code, status)
		return nil
	})
	require.NoError(t, err)
	for _, r := range sim.Requests() {
		if r.Path == "/v1/billing/meter_event_adjustments" && exporter.IdentifierOf(r.IdempotencyKey) == identifier {
			fmt.Fprintf(&b, "  stripe %s key %s: %d replayed=%v\n", r.Time.UTC().Format("15:04:05.000"), r.IdempotencyKey, r.Status, r.Replayed)
		}
	}
	return b.String()
}
