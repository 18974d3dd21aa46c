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
// unless telemetry.Setup installed one. Spans carry counts and transitions,
// never an item's identity or payload.
var tracer = otel.Tracer("github.com/tallymeter/tally/outbox")

func batchSpan(ctx context.Context, op, transition string) (context.Context, trace.Span) {
	return tracer.Start(ctx, op+" tally_outbox", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(semconv.MessagingSystemKey.String("tally_outbox"), semconv.MessagingOperationName(op),
			semconv.MessagingDestinationName("outbox_items"), attribute.String("tally.outbox.transition", transition)))
}

func endBatch(span trace.Span, n int, err error) {
	span.SetAttributes(semconv.MessagingBatchMessageCount(n))
	if err != nil {
		span.SetAttributes(semconv.ErrorTypeKey.String("outbox_error"))
		span.SetStatus(codes.Error, "the batch failed")
	}
	span.End()
}
