package invoices

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/quarantine"
)

// GateState is how an invoice gate stands.
type GateState string

// Gate states.
const (
	// GateWaiting: the period is not proven complete; the draft is not held.
	GateWaiting GateState = "waiting"
	// GateHeld: Tally set the draft's auto_advance to false.
	GateHeld GateState = "held"
	// GateComplete: every unit of the period was accepted by Stripe (a held
	// draft was released).
	GateComplete GateState = "complete"
	// GateReleased: the hold ran out with the period incomplete.
	GateReleased GateState = "released"
	// GateLapsed: the invoice finalized before the period was proven
	// complete.
	GateLapsed GateState = "lapsed"
)

// Defaults of the gate.
const (
	// DefaultHoldMax bounds a hold by default: a day for finance and
	// operators to fix what the period lacks.
	DefaultHoldMax = 24 * time.Hour
	// MaxHoldMax is the longest hold TALLY_INVOICE_HOLD_MAX may set, below
	// the 72 hours Stripe documents as its longest delay of a finalization.
	MaxHoldMax = 71 * time.Hour
	// DefaultSettle is how long usage of the period may stay pending
	// (staged, being sent) before the period counts as incomplete.
	// Quarantined or uncertain usage counts at once.
	DefaultSettle = 5 * time.Minute
)

// Holder changes a draft in Stripe: its auto_advance, or finalizing it.
type Holder interface {
	SetAutoAdvance(ctx context.Context, account, id string, auto bool, key string) (stripeapi.Invoice, error)
	Finalize(ctx context.Context, account, id, key string) (stripeapi.Invoice, error)
}

// SetAutoAdvance implements Holder.
func (s Stripe) SetAutoAdvance(ctx context.Context, account, id string, auto bool, key string) (stripeapi.Invoice, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return stripeapi.Invoice{}, err
	}
	return c.SetAutoAdvance(ctx, id, auto, key)
}

// Finalize implements Holder.
func (s Stripe) Finalize(ctx context.Context, account, id, key string) (stripeapi.Invoice, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return stripeapi.Invoice{}, err
	}
	return c.Finalize(ctx, id, key)
}

// Closer stages a tenant's usage of ended windows now (meter.Stager).
type Closer interface {
	CloseTenant(ctx context.Context, db pgdb.DB, tenant string) (meter.PassResult, error)
}

// Gate proves each subscription invoice's period complete before Stripe
// finalizes it, and holds the draft when configured to.
type Gate struct {
	DB     pgdb.DB
	Stager Closer
	Holder Holder
	// Hold is TALLY_INVOICE_HOLD: hold a draft whose period is incomplete.
	Hold bool
	// HoldMax is TALLY_INVOICE_HOLD_MAX (DefaultHoldMax when 0).
	HoldMax time.Duration
	// Settle is how long pending usage is waited for (DefaultSettle when 0).
	Settle  time.Duration
	Metrics *GateMetrics
	Logger  *slog.Logger
}

func (g *Gate) holdMax() time.Duration {
	if g.HoldMax > 0 {
		return g.HoldMax
	}
	return DefaultHoldMax
}

func (g *Gate) settle() time.Duration {
	if g.Settle > 0 {
		return g.Settle
	}
	return DefaultSettle
}

// sqlGateOpen records a gate once; a second invoice.created changes
// nothing.
const sqlGateOpen = `
INSERT INTO invoice_gates (account, invoice, customer, tenants, period_start, period_end, finalizes_at)
VALUES (@account, @invoice, @customer, @tenants, @start, @end, @finalizes_at)
ON CONFLICT (account, invoice) DO NOTHING`

