package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"

	"github.com/tallymeter/tally/internal/telemetry"
)

// With OTEL_EXPORTER_OTLP_ENDPOINT set, spans reach the collector over
// OTLP/HTTP; the shutdown flushes them. (Not parallel: the environment and
// the global provider are the process's.)
func TestSpansAreExportedOverOTLP(t *testing.T) {
	var (
		mu       sync.Mutex
		requests []string
	)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		requests = append(requests, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type"))
		mu.Unlock()
		require.NotEmpty(t, b)
		w.WriteHeader(http.StatusOK)
	}))
	defer collector.Close()

	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	require.False(t, telemetry.Enabled())
	before := otel.GetTracerProvider()
	shutdown, err := telemetry.Setup(context.Background(), "test")
	require.NoError(t, err)
	shutdown()
	require.Equal(t, before, otel.GetTracerProvider(), "disabled: nothing installed")

	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
	require.True(t, telemetry.Enabled())
	shutdown, err = telemetry.Setup(context.Background(), "test")
	require.NoError(t, err)
	defer otel.SetTracerProvider(before)
	_, span := otel.Tracer("test").Start(context.Background(), "a span")
	span.End()
	shutdown()
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"POST /v1/traces application/x-protobuf"}, requests)
}
