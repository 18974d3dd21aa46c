package exporter

import (
	"context"
	"time"

	"github.com/tallymeter/tally/outbox"
)

// Exporter sends outbox items to a provider.
type Exporter interface {
	// Name is the exporter's name, part of every item's identity.
	Name() string
	// DedupWindow is how long the provider deduplicates identifiers; the
	// outbox horizon must stay below it.
	DedupWindow() time.Duration
	// Accepts is the range of event timestamps the provider accepts around
	// now: how far back, how far ahead.
	Accepts() (past, future time.Duration)
	// Send sends one leased item and says what became of it, as an outcome
	// for outbox.Record (its Lease is set by the caller). It never panics on
	// a provider's answer and never retries by itself.
	Send(ctx context.Context, item outbox.Lease) outbox.Outcome
}