// Open starts the gate of a draft subscription invoice: the customer's
// tenants whose billing period is the draft's metered lines' period have
// their ended windows staged at once (Check then looks at it). A draft
// with no metered line of a known price, or an invoice that is not a
// draft, opens nothing.
func (g *Gate) Open(ctx context.Context, account string, inv stripeapi.Invoice) error {
	if inv.Status != "draft" || inv.Subscription == "" {
		return nil
	}
	_, start, end, err := meterLines(ctx, g.DB, account, inv.ID)
	if err != nil || start.IsZero() {
		return err
	}
	tenants, err := periodTenants(ctx, g.DB, account, inv.Customer, start)
	if err != nil || len(tenants) == 0 {
		return err
	}
	for _, t := range tenants {
		if _, err := g.Stager.CloseTenant(ctx, g.DB, t); err != nil {
			g.Logger.WarnContext(ctx, "invoices: staging a tenant's usage for its invoice failed; the passes stage it", "tenant", t, "error", err)
		}
	}
	if _, err := g.DB.Exec(ctx, sqlGateOpen, pgx.NamedArgs{"account": account, "invoice": inv.ID, "customer": inv.Customer,
		"tenants": tenants, "start": start, "end": end, "finalizes_at": optionalTime(inv.AutomaticallyFinalizesAt)}); err != nil {
		return fmt.Errorf("invoices: opening the gate of %s: %w", inv.ID, err)
	}
	return nil
}

// periodTenants are the customer's tenants in account whose billing
// period starts at start.
func periodTenants(ctx context.Context, q pgdb.Querier, account, customer string, start time.Time) ([]string, error) {
	rows, err := q.Query(ctx, sqlTenantsOf, pgx.NamedArgs{"account": account, "customer": customer, "start": start})
	if err != nil {
		return nil, err
	}
	var (
		out []string
		t   string
		per time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&t, &per}, func() error {
		if per.Equal(start) {
			out = append(out, t)
		}
		return nil
	})
	return out, err
}

// gateRow is a gate as Check reads it, with the database's verdicts on
// its times.
type gateRow struct {
	state      GateState
	customer   string
	tenants    []string
	start      time.Time
	status     string // the invoice's, as last read
	settled    bool   // pending since longer than the settle time
	expired    bool   // held past its bound
	finalizeBy bool   // Stripe's automatic finalization time (as the gate opened) has passed, or is unknown
}

const sqlGateRead = `
SELECT g.state, g.customer, g.tenants, g.period_start, i.status,
       coalesce(g.incomplete_since + @settle::interval <= clock_timestamp(), false),
       coalesce(g.hold_until <= clock_timestamp(), false),
       coalesce(g.finalizes_at <= clock_timestamp(), true)
FROM invoice_gates g JOIN stripe_invoices i USING (account, invoice)
WHERE g.account = @account AND g.invoice = @invoice`

// missing is what a period lacks.
type missing struct {
	hard, soft []string // quarantined or uncertain; unstaged or pending
}

func (m missing) none() bool { return len(m.hard) == 0 && len(m.soft) == 0 }

func (m missing) String() string {
	s := strings.Join(append(slices.Clone(m.hard), m.soft...), "; ")
	if len(s) > 300 {
		s = s[:297] + "..."
	}
	return s
}

// periodMissing reads what the tenants' usage of the period starting at
// start lacks: usage not yet accepted by Stripe (from the counters).
func periodMissing(ctx context.Context, db pgdb.Beginner, tenants []string, start time.Time) (missing, error) {
	var m missing
	want := start.UTC().Format(time.RFC3339)
	for _, t := range tenants {
		rep, err := quarantine.CompletenessOf(ctx, db, start.UTC().Format("2006-01"), t)
		if err != nil {
			return missing{}, err
		}
		for _, l := range rep.Lines {
			if l.Period != want {
				continue
			}
			for _, b := range []struct {
				name string
				b    quarantine.Bucket
				hard bool
			}{{"quarantined", l.Quarantined, true}, {"uncertain", l.Uncertain, true}, {"pending", l.Pending, false}} {
				if b.b.Events == 0 {
					continue
				}
				what := fmt.Sprintf("%s/%s: %d events %s", t, l.Feature, b.b.Events, b.name)
				if b.hard {
					m.hard = append(m.hard, what)
				} else {
					m.soft = append(m.soft, what)
				}
			}
		}
	}
	return m, nil
}

