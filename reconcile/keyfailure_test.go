package reconcile_test

import (
	"context"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// keyRig is one sum meter "api" and n customers cus_k000…, each with two
// items accepted at Stripe in the hours 4 and 3 hours ago; the items of the
// customer gone were accepted too (Stripe answered 200) but Stripe does not
// know that customer (it was deleted since), and the simulator answers its
// summaries 400 resource_missing. gone also has one uncertain item in the
// later hour.
type keyRig struct {
	ctx   context.Context
	pool  *pgxpool.Pool
	store *outbox.Store
	sim   *stripesim.Server
	meter string
	base  string
	gone  string
	hour0 time.Time
	// byCustomer lists each customer's items by id.
	byCustomer map[string][]int64
	values     map[int64]int64
	uncertain  int64 // gone's uncertain item
}

// keyFault answers a request in the simulator's place (true) or lets the
// simulator answer it (false).
type keyFault func(w http.ResponseWriter, r *http.Request) bool

func newKeyRig(t *testing.T, n int, gone string, fault keyFault) *keyRig {
	t.Helper()
	ctx := context.Background()
	sim := stripesim.New(stripesim.Options{Seed: 13})
	h := sim.Handler()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if fault != nil && fault(w, r) {
			return
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { sim.Close(); srv.Close() })
	m := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "api", EventName: "api", Formula: "sum"})
	kr := &keyRig{ctx: ctx, pool: testdb.New(t), sim: sim, meter: m.ID, base: srv.URL, gone: gone,
		hour0: time.Now().UTC().Add(-4 * time.Hour).Truncate(time.Hour), byCustomer: map[string][]int64{}, values: map[int64]int64{}}
	var err error
	kr.store, err = outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)

	var items []outbox.NewItem
	add := func(cust string, h, v int64, ref string) {
		items = append(items, outbox.NewItem{
			Identity: outbox.Identity{TenantKey: cust, SubjectKind: outbox.SubjectUsageWindow, SubjectRef: ref,
				Exporter: exporter.StripeMeterEvents, DestinationAccount: stripesim.DefaultAccount, Mode: outbox.ModeTest, MappingVersion: 1},
			Payload: outbox.Payload{Customer: cust, EventName: "api", Value: v, Feature: "api", Period: "2026-11-01T00:00:00Z",
				Timestamp: kr.hour0.Add(time.Duration(h)*time.Hour + 10*time.Minute).Unix()},
		})
	}
	for c := 0; c < n; c++ {
		cust := fmt.Sprintf("cus_k%03d", c)
		if cust != gone {
			sim.CreateCustomer(stripesim.DefaultAccount, cust)
		}
		add(cust, 0, int64(c%5+1), "usage:api:0")
		add(cust, 1, int64(c%3+2), "usage:api:1")
	}
	if gone != "" {
		add(gone, 1, 7, "usage:api:1b")
	}
	require.NoError(t, pgx.BeginFunc(ctx, kr.pool, func(tx pgx.Tx) error {
		enq, err := kr.store.EnqueueBatch(ctx, tx, items)
		for i, e := range enq {
			kr.byCustomer[items[i].Payload.Customer] = append(kr.byCustomer[items[i].Payload.Customer], e.ID)
			kr.values[e.ID] = items[i].Payload.Value
		}
		return err
	}))

	// Deliver: every send answered, as Stripe answered it; gone's were
	// accepted before the customer was deleted (its first two), or left
	// Tally not knowing (the third: every reply lost).
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	exp := exporter.NewStripeV1(client, 5*time.Second)
	if gone != "" {
		kr.uncertain = kr.byCustomer[gone][2]
	}
	for {
		leases, err := kr.store.Claim(ctx, kr.pool, outbox.ClaimOptions{Owner: "test", Limit: 500, Policy: outbox.BestEffort})
		require.NoError(t, err)
		if len(leases) == 0 {
			break
		}
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			switch {
			case l.ID == kr.uncertain:
				outcomes[i] = outbox.Outcome{Kind: outbox.Uncertain, Error: outbox.ErrorInfo{Code: stripeapi.CodeTimeout}}
			case l.Payload.Customer == gone:
				outcomes[i] = outbox.Outcome{Kind: outbox.Accepted, ProviderRef: "req_before_deletion"}
			default:
				outcomes[i] = exp.Send(ctx, l)
				require.Equal(t, outbox.Accepted, outcomes[i].Kind, "%+v", outcomes[i])
			}
			outcomes[i].Lease = l
		}
		_, err = kr.store.Record(ctx, kr.pool, outcomes)
		require.NoError(t, err)
	}
	return kr
}

