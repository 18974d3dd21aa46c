package exporter_test

// Tests of the exporters against Stripe as documented (docs/stripe.md), on
// the simulator configured to behave as Stripe's pages and stripe-go's code
// say — not as Tally would like it to.

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// A meter names its own payload keys (customer_mapping.event_payload_key,
// value_settings.event_payload_key; docs.stripe.com/api/billing/meter/create).
// The feature mapping reads them from the account's meter, its items carry
// them, and both exporters send the customer and the value under them: the
// simulator, which checks the meter's keys as Stripe does, records every
// event for the right customer.
func TestMeterWithCustomPayloadKeysGetsCorrectEventsFromBothExporters(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.Maps.Checker = mappings.StripeMeters{Client: r.resolver.Client()}
	for _, m := range []struct{ event, formula string }{{"gpu", "sum"}, {"jobs", "count"}} {
		r.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: m.event, Formula: m.formula,
			CustomerPayloadKey: "account_ref", ValuePayloadKey: "units"})
	}
	gpu := r.FeatureWith(t, "gpu", mappings.FeatureInput{EventName: "gpu", Aggregation: mappings.Sum, Window: mappings.Duration(time.Hour)})
	require.Equal(t, "account_ref", gpu.CustomerPayloadKey, "read from the meter")
	require.Equal(t, "units", gpu.ValuePayloadKey)
	r.FeatureWith(t, "jobs", mappings.FeatureInput{EventName: "jobs", Aggregation: mappings.Count,
		Exporter: exporter.StripeMeterEventStream})

	sums := map[string]int64{}
	counts := map[string]int{}
	var evs = make([]stagetestEvent, 0, 200)
	for i := range 100 {
		tenant := fmt.Sprintf("t%d", i%10)
		evs = append(evs, stagetestEvent{fmt.Sprintf("g%d", i), tenant, "gpu", int64(i + 1)}, stagetestEvent{fmt.Sprintf("j%d", i), tenant, "jobs", 1})
		sums[tenant] += int64(i + 1)
		counts[tenant]++
	}
	r.ingest(t, evs, 2*time.Hour)
	for _, it := range r.Items(t) {
		require.Contains(t, []string{"gpu", "jobs"}, it.Feature)
	}
	var ck, vk string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT payload ->> 'customer_key', payload ->> 'value_key' FROM outbox_items LIMIT 1`).Scan(&ck, &vk))
	require.Equal(t, [2]string{"account_ref", "units"}, [2]string{ck, vk}, "each item carries the keys it is sent with")

	stopV1 := r.run(t, 2*time.Second)
	defer stopV1()
	_, stopStream := r.runStream(t, 2*time.Second)
	defer stopStream()
	c := r.waitDrained(t)
	require.Zero(t, c[outbox.StateQuarantined]+c[outbox.StateRejected]+c[outbox.StateUncertain], "%v", c)
	for tenant, want := range sums {
		sum, _, _ := r.sim.Aggregate(stripesim.DefaultAccount, "gpu", "cus_"+tenant)
		require.Equal(t, want, sum, tenant)
		_, n, _ := r.sim.Aggregate(stripesim.DefaultAccount, "jobs", "cus_"+tenant)
		require.Equal(t, counts[tenant], n, tenant)
	}
	byStream := map[bool]int{}
	for _, ev := range r.sim.Events(stripesim.DefaultAccount) {
		byStream[ev.Stream]++
	}
	require.Positive(t, byStream[false], "v1 sent the gpu windows")
	require.Equal(t, 100, byStream[true], "the stream sent the jobs")
}

// Stripe saves the first answer to an Idempotency-Key once the endpoint has
// started executing — 500s included — and replays it for 24 hours; most
// 500s carry Stripe-Should-Retry: false for that reason
// (docs.stripe.com/api/idempotent_requests; stripe-go's shouldRetry). With
// every 500 saved, before and after recording, an item is still accepted
// once: each attempt has a key of its own, and the identifier turns the
// resend of a recorded event into the duplicate 400, which is success.
func TestSavedFiveHundredsNeitherFreezeNorDuplicate(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{BackoffBase: 10 * time.Millisecond, BackoffCap: 20 * time.Millisecond})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 0.3, FailAfterRecord: 0.3}})
	stop := r.run(t, 2*time.Second)
	defer stop()
	for i := range 40 {
		r.MustIngest(t, stagetest.Ev(fmt.Sprintf("l%d", i), fmt.Sprintf("t%d", i%10), "logins", 1, nil))
	}
	c := r.waitDrained(t)
	require.Equal(t, int64(40), c[outbox.StateAccepted], "%v", c)
	require.Empty(t, r.sim.RecordedTwice())
	keys := map[string]bool{}
	fivehundreds := 0
	for _, rq := range r.sim.Requests() {
		if rq.Path != "/v1/billing/meter_events" {
			continue
		}
		require.False(t, keys[rq.IdempotencyKey], "a key per attempt: %s sent twice", rq.IdempotencyKey)
		keys[rq.IdempotencyKey] = true
		require.False(t, rq.Replayed)
		if rq.Status == 500 {
			fivehundreds++
		}
	}
	require.Positive(t, fivehundreds)
	for i := range 10 {
		_, n, _ := r.sim.Aggregate(stripesim.DefaultAccount, "logins", fmt.Sprintf("cus_t%d", i))
		require.Equal(t, 4, n)
	}
}

// Some validation is asynchronous even on v1: Stripe answers 200 and
// reports the failure later (docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api,
// "Handle meter event errors"). A v1 item sent for a customer Stripe does
// not know is accepted, then the report — whose sample names the request's
// Idempotency-Key, as stripe-go documents the field — moves it to
// quarantined (T10); once the customer exists, a requeue re-addresses it
// and the usage is billed once.
func TestV1AsynchronousValidationReachesTheItem(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.sim.ConfigureDefault(stripesim.Limits{AsyncValidation: true})
	r.Tenant(t, "ghost", nil) // cus_ghost: not at Stripe
	r.MustIngest(t, stagetest.Ev("g1", "ghost", "logins", 1, nil), stagetest.Ev("ok1", "t1", "logins", 1, nil))
	stop := r.run(t, 2*time.Second)
	c := r.waitDrained(t)
	stop()
	require.Equal(t, int64(2), c[outbox.StateAccepted], "Stripe answered 200 to both: %v", c)

	reports := r.sim.ErrorReports(stripesim.DefaultAccount)
	require.Len(t, reports, 1)
	require.Equal(t, stripesim.CodeCustomerNotFound, reports[0].Code)
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: r.base})
	require.NoError(t, err)
	full, err := client.MeterErrorEvent(r.Ctx, reports[0].ID)
	require.NoError(t, err)
	res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, full)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 1}, res, "the sample names the request's key, traced to the item")

	var id int64
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT id FROM outbox_items WHERE tenant_key = 'ghost'`).Scan(&id))
	it, err := r.Outbox.Get(r.Ctx, r.Pool, id)
	require.NoError(t, err)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonCustomerNotFound, it.QuarantineReason)

	r.sim.CreateCustomer(stripesim.DefaultAccount, "cus_ghost")
	rq := &quarantine.Requeuer{Outbox: r.Outbox, Stager: r.Stager}
	rr, err := rq.Requeue(r.Ctx, r.Pool, id, it.MappingVersion, "test")
	require.NoError(t, err)
	require.Equal(t, quarantine.ActionReaddressed, rr.Action)
	stop = r.run(t, 2*time.Second)
	defer stop()
	c = r.waitDrained(t)
	require.Equal(t, int64(2), c[outbox.StateAccepted], "%v", c)
	_, n, _ := r.sim.Aggregate(stripesim.DefaultAccount, "logins", "cus_ghost")
	require.Equal(t, 1, n, "billed once, under the successor's identifier")
}

// stagetestEvent is one usage event to ingest.
type stagetestEvent struct {
	id, tenant, feature string
	value               int64
}

// ingest posts evs, timestamped ago before now, in batches, and stages
// what is due.
func (r *rig) ingest(t *testing.T, evs []stagetestEvent, ago time.Duration) {
	t.Helper()
	for i, e := range evs {
		r.MustIngest(t, stagetest.Ev(e.id, e.tenant, e.feature, e.value, stagetest.Ago(ago+time.Duration(i)*time.Second)))
	}
	r.Pass(t)
}