// Check looks at a gate again: complete, it releases a held draft; not,
// it holds the draft (when configured to) once the period counts as
// incomplete; a hold past its bound is released. Each hold and release
// is audited.
func (g *Gate) Check(ctx context.Context, account, invoice string) error {
	if err := g.check(ctx, account, invoice); err != nil {
		return fmt.Errorf("invoices: checking the gate of %s: %w", invoice, err)
	}
	return nil
}

func (g *Gate) check(ctx context.Context, account, invoice string) error {
	args := pgx.NamedArgs{"account": account, "invoice": invoice, "settle": g.settle()}
	var r gateRow
	var state string
	if err := g.DB.QueryRow(ctx, sqlGateRead, args).Scan(&state, &r.customer, &r.tenants, &r.start, &r.status,
		&r.settled, &r.expired, &r.finalizeBy); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	}
	r.state = GateState(state)
	if r.state != GateWaiting && r.state != GateHeld {
		return nil
	}
	m, err := periodMissing(ctx, g.DB, r.tenants, r.start)
	if err != nil {
		return err
	}
	args["missing"] = m.String()
	switch {
	case m.none() && r.state == GateHeld:
		return g.release(ctx, account, invoice, r, "complete", GateComplete)
	case m.none():
		return g.move(ctx, args, GateWaiting, GateComplete, "")
	case r.status != "draft":
		// Finalized (or voided) before the period was proven complete: the
		// comparison of the finalized invoice reports what it lacks.
		if r.state == GateHeld {
			return g.release(ctx, account, invoice, r, "finalized", GateLapsed)
		}
		return g.move(ctx, args, GateWaiting, GateLapsed, "finalized")
	case r.state == GateHeld && r.expired:
		g.Metrics.holdExpired()
		g.Logger.WarnContext(ctx, "invoices: a held invoice's period is still incomplete and the hold ran out: the invoice is released",
			"customer", r.customer, "invoice", invoice, "missing", m.String())
		return g.release(ctx, account, invoice, r, "hold_max", GateReleased)
	}
	// Incomplete: at once for quarantined or uncertain usage, after the
	// settle time for usage still on its way.
	if _, err := g.DB.Exec(ctx, `UPDATE invoice_gates SET missing = @missing, checked_at = clock_timestamp(),
		incomplete_since = coalesce(incomplete_since, clock_timestamp())
		WHERE account = @account AND invoice = @invoice AND state IN ('waiting', 'held')`, args); err != nil {
		return err
	}
	incomplete := len(m.hard) > 0 || r.settled
	if !incomplete {
		return nil
	}
	tag, err := g.DB.Exec(ctx, `UPDATE invoice_gates SET incomplete = true WHERE account = @account AND invoice = @invoice
		AND state IN ('waiting', 'held') AND NOT incomplete`, args)
	if err != nil {
		return err
	}
	if tag.RowsAffected() > 0 {
		g.Logger.WarnContext(ctx, "invoices: an invoice is being made while its period is incomplete",
			"customer", r.customer, "invoice", invoice, "missing", m.String(), "hold", g.Hold)
	}
	if !g.Hold || r.state == GateHeld {
		return nil
	}
	return g.hold(ctx, account, invoice, r, m)
}

// move changes a gate's state, if it is still from.
func (g *Gate) move(ctx context.Context, args pgx.NamedArgs, from, to GateState, reason string) error {
	args["from"], args["to"], args["reason"] = string(from), string(to), reason
	_, err := g.DB.Exec(ctx, `UPDATE invoice_gates SET state = @to, missing = @missing, checked_at = clock_timestamp(),
		incomplete = false, release_reason = NULLIF(@reason, '')
		WHERE account = @account AND invoice = @invoice AND state = @from`, args)
	return err
}