func (kr *keyRig) reconciler(t *testing.T, retryMax time.Duration) *reconcile.Reconciler {
	t.Helper()
	rec, err := reconcile.New(reconcile.Config{Outbox: kr.store, Key: stripesim.DefaultKey, APIBase: kr.base,
		Destination: func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
		}, Limiter: exporter.NewLimiter(100000), RetryInitial: time.Millisecond, RetryMax: retryMax})
	require.NoError(t, err)
	return rec
}

// run runs reconcile to its end and reads its discrepancies.
func (kr *keyRig) run(t *testing.T, rec *reconcile.Reconciler) (reconcile.Run, []reconcile.Discrepancy, error) {
	t.Helper()
	run, err := rec.RunNow(kr.ctx, kr.pool, reconcile.TriggerCommand, "test", reconcile.Options{Settle: settled})
	ds, derr := reconcile.Discrepancies(kr.ctx, kr.pool, run.ID)
	require.NoError(t, derr)
	return run, ds, err
}

func (kr *keyRig) states(t *testing.T) map[int64]outbox.State {
	t.Helper()
	rows, err := kr.pool.Query(kr.ctx, `SELECT id, state FROM outbox_items`)
	require.NoError(t, err)
	out := map[int64]outbox.State{}
	var id int64
	var s outbox.State
	_, err = pgx.ForEachRow(rows, []any{&id, &s}, func() error { out[id] = s; return nil })
	require.NoError(t, err)
	return out
}

// requireRefused checks the key-level discrepancy of gone: the reason and
// Stripe's error, the first hour of the range, what Tally holds over it and
// the items involved.
func (kr *keyRig) requireRefused(t *testing.T, d reconcile.Discrepancy, code string, status int, expected []int64) {
	t.Helper()
	require.Equal(t, reconcile.ReasonSummariesRefused, d.Reason, "%+v", d)
	require.Equal(t, code, d.ErrorCode)
	require.Equal(t, status, d.ErrorStatus)
	require.Equal(t, kr.gone, d.Customer)
	require.Equal(t, "api", d.EventName)
	require.Equal(t, kr.meter, d.Meter)
	require.Equal(t, stripesim.DefaultAccount, d.Account)
	require.Equal(t, string(outbox.ModeTest), d.Mode)
	require.Equal(t, "sum", d.Formula)
	require.True(t, kr.hour0.Equal(d.Hour), "the first hour of the key's range: %s", d.Hour)
	sum := new(big.Int)
	for _, id := range expected {
		sum.Add(sum, big.NewInt(kr.values[id]))
	}
	require.Equal(t, sum.String(), d.Expected, "Tally's sum over the range")
	require.Nil(t, d.Provider, "Stripe gave no number")
	require.Nil(t, d.Difference)
	require.Equal(t, expected, d.ExpectedItems)
	require.Equal(t, []int64{kr.uncertain}, d.UncertainItems)
	require.Equal(t, []int64{}, d.ExplainedBy)
	require.Equal(t, reconcile.ExplanationNotCompared, d.Explanation)
	require.Equal(t, []int64{}, d.ReportedItems)
}

