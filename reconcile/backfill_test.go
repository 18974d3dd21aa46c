package reconcile_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// backfillConnected is the connected account a tenant of the backfill rig
// is mapped to.
const backfillConnected = "acct_1Connected"

// backfillRig is the staging path to the simulator's platform account
// (stripesim.DefaultAccount) and one connected account, both validating
// meter events asynchronously, with the feature logins (count) in each and
// the tenants plat and conn (customers at Stripe) and ghost and ghostc
// (customers Stripe does not have), plat and ghost in the platform, conn
// and ghostc in the connected account; a v1 exporter, and the recorder of
// Stripe's events.
type backfillRig struct {
	*stagetest.Env
	sim    *stripesim.Server
	clk    *stripesim.MovedClock
	base   string
	exp    *exporter.StripeV1
	events *reconcile.Events
	// connected is what the recorder and the listing take for the
	// connected accounts tenant mappings name.
	connected func(context.Context, pgdb.Querier) ([]string, error)
}

func newBackfillRig(t *testing.T, opts stripesim.Options) *backfillRig {
	t.Helper()
	clk := &stripesim.MovedClock{}
	opts.Now, opts.Seed = clk.Now, 7
	sim := stripesim.New(opts)
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	env := stagetest.New(t, outbox.Config{})
	env.Target.Account = stripesim.DefaultAccount
	sim.AddAccount(backfillConnected)
	for _, a := range []string{stripesim.DefaultAccount, backfillConnected} {
		sim.CreateMeter(a, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
		sim.Configure(a, stripesim.Limits{AsyncValidation: true})
	}
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_plat")
	sim.CreateCustomer(backfillConnected, "cus_conn")
	env.Feature(t, "logins", mappings.Count, time.Hour)
	for _, tn := range []struct{ name, account string }{{"plat", ""}, {"ghost", ""}, {"conn", backfillConnected}, {"ghostc", backfillConnected}} {
		_, _, err := env.Maps.PutTenant(env.Ctx, env.Pool, tn.name, mappings.TenantInput{StripeCustomerID: "cus_" + tn.name, StripeAccount: tn.account}, "test")
		require.NoError(t, err)
	}
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	r := &backfillRig{Env: env, sim: sim, clk: clk, base: srv.URL,
		exp: exporter.NewStripeV1(client, 2*time.Second).ForAccounts(func(a string) string {
			if a == stripesim.DefaultAccount {
				return ""
			}
			return a
		}),
		connected: func(ctx context.Context, q pgdb.Querier) ([]string, error) { return mappings.Accounts(ctx, q) },
	}
	r.events, err = reconcile.NewEvents(reconcile.EventsConfig{Outbox: env.Outbox, Destination: destination,
		Connected: r.connected, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	return r
}

// destination is the rig's node destination.
func destination() (exporter.Destination, error) {
	return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
}

// backfill is a listing of the rig's accounts, paced at a rate tests do
// not notice, retrying transient failures briefly.
func (r *backfillRig) backfill(t *testing.T) *reconcile.Backfill {
	t.Helper()
	b, err := reconcile.NewBackfill(reconcile.BackfillConfig{Events: r.events, Key: stripesim.DefaultKey, APIBase: r.base,
		Destination: destination, Connected: r.connected, Limiter: exporter.NewLimiter(1000),
		Logger: slog.New(slog.DiscardHandler), RetryInitial: time.Millisecond, RetryMax: 50 * time.Millisecond})
	require.NoError(t, err)
	return b
}

// send ingests one logins event of each tenant (ids prefixed by prefix),
// stages them and sends every item: Stripe answers 200 to all, and reports
// the ghosts' later.
func (r *backfillRig) send(t *testing.T, prefix string, tenants ...string) {
	t.Helper()
	for _, tn := range tenants {
		r.MustIngest(t, stagetest.Ev(prefix+"-"+tn, tn, "logins", 1, stagetest.Ago(time.Hour)))
	}
	r.Pass(t)
	for {
		leases, err := r.Outbox.Claim(r.Ctx, r.Pool, outbox.ClaimOptions{Owner: "test", Limit: 100})
		require.NoError(t, err)
		if len(leases) == 0 {
			return
		}
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			outcomes[i] = r.exp.Send(r.Ctx, l)
			outcomes[i].Lease = l
			require.Equal(t, outbox.Accepted, outcomes[i].Kind, "%+v", outcomes[i])
		}
		_, err = r.Outbox.Record(r.Ctx, r.Pool, outcomes)
		require.NoError(t, err)
	}
}

// states counts each tenant's items by state.
func (r *backfillRig) states(t *testing.T) map[string]map[outbox.State]int {
	t.Helper()
	rows, err := r.Pool.Query(r.Ctx, `SELECT tenant_key, state FROM outbox_items`)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]map[outbox.State]int{}
	for rows.Next() {
		var (
			tenant string
			state  outbox.State
		)
		require.NoError(t, rows.Scan(&tenant, &state))
		if out[tenant] == nil {
			out[tenant] = map[outbox.State]int{}
		}
		out[tenant][state]++
	}
	require.NoError(t, rows.Err())
	return out
}

// listings are the simulator's GET /v2/core/events since the index from.
func (r *backfillRig) listings(from int) []stripesim.Recorded {
	var out []stripesim.Recorded
	for _, rec := range r.sim.Requests()[from:] {
		if rec.Method == http.MethodGet && rec.Path == "/v2/core/events" {
			out = append(out, rec)
		}
	}
	return out
}

// The event destination delivered nothing (down for all of Stripe's
// retries): the listing finds every report of both accounts — the
// connected account's in its context — records each once, with how it
// arrived and its account, and the items they name leave accepted. A
// second listing records nothing again, and resumes an hour before the
// newest report it saw.
func TestBackfillRecordsWhatTheDestinationMissed(t *testing.T) {
	t.Parallel()
	r := newBackfillRig(t, stripesim.Options{})
	r.send(t, "a", "plat", "ghost", "conn", "ghostc")
	require.Len(t, r.sim.ErrorReports(stripesim.DefaultAccount), 1)
	require.Len(t, r.sim.ErrorReports(backfillConnected), 1)
	b := r.backfill(t)

	res, err := b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, reconcile.BackfillResult{Accounts: 2, Listed: 2, Recorded: 2}, res)
	st := r.states(t)
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, st["ghost"])
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, st["ghostc"])
	require.Equal(t, map[outbox.State]int{outbox.StateAccepted: 1}, st["plat"])
	require.Equal(t, map[outbox.State]int{outbox.StateAccepted: 1}, st["conn"])
	var reason string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT quarantine_reason FROM outbox_items WHERE tenant_key = 'ghostc'`).Scan(&reason))
	require.Equal(t, string(outbox.ReasonCustomerNotFound), reason)
	var rows, listed int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*), count(*) FILTER (WHERE arrival = 'listing' AND status = 'recorded'
		AND account IN ($1, $2)) FROM stripe_events`, stripesim.DefaultAccount, backfillConnected).Scan(&rows, &listed))
	require.Equal(t, [2]int{2, 2}, [2]int{rows, listed})

	lists := r.listings(0)
	require.Len(t, lists, 2)
	require.Equal(t, [2]string{"", ""}, [2]string{lists[0].StripeContext, lists[0].StripeAccount}, "the key's own account, as every call")
	require.Equal(t, [2]string{backfillConnected, ""}, [2]string{lists[1].StripeContext, lists[1].StripeAccount}, "the connected account in its context")
	require.Equal(t, []string{stripeapi.EventMeterErrorReport}, lists[0].Form["types[0]"])
	require.Equal(t, []string{stripeapi.EventNoMeterFound}, lists[0].Form["types[1]"])
	first, err := time.Parse(time.RFC3339Nano, lists[0].Form.Get("created[gt]"))
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(-stripeapi.EventRetention), first, time.Minute, "a first listing goes back 30 days")

	// Again: nothing new, nothing recorded twice; it resumes an hour
	// before the newest report it saw.
	n := len(r.sim.Requests())
	res, err = b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, reconcile.BackfillResult{Accounts: 2, Listed: 2}, res)
	newest := r.sim.ErrorReports(stripesim.DefaultAccount)[0].Created
	since, err := time.Parse(time.RFC3339Nano, r.listings(n)[0].Form.Get("created[gt]"))
	require.NoError(t, err)
	require.WithinDuration(t, newest.Add(-time.Hour), since, time.Millisecond)
	require.Equal(t, st, r.states(t))

	ls, err := reconcile.Listings(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Len(t, ls, 2)
	for _, l := range ls {
		require.True(t, l.Listed)
		require.Nil(t, l.Failure)
		require.Equal(t, outbox.ModeTest, l.Mode)
	}
	age, ok, err := reconcile.SinceLastListing(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.Less(t, age, time.Minute)
	_, delivered, err := reconcile.SinceLastDelivery(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.False(t, delivered, "the destination delivered nothing")
	h, err := reconcile.ReadEventsHealth(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, reconcile.EventsHealth{Missed: 2}, h)
}

// Stripe refuses the filters (400, as a listing that does not know them
// would): the listing goes on without them, filters by type and time
// itself, and stops paging after the first page wholly older than its
// cursor (v2 lists newest first).
func TestBackfillWithoutFilters(t *testing.T) {
	t.Parallel()
	r := newBackfillRig(t, stripesim.Options{EventsList: stripesim.ListUnfiltered})
	b := r.backfill(t)
	// 30 reports five minutes apart.
	for i := range 30 {
		r.send(t, "old"+string(rune('a'+i%26))+string(rune('a'+i/26)), "ghost")
		r.clk.Add(5 * time.Minute)
	}
	require.Len(t, r.sim.ErrorReports(stripesim.DefaultAccount), 30)
	res, err := b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, 30, res.Recorded)
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 30}, r.states(t)["ghost"])

	// Five hours on, 25 more: the listing pages through the new ones, and
	// past the page that reaches an hour before the newest it had seen to
	// the next, wholly older, where it stops.
	r.clk.Add(5 * time.Hour)
	for i := range 25 {
		r.send(t, "new"+string(rune('a'+i)), "ghost")
		r.clk.Add(time.Minute)
	}
	n := len(r.sim.Requests())
	res, err = b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, 25, res.Recorded)
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 55}, r.states(t)["ghost"])
	var platform []stripesim.Recorded
	for _, l := range r.listings(n) {
		if l.StripeContext == "" {
			platform = append(platform, l)
		}
	}
	require.Len(t, platform, 4, "the refused filtered call, then three pages of 20 of the unfiltered listing, of 55 reports")
	require.Equal(t, http.StatusBadRequest, platform[0].Status)
	require.NotEmpty(t, platform[0].Form["types[0]"])
	require.Empty(t, platform[1].Form, "no filters")
	require.NotEmpty(t, platform[3].Form.Get("page"))
}

