// Package telemetry sets up OpenTelemetry tracing for a Tally process:
// spans around every call to Stripe (internal/stripeapi) and every outbox
// transition batch (outbox), exported over OTLP/HTTP when
// OTEL_EXPORTER_OTLP_ENDPOINT is set (with the exporter's other standard
// OTEL_* variables), and discarded at no cost otherwise.
//
// It must never put a secret, a tenant's usage or a provider's body into
// a span: spans carry methods, endpoints, statuses, counts and codes.
package telemetry

import (
	"context"
	"os"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
)

// Enabled reports whether traces are exported: OTEL_EXPORTER_OTLP_ENDPOINT
// or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set.
func Enabled() bool {
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// Setup installs the global tracer provider when tracing is enabled and
// returns a shutdown that flushes the spans still buffered (bounded by
// five seconds). Disabled, it installs nothing and shutdown does nothing.
func Setup(ctx context.Context, version string) (shutdown func(), err error) {
	if !Enabled() {
		return func() {}, nil
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, err
	}
	res := resource.NewSchemaless(semconv.ServiceName("tally"), semconv.ServiceVersion(version))
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tp.Shutdown(ctx)
	}, nil
}