// A customer Stripe does not know (deleted after it accepted the events)
// answers its summaries 400: that key is a discrepancy of its own, with its
// reason and items, and the run goes on to confirm the other 99 keys. A
// rerun meets the same refusal and records it again, on its own run.
func TestRefusedKeyIsADiscrepancyAndTheRunGoesOn(t *testing.T) {
	t.Parallel()
	kr := newKeyRig(t, 100, "cus_k042", nil)
	rec := kr.reconciler(t, 5*time.Second)
	goneAccepted := kr.byCustomer[kr.gone][:2]

	run, ds, err := kr.run(t, rec)
	require.NoError(t, err)
	require.Equal(t, "succeeded", run.Status, "%+v", run)
	require.Equal(t, 100, run.KeysTotal)
	require.Equal(t, 100, run.KeysDone)
	require.Equal(t, int64(99*2), run.ItemsConfirmed)
	require.Equal(t, 99*2, run.HoursCompared)
	require.Equal(t, 99*2, run.HoursMatched)
	require.Zero(t, run.HoursSkipped)
	require.Equal(t, 1, run.Discrepancies)
	require.Len(t, ds, 1)
	kr.requireRefused(t, ds[0], "resource_missing", http.StatusBadRequest, goneAccepted)

	states := kr.states(t)
	for cust, ids := range kr.byCustomer {
		for _, id := range ids {
			want := outbox.StateConfirmed
			switch {
			case id == kr.uncertain:
				want = outbox.StateUncertain
			case cust == kr.gone:
				want = outbox.StateAccepted
			}
			require.Equal(t, want, states[id], "item %d of %s", id, cust)
		}
	}

	// A refusal is nothing a recovery resolves: the plan has no action.
	plan, err := reconcile.PlanOf(kr.ctx, kr.pool, kr.store, run.ID)
	require.NoError(t, err)
	require.Empty(t, plan.Actions)
	require.Equal(t, 1, plan.Unplanned)

	// The rerun: only the refused key is left, and it is refused again.
	again, ds2, err := kr.run(t, rec)
	require.NoError(t, err)
	require.Equal(t, "succeeded", again.Status, "%+v", again)
	require.Equal(t, 1, again.KeysTotal)
	require.Equal(t, 1, again.KeysDone)
	require.Equal(t, 1, again.Discrepancies)
	require.Zero(t, again.ItemsConfirmed)
	require.Equal(t, findings(ds), findings(ds2))
	require.Equal(t, states, kr.states(t))

	// An item of the key's first hour is in flight: that hour would be
	// skipped, so it is not part of the refusal; the range still starts
	// with it.
	require.NoError(t, pgx.BeginFunc(kr.ctx, kr.pool, func(tx pgx.Tx) error {
		_, err := kr.store.EnqueueBatch(kr.ctx, tx, []outbox.NewItem{{
			Identity: outbox.Identity{TenantKey: kr.gone, SubjectKind: outbox.SubjectUsageWindow, SubjectRef: "usage:api:0b",
				Exporter: exporter.StripeMeterEvents, DestinationAccount: stripesim.DefaultAccount, Mode: outbox.ModeTest, MappingVersion: 1},
			Payload: outbox.Payload{Customer: kr.gone, EventName: "api", Value: 1, Feature: "api", Period: "2026-11-01T00:00:00Z",
				Timestamp: kr.hour0.Add(20 * time.Minute).Unix()},
		}})
		return err
	}))
	third, ds3, err := kr.run(t, rec)
	require.NoError(t, err)
	require.Equal(t, 1, third.HoursSkipped)
	require.Len(t, ds3, 1)
	kr.requireRefused(t, ds3[0], "resource_missing", http.StatusBadRequest, goneAccepted[1:])
}

// A run interrupted before the refused key resumes from its cursor: it
// records the refusal, confirms the keys after it, and leaves the keys
// before the cursor to the next run, which confirms them and records the
// refusal again.
func TestResumedRunRecordsTheRefusedKeyOnce(t *testing.T) {
	t.Parallel()
	kr := newKeyRig(t, 10, "cus_k006", nil)
	rec := kr.reconciler(t, 5*time.Second)
	id, err := reconcile.Queue(kr.ctx, kr.pool, reconcile.TriggerAPI, "test", reconcile.Options{Settle: settled})
	require.NoError(t, err)
	// As a run killed after its fourth key leaves itself: interrupted,
	// its cursor past cus_k003.
	_, err = kr.pool.Exec(kr.ctx, `UPDATE reconcile_runs SET status = 'interrupted', started_at = now(), keys_done = 4,
		cursor = $2 WHERE id = $1`, id, stripesim.DefaultAccount+"|cus_k003|api")
	require.NoError(t, err)

	run, err := rec.Work(kr.ctx, kr.pool, id)
	require.NoError(t, err)
	require.Equal(t, "succeeded", run.Status, "%+v", run)
	require.Equal(t, 10, run.KeysDone)
	require.Equal(t, 10, run.KeysTotal)
	require.Equal(t, int64(5*2), run.ItemsConfirmed, "cus_k004, 005, 007, 008, 009")
	require.Equal(t, 1, run.Discrepancies)
	ds, err := reconcile.Discrepancies(kr.ctx, kr.pool, id)
	require.NoError(t, err)
	require.Len(t, ds, 1)
	kr.requireRefused(t, ds[0], "resource_missing", http.StatusBadRequest, kr.byCustomer[kr.gone][:2])
	states := kr.states(t)
	for _, c := range []string{"cus_k000", "cus_k003"} {
		require.Equal(t, outbox.StateAccepted, states[kr.byCustomer[c][0]], "%s is before the cursor", c)
	}

	next, ds2, err := kr.run(t, rec)
	require.NoError(t, err)
	require.Equal(t, 5, next.KeysTotal, "cus_k000…003 and the refused one")
	require.Equal(t, int64(4*2), next.ItemsConfirmed)
	require.Equal(t, findings(ds), findings(ds2))
}