// A listing that requires object_id (Stripe's earlier reference): the
// listing lists each meter's reports of the account.
func TestBackfillByMeter(t *testing.T) {
	t.Parallel()
	r := newBackfillRig(t, stripesim.Options{EventsList: stripesim.ListByObject})
	r.send(t, "a", "ghost", "ghostc")
	res, err := r.backfill(t).Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, 2, res.Recorded)
	st := r.states(t)
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, st["ghost"])
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, st["ghostc"])
	var byObject int
	for _, l := range r.listings(0) {
		if l.Form.Get("object_id") != "" {
			byObject++
		}
	}
	require.Equal(t, 2, byObject, "one meter in each account")
}

// The listing never goes back more than 30 days (Stripe's retention), by
// the database's clock: a report older than that is not recorded even when
// Stripe lists it.
func TestBackfillThirtyDays(t *testing.T) {
	t.Parallel()
	r := newBackfillRig(t, stripesim.Options{EventsList: stripesim.ListUnfiltered})
	r.clk.Add(-35 * 24 * time.Hour)
	r.send(t, "ancient", "ghost")
	r.clk.Add(15 * 24 * time.Hour)
	r.send(t, "recent", "ghost")
	// Stripe's clock is 20 days behind: it still lists both.
	require.Len(t, r.sim.ErrorReports(stripesim.DefaultAccount), 2)
	res, err := r.backfill(t).Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, 1, res.Listed)
	require.Equal(t, 1, res.Recorded)
	var recorded string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT id FROM stripe_events`).Scan(&recorded))
	require.Equal(t, r.sim.ErrorReports(stripesim.DefaultAccount)[1].ID, recorded, "the recent one")
}

// An account without reports is not listed 30 days back every time: a
// listing resumes two hours before the previous successful one ended (an
// hour of the cursor's margin, an hour of the listing's), and a report
// created meanwhile is still found.
func TestBackfillCursorMovesWithoutReports(t *testing.T) {
	t.Parallel()
	r := newBackfillRig(t, stripesim.Options{})
	b := r.backfill(t)
	for range 2 {
		_, err := b.Run(r.Ctx, r.Pool)
		require.NoError(t, err)
	}
	n := len(r.sim.Requests())
	_, err := b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	since, err := time.Parse(time.RFC3339Nano, r.listings(n)[0].Form.Get("created[gt]"))
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(-2*time.Hour), since, time.Minute, "not 30 days back")

	r.send(t, "late", "ghost")
	res, err := b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, 1, res.Recorded, "a report after the cursor is found")
}

// An event recorded as unreadable (Stripe refused the read when the
// destination delivered it) is read again by the listing, even when the
// listing itself no longer reaches back to it; a listing Stripe refuses for
// one account is recorded as failed and the other accounts are listed.
func TestBackfillReadsUnreadableAgain(t *testing.T) {
	t.Parallel()
	r := newBackfillRig(t, stripesim.Options{})
	r.send(t, "a", "ghost", "ghostc")
	conn := r.sim.ErrorReports(backfillConnected)[0]

	r.sim.RevokeAccess(backfillConnected)
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: r.base})
	require.NoError(t, err)
	rec, err := r.events.Receive(r.Ctx, r.Pool, stripeapi.Event{ID: conn.ID, Type: conn.Type, Created: conn.Created, Context: conn.Context},
		client.Event, reconcile.ArrivalDestination)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReceiptUnreadable, rec.Status)
	require.Equal(t, "account_invalid", rec.Refusal.Code)

	b := r.backfill(t)
	res, err := b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Equal(t, []string{backfillConnected}, res.Failed)
	require.Equal(t, 1, res.Recorded, "the platform's report")
	ls, err := reconcile.Listings(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Len(t, ls, 2)
	require.Equal(t, backfillConnected, ls[0].Account)
	require.False(t, ls[0].Listed)
	require.Equal(t, &outbox.ErrorInfo{Code: "account_invalid", Status: http.StatusForbidden}, ls[0].Failure)
	require.Equal(t, map[outbox.State]int{outbox.StateAccepted: 1}, r.states(t)["ghostc"])

	// Access back, and the connected account's cursor past the report:
	// only the read of unreadable events finds it.
	r.sim.RestoreAccess(backfillConnected)
	_, err = r.Pool.Exec(r.Ctx, `UPDATE stripe_event_listings SET last_created = clock_timestamp() + interval '2 hours' WHERE account = $1`,
		backfillConnected)
	require.NoError(t, err)
	res, err = b.Run(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Empty(t, res.Failed)
	require.Equal(t, 1, res.Recorded)
	require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, r.states(t)["ghostc"])
	var status, arrival string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT status, arrival FROM stripe_events WHERE id = $1`, conn.ID).Scan(&status, &arrival))
	require.Equal(t, [2]string{"recorded", "destination"}, [2]string{status, arrival}, "as it first arrived")
}

// Whatever shape Stripe's samples name the failed request in — the example
// payload's {"id", "idempotency_key"} (the simulator's default), stripe-go
// v82's {"identifier"}, or the request's id alone — a v1 report reaches its
// item.
func TestBackfillEverySampleShape(t *testing.T) {
	t.Parallel()
	for name, shape := range map[string]stripesim.SampleShape{
		"request": stripesim.SamplesRequest, "identifier": stripesim.SamplesIdentifier, "request id": stripesim.SamplesRequestID,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := newBackfillRig(t, stripesim.Options{Samples: shape})
			r.send(t, "a", "plat", "ghost", "ghostc")
			res, err := r.backfill(t).Run(r.Ctx, r.Pool)
			require.NoError(t, err)
			require.Equal(t, 2, res.Recorded)
			st := r.states(t)
			require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, st["ghost"])
			require.Equal(t, map[outbox.State]int{outbox.StateQuarantined: 1}, st["ghostc"])
			require.Equal(t, map[outbox.State]int{outbox.StateAccepted: 1}, st["plat"])
		})
	}
}
