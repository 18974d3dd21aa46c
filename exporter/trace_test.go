package exporter_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/outbox"
)

// Every Stripe call and every transition batch has a span, with HTTP and
// messaging attributes, and none carries the key, a customer or an
// identifier. (Not parallel: the tracer provider is the process's.)
func TestSpansAroundStripeCallsAndBatches(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	before := otel.GetTracerProvider()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	defer otel.SetTracerProvider(before)

	r := newRig(t, outbox.Config{Lease: 10 * time.Second})
	stop := r.run(t, 2*time.Second)
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil), stagetest.Ev("l2", "t2", "logins", 1, nil))
	require.Eventually(t, func() bool { return r.counts(t)[outbox.StateAccepted] == 2 }, 10*time.Second, 10*time.Millisecond)
	stop()

	var identifiers []string
	rows, err := r.Pool.Query(context.Background(), `SELECT identifier FROM outbox_items`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		identifiers = append(identifiers, id)
	}
	names := map[string]int{}
	attrs := map[string]map[attribute.Key]attribute.Value{}
	for _, s := range rec.Ended() {
		names[s.Name()]++
		m := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes() {
			m[kv.Key] = kv.Value
			v := kv.Value.String()
			require.NotContains(t, v, stripesim.DefaultKey)
			require.False(t, strings.HasPrefix(v, "cus_"), "a customer in %s: %s", s.Name(), v)
			for _, id := range identifiers {
				require.NotEqual(t, id, v)
			}
		}
		attrs[s.Name()] = m
	}
	require.Equal(t, 2, names["POST meter_events"], "%v", names)
	post := attrs["POST meter_events"]
	require.Equal(t, "POST", post["http.request.method"].AsString())
	require.Equal(t, int64(200), post["http.response.status_code"].AsInt64())
	require.Equal(t, "meter_events", post["url.template"].AsString())
	require.Positive(t, names["claim tally_outbox"])
	require.Positive(t, names["settle tally_outbox"])
	settle := attrs["settle tally_outbox"]
	require.Equal(t, "tally_outbox", settle["messaging.system"].AsString())
	require.Equal(t, []string{"accept", "retry", "mark_uncertain", "reject", "quarantine"}, settle["tally.outbox.transition"].AsStringSlice())
	require.Positive(t, settle["messaging.batch.message_count"].AsInt64())
}
