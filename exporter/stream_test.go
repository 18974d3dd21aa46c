package exporter_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// runStream runs a stream deliverer (batches of up to 100, BestEffort, its
// own limiter) and the outbox's maintenance, as tally serve does, until
// stop is called.
func (r *rig) runStream(t *testing.T, timeout time.Duration) (exp *exporter.StripeStream, stop func()) {
	return r.runStreamWith(t, timeout, exporter.DelivererConfig{Workers: 3, Batch: 500, InFlight: 1000})
}

func (r *rig) runStreamWith(t *testing.T, timeout time.Duration, cfg exporter.DelivererConfig) (exp *exporter.StripeStream, stop func()) {
	t.Helper()
	exp = exporter.NewStripeStream(r.resolver.Client(), timeout)
	cfg.RecordBatch, cfg.Policy, cfg.PollInterval = 1000, outbox.BestEffort, 50*time.Millisecond
	d, err := exporter.NewDeliverer(cfg, r.Outbox, r.Pool, exp, timeout, r.resolver.Destination, exporter.NewStreamLimiter(200_000), nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	go func() { defer wg.Done(); _ = r.Outbox.RunMaintenance(ctx, r.Pool, 50*time.Millisecond, slog.Default()) }()
	return exp, func() { cancel(); wg.Wait() }
}

// streamRig is a rig whose stager addresses items to the stream exporter.
func streamRig(t *testing.T, cfg outbox.Config, opts ...func(*stripesim.Options)) *rig {
	r := newRig(t, cfg, opts...)
	r.Target.Exporter = exporter.StripeMeterEventStream
	return r
}

// ingestMany posts n events of each feature, for tenants t0..t9, and
// returns the per-tenant sums (api) and counts (logins) the simulator must
// end with.
func (r *rig) ingestMany(t *testing.T, prefix string, n int) (sums map[string]int64, counts map[string]int) {
	t.Helper()
	sums, counts = map[string]int64{}, map[string]int{}
	var evs []meter.Event
	for i := 0; i < n; i++ {
		tenant := fmt.Sprintf("t%d", i%10)
		evs = append(evs,
			stagetest.Ev(fmt.Sprintf("%sa%d", prefix, i), tenant, "api", int64(i%7)-1, stagetest.Ago(2*time.Hour+time.Duration(i)*time.Second)),
			stagetest.Ev(fmt.Sprintf("%sl%d", prefix, i), tenant, "logins", 1, nil))
		sums[tenant] += int64(i%7) - 1
		counts[tenant]++
		if len(evs) >= 1000 {
			r.MustIngest(t, evs...)
			evs = evs[:0]
		}
	}
	if len(evs) > 0 {
		r.MustIngest(t, evs...)
	}
	r.Pass(t)
	return sums, counts
}

// checkSim requires every item accepted, the simulator's aggregates equal
// to the ledger's, and no identifier recorded twice.
func (r *rig) checkSim(t *testing.T, sums map[string]int64, counts map[string]int) {
	t.Helper()
	c := r.waitDrained(t)
	require.Zero(t, c[outbox.StateUncertain]+c[outbox.StateRejected]+c[outbox.StateQuarantined], "%v", c)
	for tenant, want := range sums {
		sum, _, _ := r.sim.Aggregate(stripesim.DefaultAccount, "api", "cus_"+tenant)
		require.Equal(t, want, sum, tenant)
		_, n, _ := r.sim.Aggregate(stripesim.DefaultAccount, "logins", "cus_"+tenant)
		require.Equal(t, counts[tenant], n, tenant)
	}
	require.Empty(t, r.sim.RecordedTwice(), "no identifier recorded twice")
	var notStream int
	for _, ev := range r.sim.Events(stripesim.DefaultAccount) {
		if !ev.Stream {
			notStream++
		}
	}
	require.Zero(t, notStream, "every event went through the stream")
}

// streamCalls counts the stream requests the simulator answered, by status.
func streamCalls(sim *stripesim.Server) map[int]int {
	out := map[int]int{}
	for _, rq := range sim.Requests() {
		if rq.Path == "/v2/billing/meter_event_stream" {
			out[rq.Status]++
		}
	}
	return out
}

// Sessions expiring again and again while events flow — every stream
// request in flight may meet an expired token — lose and duplicate nothing:
// an expired-session answer processed nothing, so the exporter renews the
// session and sends the same request again.
func TestStreamSessionExpiryMidRunLosesAndDuplicatesNothing(t *testing.T) {
	t.Parallel()
	r := streamRig(t, outbox.Config{BackoffBase: 10 * time.Millisecond, BackoffCap: 50 * time.Millisecond, Lease: 10 * time.Second})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{Latency: time.Millisecond, LatencyJitter: 2 * time.Millisecond}})
	exp, stop := r.runStream(t, 2*time.Second)
	defer stop()

	var expired atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		// From the first session on, for a second: the events are still
		// flowing then.
		for start := time.Now(); testutil.ToFloat64(exp.Collector()) < 1 && time.Since(start) < 30*time.Second; {
			time.Sleep(time.Millisecond)
		}
		for i := 0; i < 200; i++ {
			expired.Add(int64(r.sim.ExpireSessions(stripesim.DefaultAccount)))
			time.Sleep(5 * time.Millisecond)
		}
	}()
	sums, counts := r.ingestMany(t, "", 3000)
	<-done
	r.checkSim(t, sums, counts)

	calls := streamCalls(r.sim)
	require.Positive(t, expired.Load(), "sessions were expired mid-run")
	require.Positive(t, calls[http.StatusUnauthorized], "some requests met an expired session: %v", calls)
	require.Greater(t, testutil.ToFloat64(exp.Collector()), 1.0, "the exporter renewed its session")
	var notes int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_attempts WHERE error_code = 'stream_session'`).Scan(&notes))
	t.Logf("%d sessions expired, stream calls by status %v, %d attempts gave up on a session", expired.Load(), calls, notes)
}

// The simulator's clock passing a session's 15 minutes expires it on
// Stripe's side, before the exporter's own renewal: the expired-session
// answer renews it and nothing is lost or sent twice.
func TestStreamSessionExpiredByTheClock(t *testing.T) {
	t.Parallel()
	var skew atomic.Int64
	r := streamRig(t, outbox.Config{BackoffBase: 10 * time.Millisecond, BackoffCap: 50 * time.Millisecond, Lease: 10 * time.Second},
		func(o *stripesim.Options) {
			o.Now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
		})
	exp, stop := r.runStream(t, 2*time.Second)
	defer stop()
	sums, counts := r.ingestMany(t, "a", 200)
	r.waitDrained(t)
	skew.Store(int64(16 * time.Minute))
	more, moreCounts := r.ingestMany(t, "b", 200)
	for k, v := range more {
		sums[k] += v
	}
	for k, v := range moreCounts {
		counts[k] += v
	}
	r.checkSim(t, sums, counts)
	require.Positive(t, streamCalls(r.sim)[http.StatusUnauthorized])
	require.Equal(t, 2.0, testutil.ToFloat64(exp.Collector()))
}

// Batches carry up to 100 events: far fewer requests than items.
func TestStreamBatches(t *testing.T) {
	t.Parallel()
	r := streamRig(t, outbox.Config{Lease: 10 * time.Second})
	_, stop := r.runStream(t, 2*time.Second)
	defer stop()
	sums, counts := r.ingestMany(t, "", 1000)
	r.checkSim(t, sums, counts)
	calls := streamCalls(r.sim)
	require.Equal(t, len(calls), 1, "every request answered 2xx: %v", calls)
	items := len(r.Items(t))
	for status, n := range calls {
		require.True(t, status >= 200 && status < 300, "%v", calls)
		require.GreaterOrEqual(t, n, (items+99)/100)
		require.Less(t, n, items/5, "batched: %d requests for %d items", n, items)
	}
}

// The stream's faults (5xx before processing, lost replies, 429s) end like
// v1's: every item accepted once.
func TestStreamFaults(t *testing.T) {
	t.Parallel()
	r := streamRig(t, outbox.Config{BackoffBase: 10 * time.Millisecond, BackoffCap: 50 * time.Millisecond, RateLimitDelay: 20 * time.Millisecond, Lease: 10 * time.Second})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{
		FailBeforeRecord: 0.15, LoseReply: 0.15, RateLimitFault: 0.1, Latency: time.Millisecond, LatencyJitter: 3 * time.Millisecond}})
	_, stop := r.runStream(t, 2*time.Second)
	defer stop()
	sums, counts := r.ingestMany(t, "", 2000)
	r.checkSim(t, sums, counts)
	calls := streamCalls(r.sim)
	for _, s := range []int{429, 500, 502} {
		require.Positive(t, calls[s], "status %d among %v", s, calls)
	}
}

// A request Stripe refuses for its content processed no event of it: the
// exporter splits it until the refused event stands alone, and every other
// event is accepted once. The lone refusal carries no param (stripe-go's
// V2RawError has none) and no wording Tally recognises, so it waits in
// quarantine for a human (provider_refused) rather than ending terminal.
func TestStreamSplitsARefusedRequest(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	exp := exporter.NewStripeStream(r.resolver.Client(), 2*time.Second)
	ts := time.Now().Add(-time.Hour).Unix()
	items := make([]outbox.Lease, 10)
	for i := range items {
		items[i].Payload = outbox.Payload{EventName: "logins", Customer: fmt.Sprintf("cus_t%d", i), Value: 1, Timestamp: ts,
			Identifier: fmt.Sprintf("tly_split_%d", i)}
	}
	items[6].Payload.Identifier = "tly_" + strings.Repeat("x", 120) // over Stripe's 100 characters
	var waits atomic.Int64
	var events atomic.Int64
	out := exp.SendBatch(r.Ctx, items, func(_ context.Context, n int) error { waits.Add(1); events.Add(int64(n)); return nil })
	for i, o := range out {
		if i == 6 {
			require.Equal(t, outbox.Quarantined, o.Kind, "%+v", o)
			require.Equal(t, outbox.ReasonProviderRefused, o.Reason)
			require.Equal(t, http.StatusBadRequest, o.Error.Status)
			continue
		}
		require.Equal(t, outbox.Accepted, o.Kind, "item %d: %+v", i, o)
	}
	require.Len(t, r.sim.Events(stripesim.DefaultAccount), 9)
	calls := streamCalls(r.sim)
	require.Equal(t, int(waits.Load()), calls[200]+calls[202]+calls[400], "every request waited for the limiter: %v", calls)
	// 10, then halves of 5 down to the refused event alone: each request
	// waited for its own events.
	require.Greater(t, events.Load(), int64(len(items)), "a split's requests wait for their events")
	require.LessOrEqual(t, calls[400], 4, "a refused request is split in halves: %v", calls)
}

// A key Stripe refuses stalls the stream like v1: retried as refused, never
// rejected.
func TestStreamRefusedKey(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	exp := exporter.NewStripeStream(r.resolver.Client(), 2*time.Second)
	r.sim.RevokeKey(stripesim.DefaultKey)
	out := exp.SendBatch(r.Ctx, []outbox.Lease{{Item: outbox.Item{Payload: outbox.Payload{EventName: "logins", Customer: "cus_t1",
		Value: 1, Timestamp: time.Now().Unix(), Identifier: "tly_key"}}}}, nil)
	require.Equal(t, outbox.Retry, out[0].Kind, "%+v", out[0])
	require.True(t, out[0].Refused)
	require.Equal(t, http.StatusUnauthorized, out[0].Error.Status)
	require.Equal(t, "stripe_auth", out[0].Error.Code)
	require.Empty(t, streamCalls(r.sim), "nothing reached the stream")
}

// More workers than the send slots hold full requests: each worker waits
// for a request's worth of slots, one at a time, so that slots freed by the
// sends in flight are never spread over workers that each hold too few to
// send and wait for ever.
func TestStreamDelivererWithFewSlotsForItsWorkers(t *testing.T) {
	t.Parallel()
	r := streamRig(t, outbox.Config{Lease: 10 * time.Second})
	_, stop := r.runStreamWith(t, 2*time.Second, exporter.DelivererConfig{Workers: 6, Batch: 1000, InFlight: 150})
	defer stop()
	sums, counts := r.ingestMany(t, "", 1500)
	r.checkSim(t, sums, counts)
}
