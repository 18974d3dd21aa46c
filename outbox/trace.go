package outbox

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// tracer makes a span per transition batch (messaging semantic
// conventions: the outbox is the queue), on the global provider — a no-op
// unless telemetry.Setup installed one. Spans carry counts and the names of
// the transitions the batch may run, never an item's identity or payload.
var tracer = otel.Tracer("github.com/tallymeter/tally/outbox")

func batchSpan(ctx context.Context, op string, transitions ...Transition) (context.Context, trace.Span) {
	names := make([]string, len(transitions))
	for i, t := range transitions {
		names[i] = string(t)
	}
	return tracer.Start(ctx, op+" tally_outbox", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(semconv.MessagingSystemKey.String("tally_outbox"), semconv.MessagingOperationName(op),
			semconv.MessagingDestinationName("outbox_items"), attribute.StringSlice("tally.outbox.transition", names)))
}

func endBatch(span trace.Span, n int, err error) {
	span.SetAttributes(semconv.MessagingBatchMessageCount(n))
	if err != nil {
		span.SetAttributes(semconv.ErrorTypeKey.String("outbox_error"))
		span.SetStatus(codes.Error, "the batch failed")
	}
	span.End()
}