// How an answer on a key's summaries ends: a 4xx about the key (400, 402,
// 404, …) is that key's discrepancy and the run goes on; 401 and 403 refuse
// every key, so the run fails; 409, 429 and 5xx are tried again with
// backoff and fail the run only when they go on. A failed run keeps the keys it
// finished before the failing one.
func TestSummariesAnswersThatFailTheRunOrOnlyTheKey(t *testing.T) {
	t.Parallel()
	const gone = "cus_k004"
	for _, tc := range []struct {
		name       string
		status     int
		typ, code  string
		failsRun   bool
		wantRunErr string // the run's error code when it fails
	}{
		{name: "meter gone", status: http.StatusNotFound, typ: "invalid_request_error", code: "resource_missing"},
		{name: "customer deleted", status: http.StatusBadRequest, typ: "invalid_request_error", code: "resource_missing"},
		{name: "payment required", status: http.StatusPaymentRequired, typ: "card_error", code: "request_failed"},
		{name: "conflict", status: http.StatusConflict, typ: "invalid_request_error", code: "lock_timeout", failsRun: true, wantRunErr: "lock_timeout"},
		{name: "unauthorized", status: http.StatusUnauthorized, typ: "invalid_request_error", failsRun: true, wantRunErr: "invalid_request_error"},
		{name: "forbidden", status: http.StatusForbidden, typ: "invalid_request_error", code: "secret_key_required", failsRun: true, wantRunErr: "secret_key_required"},
		{name: "rate limited", status: http.StatusTooManyRequests, typ: "invalid_request_error", code: "rate_limit", failsRun: true, wantRunErr: "rate_limit"},
		{name: "server error", status: http.StatusInternalServerError, typ: "api_error", failsRun: true, wantRunErr: "api_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// Stripe knows every customer here; the answer for gone's
			// summaries is the case's.
			kr := newKeyRig(t, 8, "", func(w http.ResponseWriter, r *http.Request) bool {
				if r.URL.Query().Get("customer") != gone {
					return false
				}
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Stripe-Should-Retry", "false") // no retry inside stripe-go
				w.WriteHeader(tc.status)
				if tc.code == "" {
					fmt.Fprintf(w, `{"error":{"type":%q,"message":"refused by the test"}}`, tc.typ)
				} else {
					fmt.Fprintf(w, `{"error":{"type":%q,"code":%q,"message":"refused by the test"}}`, tc.typ, tc.code)
				}
				return true
			})
			kr.gone = gone
			rec := kr.reconciler(t, 50*time.Millisecond)
			run, ds, err := kr.run(t, rec)
			states := kr.states(t)
			if tc.failsRun {
				require.Error(t, err)
				require.Equal(t, "failed", run.Status, "%+v", run)
				require.Equal(t, tc.wantRunErr, run.ErrorCode)
				require.Empty(t, ds, "nothing is recorded for the key")
				require.Equal(t, 4, run.KeysDone, "the keys before it are done")
				for c := 0; c < 8; c++ {
					cust := fmt.Sprintf("cus_k%03d", c)
					want := outbox.StateConfirmed
					if cust >= gone {
						want = outbox.StateAccepted
					}
					require.Equal(t, want, states[kr.byCustomer[cust][0]], cust)
				}
				return
			}
			require.NoError(t, err)
			require.Equal(t, "succeeded", run.Status, "%+v", run)
			require.Equal(t, 8, run.KeysDone)
			require.Equal(t, int64(7*2), run.ItemsConfirmed)
			require.Len(t, ds, 1)
			d := ds[0]
			code := tc.code
			if code == "" {
				code = tc.typ
			}
			require.Equal(t, reconcile.ReasonSummariesRefused, d.Reason)
			require.Equal(t, code, d.ErrorCode)
			require.Equal(t, tc.status, d.ErrorStatus)
			require.Equal(t, kr.byCustomer[gone], d.ExpectedItems)
			require.Equal(t, []int64{}, d.UncertainItems)
			for _, id := range kr.byCustomer[gone] {
				require.Equal(t, outbox.StateAccepted, states[id])
			}
		})
	}
}

