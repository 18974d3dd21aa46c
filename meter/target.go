package meter

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// Target is where staged items are addressed: the exporter and this node's
// destination, and the timestamps the provider accepts.
type Target struct {
	// Exporter names the node's exporter (TALLY_EXPORTER), part of every
	// item's identity; a feature mapping that names another exporter
	// overrides it for that feature's items.
	Exporter string
	// Account is the node's destination account; empty stages items
	// quarantined as no_account. A tenant mapping's stripe_account (a
	// connected account) overrides it for that tenant's items.
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
	// InvoiceGrace is how long after a billing period ends its invoice
	// stays open to usage (TALLY_INVOICE_GRACE; Stripe's invoice
	// finalization grace period, 1 hour by default, at most 72 hours); a
	// tenant mapping's invoice_grace overrides it. Usage staged later than
	// that is late: Stripe would record it and bill it on no invoice.
	InvoiceGrace time.Duration
	// LateUsage is what staging does with late usage (TALLY_LATE_USAGE):
	// LateQuarantine quarantines it as period_closed, LateSend sends it.
	// Either way its payload is marked late and counted.
	LateUsage LatePolicy
}

// LatePolicy is what staging does with usage staged after its billing
// period's invoice closed (TALLY_LATE_USAGE).
type LatePolicy string

// Late usage policies.
const (
	// LateQuarantine quarantines late usage as period_closed, for finance
	// to look at and requeue knowingly: the default.
	LateQuarantine LatePolicy = "quarantine"
	// LateSend sends it: Stripe records it on no invoice unless the
	// invoice was not finalized after all (a longer grace in Stripe than
	// Tally was told).
	LateSend LatePolicy = "send"
)

// MaxInvoiceGrace is the longest invoice finalization grace period Stripe
// lets an account set (docs/stripe.md).
const MaxInvoiceGrace = mappings.MaxInvoiceGrace

// graceOf is the invoice grace of pair's tenant: its mapping's, else the
// node's.
func (t Target) graceOf(pair mappings.Pair) time.Duration {
	if pair.Tenant != nil && pair.Tenant.InvoiceGrace != nil {
		return time.Duration(*pair.Tenant.InvoiceGrace)
	}
	return t.InvoiceGrace
}

// accountOf is the destination account of pair's usage: the tenant
// mapping's connected account (stripe_account) when it names one, else the
// node's (Account).
func (t Target) accountOf(pair mappings.Pair) string {
	if pair.Tenant != nil && pair.Tenant.StripeAccount != "" {
		return pair.Tenant.StripeAccount
	}
	return t.Account
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
	if (t.LateUsage != LateQuarantine && t.LateUsage != LateSend) || t.InvoiceGrace < 0 || t.InvoiceGrace > MaxInvoiceGrace {
		return fmt.Errorf("meter: staging target: late usage policy %q (want quarantine or send), invoice grace %s (want 0 to %s)",
			t.LateUsage, t.InvoiceGrace, MaxInvoiceGrace)
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
	rows, err := tx.Query(ctx, `SELECT ts > statement_timestamp() + @future::interval
		FROM unnest(@stamps::timestamptz[]) WITH ORDINALITY AS u(ts, n) ORDER BY n`,
		pgx.NamedArgs{"future": target.AcceptFuture, "stamps": stamps})
	if err != nil {
		return nil, fmt.Errorf("checking timestamps: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[bool])
}

// stampCheck is what staging asks the database clock about one item: its
// timestamp, and the end of its billing period with the invoice grace
// after it.
type stampCheck struct {
	at, periodEnd time.Time
	grace         time.Duration
}

// stampCheckOf is the check of an item of pair's usage stamped at, in the
// billing period that contains inPeriod.
func (t Target) stampCheckOf(pair mappings.Pair, at, inPeriod time.Time) stampCheck {
	return stampCheck{at: at, periodEnd: PeriodEnd(inPeriod, anchorOf(pair)), grace: t.graceOf(pair)}
}

// stampVerdict is the database clock's answer to a stampCheck.
type stampVerdict struct {
	// outside: the timestamp is outside what the provider accepts.
	outside bool
	// late: the period's invoice has closed (its end plus the grace has
	// passed).
	late bool
}

// reason is the quarantine reason the verdict gives an item with no other
// one under the target's policy: timestamp_window, period_closed, or "".
func (v stampVerdict) reason(t Target) outbox.Reason {
	switch {
	case v.outside:
		return outbox.ReasonTimestampWindow
	case v.late && t.LateUsage == LateQuarantine:
		return outbox.ReasonPeriodClosed
	}
	return ""
}

// apply marks it late and gives it the verdict's reason if it has none.
// An item quarantined for another reason is still marked late: fixed and
// requeued, it is rebuilt and checked again.
func (v stampVerdict) apply(t Target, it *outbox.NewItem) {
	it.Payload.Late = v.late && !v.outside
	if it.Quarantine == "" {
		it.Quarantine = v.reason(t)
	}
}

// checkStamps asks the database clock about each item's times (durations
// are never compared in Go).
func checkStamps(ctx context.Context, tx pgx.Tx, target Target, checks []stampCheck) ([]stampVerdict, error) {
	stamps, ends, graces := make([]time.Time, len(checks)), make([]time.Time, len(checks)), make([]time.Duration, len(checks))
	for i, c := range checks {
		stamps[i], ends[i], graces[i] = c.at, c.periodEnd, c.grace
	}
	rows, err := tx.Query(ctx, `
		SELECT ts < statement_timestamp() - @past::interval OR ts > statement_timestamp() + @future::interval,
		       pe + g < statement_timestamp()
		FROM unnest(@stamps::timestamptz[], @ends::timestamptz[], @graces::interval[]) WITH ORDINALITY AS u(ts, pe, g, n)
		ORDER BY n`,
		pgx.NamedArgs{"past": target.AcceptPast, "future": target.AcceptFuture, "stamps": stamps, "ends": ends, "graces": graces})
	if err != nil {
		return nil, fmt.Errorf("checking timestamps: %w", err)
	}
	var v stampVerdict
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (stampVerdict, error) {
		err := r.Scan(&v.outside, &v.late)
		return v, err
	})
}