// hold sets the draft's auto_advance to false, then records the hold and
// its bound, audited. A draft Stripe has finalized meanwhile is lapsed.
func (g *Gate) hold(ctx context.Context, account, invoice string, r gateRow, m missing) error {
	inv, err := g.Holder.SetAutoAdvance(ctx, account, invoice, false, "tally-hold-"+invoice)
	if err != nil {
		return err
	}
	if err := Record(ctx, g.DB, account, inv); err != nil {
		return err
	}
	if inv.Status != "draft" {
		return g.move(ctx, pgx.NamedArgs{"account": account, "invoice": invoice, "missing": m.String()}, GateWaiting, GateLapsed, "finalized")
	}
	return pgx.BeginFunc(ctx, g.DB, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE invoice_gates SET state = 'held', held_at = clock_timestamp(),
			hold_until = clock_timestamp() + @max::interval, checked_at = clock_timestamp()
			WHERE account = @account AND invoice = @invoice AND state = 'waiting'`,
			pgx.NamedArgs{"account": account, "invoice": invoice, "max": g.holdMax()})
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: mappings.ActorStripe, Action: audit.ActionInvoiceHold,
			Subject: "invoice:" + invoice, From: "auto_advance", To: "held", Reason: m.String(),
			Details: map[string]any{"customer": r.customer, "account": account, "hold_max": g.holdMax().String()}})
	})
}

// release gives a held draft back to Stripe: auto_advance true again
// while its automatic finalization is still ahead, else finalized now,
// as it was going to be; then records why, audited.
func (g *Gate) release(ctx context.Context, account, invoice string, r gateRow, reason string, to GateState) error {
	if r.status == "draft" {
		var (
			inv stripeapi.Invoice
			err error
		)
		if r.finalizeBy {
			inv, err = g.Holder.Finalize(ctx, account, invoice, "tally-finalize-"+invoice)
		} else {
			inv, err = g.Holder.SetAutoAdvance(ctx, account, invoice, true, "tally-release-"+invoice)
		}
		if err != nil {
			return err
		}
		if err := Record(ctx, g.DB, account, inv); err != nil {
			return err
		}
	}
	return pgx.BeginFunc(ctx, g.DB, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE invoice_gates SET state = @to, released_at = clock_timestamp(), release_reason = @reason,
			checked_at = clock_timestamp(), incomplete = false
			WHERE account = @account AND invoice = @invoice AND state = 'held'`,
			pgx.NamedArgs{"account": account, "invoice": invoice, "to": string(to), "reason": reason})
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: mappings.ActorStripe, Action: audit.ActionInvoiceRelease,
			Subject: "invoice:" + invoice, From: "held", To: string(to), Reason: reason,
			Details: map[string]any{"customer": r.customer, "account": account}})
	})
}

// sqlOpenGates lists the gates still open, least recently checked first.
const sqlOpenGates = `
SELECT account, invoice FROM invoice_gates WHERE state IN ('waiting', 'held') ORDER BY checked_at LIMIT @batch`

// OpenGates counts the open gates (the partial index).
func (g *Gate) OpenGates(ctx context.Context) (int, error) {
	var n int
	if err := g.DB.QueryRow(ctx, `SELECT count(*) FROM invoice_gates WHERE state IN ('waiting', 'held')`).Scan(&n); err != nil {
		return 0, fmt.Errorf("invoices: counting open gates: %w", err)
	}
	return n, nil
}

// CheckOpen checks up to batch open gates, least recently checked first.
func (g *Gate) CheckOpen(ctx context.Context, batch int) (int, error) {
	keys, err := invoiceKeys(ctx, g.DB, sqlOpenGates, pgx.NamedArgs{"batch": batch})
	if err != nil {
		return 0, fmt.Errorf("invoices: listing open gates: %w", err)
	}
	var errs []error
	for _, k := range keys {
		if err := g.Check(ctx, k.account, k.invoice); err != nil {
			errs = append(errs, err)
		}
	}
	return len(keys), errors.Join(errs...)
}

// GateMetrics are the gate's metrics, without a tenant or customer label:
// the invoices and what they lack are in invoice_gates and the log.
type GateMetrics struct {
	db       atomic.Pointer[pgdb.Querier]
	open     *prometheus.Desc
	expired  prometheus.Counter
	timeout  time.Duration
	failures prometheus.Counter
}