// The discrepancies of an hour keep their reason, mismatch, and carry no
// error.
func TestHourDiscrepanciesAreMismatches(t *testing.T) {
	t.Parallel()
	kr := newKeyRig(t, 3, "", nil)
	var identifier string
	require.NoError(t, kr.pool.QueryRow(kr.ctx, `SELECT identifier FROM outbox_items WHERE id = $1`, kr.byCustomer["cus_k001"][1]).Scan(&identifier))
	require.True(t, kr.sim.DropEvent(stripesim.DefaultAccount, identifier))
	run, ds, err := kr.run(t, kr.reconciler(t, 5*time.Second))
	require.NoError(t, err)
	require.Equal(t, 1, run.Discrepancies)
	require.Len(t, ds, 1)
	require.Equal(t, reconcile.ReasonMismatch, ds[0].Reason)
	require.Empty(t, ds[0].ErrorCode)
	require.Zero(t, ds[0].ErrorStatus)
	require.Equal(t, "unexplained", ds[0].Explanation)
	require.True(t, slices.Equal([]int64{kr.byCustomer["cus_k001"][1]}, ds[0].ExpectedItems))
}

// The table admits a refused key only as one: with Stripe's code and a 4xx
// status, no number of Stripe's and nothing explained; and a mismatch
// never carries an error.
func TestDiscrepancyRowsKeepTheirReasonsApart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	run, err := reconcile.Queue(ctx, pool, reconcile.TriggerAPI, "test", reconcile.Options{})
	require.NoError(t, err)
	insert := func(hour int, reason string, code *string, status *int, provider *int, explanation string) error {
		_, err := pool.Exec(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter,
				customer, reason, error_code, error_status, hour, formula, expected, provider, difference, expected_items,
				uncertain_items, explained_by, explanation)
			VALUES ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_1', $2, $3, $4, to_timestamp($5::bigint * 3600), 'sum', 3, $6::numeric, $6::numeric - 3,
				'{1}', '{}', '{}', $7)`, run, reason, code, status, hour, provider, explanation)
		return err
	}
	code, status, four := "resource_missing", 400, 4
	s500, long := 500, strings.Repeat("x", 65)
	require.NoError(t, insert(1, reconcile.ReasonSummariesRefused, &code, &status, nil, reconcile.ExplanationNotCompared))
	require.NoError(t, insert(2, reconcile.ReasonMismatch, nil, nil, &four, "unexplained"))
	for i, bad := range []struct {
		reason      string
		code        *string
		status      *int
		provider    *int
		explanation string
	}{
		{reconcile.ReasonSummariesRefused, nil, &status, nil, reconcile.ExplanationNotCompared},     // no code
		{reconcile.ReasonSummariesRefused, &code, nil, nil, reconcile.ExplanationNotCompared},       // no status
		{reconcile.ReasonSummariesRefused, &code, &s500, nil, reconcile.ExplanationNotCompared},     // not a 4xx
		{reconcile.ReasonSummariesRefused, &long, &status, nil, reconcile.ExplanationNotCompared},   // code too long
		{reconcile.ReasonSummariesRefused, &code, &status, &four, reconcile.ExplanationNotCompared}, // a number of Stripe's
		{reconcile.ReasonSummariesRefused, &code, &status, nil, "unexplained"},
		{reconcile.ReasonMismatch, &code, &status, &four, "unexplained"},
		{reconcile.ReasonMismatch, nil, nil, &four, reconcile.ExplanationNotCompared},
		{"other", nil, nil, &four, "unexplained"},
	} {
		err := insert(10+i, bad.reason, bad.code, bad.status, bad.provider, bad.explanation)
		require.ErrorContains(t, err, "check constraint", "%d: %+v", i, bad)
	}
}
