package reconcile_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// Every shape of sample Stripe and stripe-go have shown reaches its item:
// request.identifier and request.idempotency_key name the identifier or
// v1's per-attempt key (<identifier>-a<n>), and request.id names the one
// accepted v1 item whose answer carried that Request-Id. An id that more
// than one item has, or a stream request's (which carries up to 100 events,
// so names none of them alone), or one no item has, names nothing.
func TestReportSamplesReachTheirItems(t *testing.T) {
	t.Parallel()
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "logins", mappings.Count, time.Hour)
	names := []string{"byID", "byKey", "byIdentifier", "byKeyAndID", "shared1", "shared2", "stream", "byStaleKey"}
	for _, n := range names {
		env.Tenant(t, strings.ToLower(n), nil)
	}
	refs := map[string]string{"byID": "req_byid", "byKeyAndID": "req_other", "shared1": "req_shared", "shared2": "req_shared",
		"stream": "req_stream", "byStaleKey": "req_stale"}
	items := map[string]outbox.Lease{}
	for _, n := range names {
		if n == "stream" {
			env.Target.Exporter = exporter.StripeMeterEventStream
		} else {
			env.Target.Exporter = exporter.StripeMeterEvents
		}
		env.MustIngest(t, stagetest.Ev("e-"+n, strings.ToLower(n), "logins", 1, stagetest.Ago(time.Hour)))
		env.Pass(t)
		leases, err := env.Outbox.Claim(env.Ctx, env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 1, Exporter: env.Target.Exporter})
		require.NoError(t, err)
		require.Len(t, leases, 1)
		_, err = env.Outbox.Record(env.Ctx, env.Pool, []outbox.Outcome{{Lease: leases[0], Kind: outbox.Accepted, ProviderRef: refs[n]}})
		require.NoError(t, err)
		items[n] = leases[0]
	}
	// byStaleKey's item is confirmed: a report no longer moves it, and an
	// id alone does not find it.
	_, _, err := env.Outbox.Confirm(env.Ctx, env.Pool, []int64{items["byStaleKey"].ID})
	require.NoError(t, err)

	code := "meter_event_customer_not_found"
	samples := []stripeapi.MeterErrorSample{
		{RequestID: "req_byid"},
		{IdempotencyKey: items["byKey"].Identifier + "-a3"},
		{Identifier: items["byIdentifier"].Identifier},
		{RequestID: "req_other", IdempotencyKey: items["byKeyAndID"].Identifier + "-a1"},
		{RequestID: "req_shared"},
		{RequestID: "req_stream"},
		{RequestID: "req_stale"},
		{RequestID: "req_nobody"},
		{IdempotencyKey: "an-other-senders-key"},
	}
	for i := range samples {
		samples[i].Code = code
	}
	res, err := reconcile.RecordReport(env.Ctx, env.Pool, env.Outbox, stripeapi.MeterErrorReport{ID: "evt_test_shapes",
		Type: stripeapi.EventMeterErrorReport, Created: time.Now(), ErrorCount: int64(len(samples)), Samples: samples})
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 4, Unmatched: 5}, res)

	for n, want := range map[string]outbox.State{"byID": outbox.StateQuarantined, "byKey": outbox.StateQuarantined,
		"byIdentifier": outbox.StateQuarantined, "byKeyAndID": outbox.StateQuarantined, "shared1": outbox.StateAccepted,
		"shared2": outbox.StateAccepted, "stream": outbox.StateAccepted, "byStaleKey": outbox.StateConfirmed} {
		it, err := env.Outbox.Get(env.Ctx, env.Pool, items[n].ID)
		require.NoError(t, err)
		require.Equal(t, want, it.State, n)
	}
	ev, err := reconcile.EvidenceOf(env.Ctx, env.Pool, []int64{items["byID"].ID, items["byKey"].ID})
	require.NoError(t, err)
	require.Len(t, ev, 2)
	for _, e := range ev {
		require.True(t, e.Identifier == items["byID"].Identifier || e.Identifier == items["byKey"].Identifier,
			"the evidence names the item's identifier, whatever the sample named it by: %+v", e)
	}
	var unmatched []string
	rows, err := env.Pool.Query(env.Ctx, `SELECT identifier FROM meter_error_evidence WHERE event_id = 'evt_test_shapes' AND item_id IS NULL ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		unmatched = append(unmatched, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"an-other-senders-key", "req_nobody", "req_shared", "req_stale", "req_stream"}, unmatched,
		"what the sample named, kept")
}