// NewGateMetrics registers the gate's metrics on reg; the gauge of
// incomplete drafts is read at each scrape from the database Use gives.
func NewGateMetrics(reg prometheus.Registerer) (*GateMetrics, error) {
	m := &GateMetrics{timeout: 2 * time.Second,
		open: prometheus.NewDesc("tally_invoices_incomplete",
			"Draft invoices being made (or held) while their billing period is incomplete: usage of it quarantined, uncertain, or pending past the settle time.", nil, nil),
		expired: prometheus.NewCounter(prometheus.CounterOpts{Name: "tally_invoice_holds_expired_total",
			Help: "Held draft invoices released because the hold ran out (TALLY_INVOICE_HOLD_MAX) with their period still incomplete."}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{Name: "tally_invoice_gate_read_failures_total",
			Help: "Scrapes that could not read the incomplete invoices from the database."}),
	}
	for _, c := range []prometheus.Collector{m, m.expired, m.failures} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Use sets the database the gauge reads.
func (m *GateMetrics) Use(db pgdb.Querier) { m.db.Store(&db) }

// Describe implements prometheus.Collector.
func (m *GateMetrics) Describe(ch chan<- *prometheus.Desc) { ch <- m.open }

// Collect implements prometheus.Collector: one indexed count of the open
// gates.
func (m *GateMetrics) Collect(ch chan<- prometheus.Metric) {
	db := m.db.Load()
	if db == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.timeout)
	defer cancel()
	var n int64
	if err := (*db).QueryRow(ctx, `SELECT count(*) FROM invoice_gates WHERE state IN ('waiting', 'held') AND incomplete`).Scan(&n); err != nil {
		m.failures.Inc()
		return
	}
	ch <- prometheus.MustNewConstMetric(m.open, prometheus.GaugeValue, float64(n))
}

func (m *GateMetrics) holdExpired() {
	if m != nil {
		m.expired.Inc()
	}
}

// GateView is a gate as the API and the console show it.
type GateView struct {
	Account     string     `json:"destination_account"`
	Invoice     string     `json:"invoice"`
	Customer    string     `json:"customer"`
	Tenants     []string   `json:"tenants"`
	PeriodStart time.Time  `json:"period_start"`
	PeriodEnd   time.Time  `json:"period_end"`
	State       GateState  `json:"state"`
	Incomplete  bool       `json:"incomplete"`
	Missing     string     `json:"missing"`
	OpenedAt    time.Time  `json:"opened_at"`
	CheckedAt   time.Time  `json:"checked_at"`
	HeldAt      *time.Time `json:"held_at"`
	HoldUntil   *time.Time `json:"hold_until"`
	ReleasedAt  *time.Time `json:"released_at"`
	// ReleaseReason is why a gate closed without proving its period
	// complete (hold_max, finalized), or complete after a hold.
	ReleaseReason *string `json:"release_reason"`
}

// sqlGates lists gates, newest first: the open ones (a partial index), or
// every one of the last 100 days.
const sqlGates = `
SELECT account, invoice, customer, tenants, period_start, period_end, state, incomplete, missing, opened_at, checked_at,
       held_at, hold_until, released_at, release_reason
FROM invoice_gates
WHERE CASE WHEN @all THEN opened_at > clock_timestamp() - interval '100 days' ELSE state IN ('waiting', 'held') END
ORDER BY opened_at DESC LIMIT 1000`

// Gates lists the open gates, or all of the last 100 days; at most 1000.
func Gates(ctx context.Context, q pgdb.Querier, all bool) ([]GateView, error) {
	rows, err := q.Query(ctx, sqlGates, pgx.NamedArgs{"all": all})
	if err != nil {
		return nil, fmt.Errorf("invoices: listing gates: %w", err)
	}
	gates, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (GateView, error) {
		var (
			g     GateView
			state string
		)
		err := r.Scan(&g.Account, &g.Invoice, &g.Customer, &g.Tenants, &g.PeriodStart, &g.PeriodEnd, &state, &g.Incomplete,
			&g.Missing, &g.OpenedAt, &g.CheckedAt, &g.HeldAt, &g.HoldUntil, &g.ReleasedAt, &g.ReleaseReason)
		g.State = GateState(state)
		g.PeriodStart, g.PeriodEnd = g.PeriodStart.UTC(), g.PeriodEnd.UTC()
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("invoices: listing gates: %w", err)
	}
	return gates, nil
}
