package meter

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/outbox"
)

// Target is where staged items are addressed: the exporter and this node's
// destination, and the timestamps the provider accepts.
type Target struct {
	// Exporter names the node's exporter (TALLY_EXPORTER), part of every
	// item's identity; a feature mapping that names another exporter
	// overrides it for that feature's items.
	Exporter string
	// Account is the destination account; empty stages items quarantined
	// as no_account.
	Account string
	// Mode is the destination's mode.
	Mode outbox.Mode
	// AcceptPast and AcceptFuture bound the event timestamps the provider
	// accepts, relative to the database clock at staging (Stripe v1: 35
	// days back, 5 minutes ahead). Outside them an item is quarantined as
	// timestamp_window.
	AcceptPast, AcceptFuture time.Duration
	// MaxValue is the largest magnitude of a value the provider takes
	// (Stripe: 15 digits, stripeapi.MaxValue); 0 means a signed 64-bit
	// value's own range. A sum window is split into supplements whose values
	// fit; an item whose value still does not fit (one event alone, or a
	// last value) is quarantined as value_digits, never truncated.
	MaxValue int64
}

// maxValue is the largest magnitude a value may have.
func (t Target) maxValue() int64 {
	if t.MaxValue <= 0 {
		return math.MaxInt64
	}
	return t.MaxValue
}

// valueFits reports whether v is within ±maxValue.
func (t Target) valueFits(v int64) bool {
	m := t.maxValue()
	return v >= -m && v <= m
}

func (t Target) validate() error {
	if t.Exporter == "" || (t.Mode != outbox.ModeLive && t.Mode != outbox.ModeTest) || t.AcceptPast <= 0 || t.AcceptFuture < 0 {
		return fmt.Errorf("meter: incomplete staging target (exporter %q, mode %q, accepted past %s, future %s)",
			t.Exporter, t.Mode, t.AcceptPast, t.AcceptFuture)
	}
	return nil
}

// timestampsAhead reports, for each event, whether its timestamp is further
// ahead than the provider accepts, by the database clock.
func timestampsAhead(ctx context.Context, tx pgx.Tx, target Target, evs []stagedEvent) ([]bool, error) {
	stamps := make([]time.Time, len(evs))
	for i, e := range evs {
		stamps[i] = e.at
	}
	rows, err := tx.Query(ctx, `SELECT ts > clock_timestamp() + @future::interval
		FROM unnest(@stamps::timestamptz[]) WITH ORDINALITY AS u(ts, n) ORDER BY n`,
		pgx.NamedArgs{"future": target.AcceptFuture, "stamps": stamps})
	if err != nil {
		return nil, fmt.Errorf("checking timestamps: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[bool])
}

// timestampReason is timestamp_window when ts is outside what the provider
// accepts, by the database clock.
func timestampReason(ctx context.Context, tx pgx.Tx, target Target, ts time.Time) (outbox.Reason, error) {
	out, err := timestampsOutside(ctx, tx, target, []time.Time{ts})
	if err != nil {
		return "", err
	}
	if out[0] {
		return outbox.ReasonTimestampWindow, nil
	}
	return "", nil
}

func timestampsOutside(ctx context.Context, tx pgx.Tx, target Target, stamps []time.Time) ([]bool, error) {
	rows, err := tx.Query(ctx, `
		SELECT ts < clock_timestamp() - @past::interval OR ts > clock_timestamp() + @future::interval
		FROM unnest(@stamps::timestamptz[]) WITH ORDINALITY AS u(ts, n) ORDER BY n`,
		pgx.NamedArgs{"past": target.AcceptPast, "future": target.AcceptFuture, "stamps": stamps})
	if err != nil {
		return nil, fmt.Errorf("checking timestamps: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[bool])
}
