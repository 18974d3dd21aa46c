package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Arrival is how Tally received one of Stripe's events.
type Arrival string

// The ways events arrive.
const (
	// ArrivalDestination is a thin event the event destination posted to
	// /v1/stripe/events.
	ArrivalDestination Arrival = "destination"
	// ArrivalListing is an event the listing of GET /v2/core/events found
	// (Backfill).
	ArrivalListing Arrival = "listing"
)

// The outcomes of receiving an event (Receipt.Status).
const (
	// ReceiptRecorded: read in full and recorded now.
	ReceiptRecorded = "recorded"
	// ReceiptDuplicate: recorded before; nothing was done.
	ReceiptDuplicate = "duplicate"
	// ReceiptForeign: about an account Tally does not export to; recorded
	// as such, nothing read.
	ReceiptForeign = "foreign"
	// ReceiptUnreadable: about an account Tally exports to, but Stripe
	// refused to let Tally read it (a 4xx); recorded as such, and read
	// again by the listing.
	ReceiptUnreadable = "unreadable"
	// ReceiptIgnored: a type Tally does not record.
	ReceiptIgnored = "ignored"
)

// Receipt says what receiving one of Stripe's events did.
type Receipt struct {
	// Status is one of the Receipt constants.
	Status string
	// Account is the account the event is about: its context's, else the
	// node's destination.
	Account string
	// Report is what recording a meter error report did (Status recorded).
	Report ReportResult
	// Refusal is how Stripe refused the read (Status unreadable): its code
	// and HTTP status.
	Refusal outbox.ErrorInfo
}

// Fetcher reads an event in full in its context: Stripe's GET
// /v2/core/events/{id} with Stripe-Context (stripeapi.Client.Event).
type Fetcher func(ctx context.Context, id, stripeContext string) (stripeapi.Event, error)

// UnavailableError is a read of an event that got no answer, or one that
// says nothing of the event (5xx, 409, 429): Stripe delivers the event
// again, and the listing finds it if it does not.
type UnavailableError struct {
	Code   string
	Status int
}

func (e *UnavailableError) Error() string {
	return fmt.Sprintf("reconcile: the event could not be read from Stripe (%s, status %d)", e.Code, e.Status)
}

// EventsConfig builds Events.
type EventsConfig struct {
	Outbox *outbox.Store
	// Destination is where this node exports: its account is one Tally
	// exports to, and the account of an event without a context.
	Destination func() (exporter.Destination, error)
	// Connected lists the connected accounts tenant mappings have named
	// (mappings.Accounts): the other accounts Tally exports to.
	Connected func(ctx context.Context, q pgdb.Querier) ([]string, error)
	Logger    *slog.Logger
	// Registry takes the events' series; optional.
	Registry prometheus.Registerer
}

// Events records Stripe's events about the accounts Tally exports to,
// however they arrive: from the event destination (thin events, read in
// full in their context) or from the listing (Backfill). Each event is
// recorded once, by its id, with how it first arrived and the account it
// is about. An event about another account is recorded as foreign, one
// Stripe refuses to let Tally read as unreadable: neither is ever refused
// to the event destination, which would deliver it again for days. Which
// types are recorded, and how, is recorders' table.
type Events struct {
	cfg     EventsConfig
	metrics *eventMetrics
}

// eventMetrics are the events' series; no tenant or account label.
type eventMetrics struct {
	received *prometheus.CounterVec
}

// NewEvents validates cfg and builds the recorder of Stripe's events.
func NewEvents(cfg EventsConfig) (*Events, error) {
	if cfg.Outbox == nil || cfg.Destination == nil || cfg.Connected == nil {
		return nil, errors.New("reconcile: Outbox, Destination and Connected are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m := &eventMetrics{received: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_stripe_events_total",
		Help: "Stripe events this node received, by how they arrived (destination: posted to /v1/stripe/events; listing: found by the listing of GET /v2/core/events) and what came of them: recorded, duplicate, foreign (about an account Tally does not export to), unreadable (Stripe refused the read; the listing reads it again), ignored (a type Tally does not record), unavailable (no answer from Stripe; delivered or listed again).",
	}, []string{"arrival", "outcome"})}
	for _, a := range []Arrival{ArrivalDestination, ArrivalListing} {
		for _, o := range []string{ReceiptRecorded, ReceiptDuplicate, ReceiptForeign, ReceiptUnreadable, ReceiptIgnored, outcomeUnavailable} {
			m.received.WithLabelValues(string(a), o)
		}
	}
	if cfg.Registry != nil {
		if err := cfg.Registry.Register(m.received); err != nil {
			return nil, err
		}
	}
	return &Events{cfg: cfg, metrics: m}, nil
}

// outcomeUnavailable counts reads that got no usable answer.
const outcomeUnavailable = "unavailable"

// recordFunc records one type of event, read in full, once.
type recordFunc func(ctx context.Context, db pgdb.DB, store *outbox.Store, ev stripeapi.Event, from origin) (Receipt, error)

// recorders are the types of Stripe's events Tally records, and how: the
// event destination and the listing both go through this table, so a type
// added here is received both ways.
func recorders() map[string]recordFunc {
	return map[string]recordFunc{
		stripeapi.EventMeterErrorReport: recordMeterErrorReport,
		stripeapi.EventNoMeterFound:     recordMeterErrorReport,
	}
}

// EventTypes are the types of Stripe's events Tally records, sorted: what
// the listing asks Stripe for.
func EventTypes() []string {
	var out []string
	for t := range recorders() {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// Records reports whether Tally records events of type typ.
func Records(typ string) bool { return recorders()[typ] != nil }

// badEventError is an event Stripe answered that Tally cannot read: it is
// recorded as unreadable, with bad_response.
type badEventError struct{ err error }

func (e *badEventError) Error() string { return e.err.Error() }
func (e *badEventError) Unwrap() error { return e.err }

// recordMeterErrorReport records a meter error report (RecordReport).
func recordMeterErrorReport(ctx context.Context, db pgdb.DB, store *outbox.Store, ev stripeapi.Event, from origin) (Receipt, error) {
	rep, err := stripeapi.ParseMeterErrorReport(ev)
	if err != nil {
		return Receipt{}, &badEventError{err}
	}
	res, err := recordReport(ctx, db, store, rep, from)
	if err != nil {
		return Receipt{}, err
	}
	r := Receipt{Status: ReceiptRecorded, Account: from.account, Report: res}
	if !res.Recorded {
		r.Status = ReceiptDuplicate
	}
	return r, nil
}

// Receive handles one of Stripe's thin events (its envelope: id, type,
// created, livemode, context): a type Tally does not record is ignored;
// an event recorded before is a duplicate; one about an account Tally does
// not export to — its context names neither the node's destination nor a
// connected account a tenant mapping names — is recorded as foreign; else
// it is read in full with fetch, in its context, and recorded. A read that
// Stripe refuses with a 4xx other than 409 and 429, or whose answer Tally
// cannot read, is recorded as unreadable, for the listing to read again;
// one without a usable answer is an *UnavailableError, and nothing is
// recorded. Any other error is the database's. arrival says where the
// event came from.
func (e *Events) Receive(ctx context.Context, db pgdb.DB, thin stripeapi.Event, fetch Fetcher, arrival Arrival) (Receipt, error) {
	r, err := e.receive(ctx, db, thin, fetch, arrival)
	e.count(arrival, r, err)
	return r, err
}

func (e *Events) receive(ctx context.Context, db pgdb.DB, thin stripeapi.Event, fetch Fetcher, arrival Arrival) (Receipt, error) {
	if !Records(thin.Type) {
		return Receipt{Status: ReceiptIgnored}, nil
	}
	status, err := eventStatus(ctx, db, thin.ID)
	if err != nil || status == statusRecorded {
		return Receipt{Status: ReceiptDuplicate}, err
	}
	account, ours, err := e.accountOf(ctx, db, thin.Context)
	if err != nil {
		return Receipt{}, err
	}
	from := origin{arrival: arrival, account: account}
	if !ours {
		if err := recordForeign(ctx, db, thin, from); err != nil {
			return Receipt{}, err
		}
		e.cfg.Logger.InfoContext(ctx, "a Stripe event about an account Tally does not export to was recorded and not read",
			"event", thin.ID, "type", thin.Type, "account", account, "arrival", arrival)
		return Receipt{Status: ReceiptForeign, Account: account}, nil
	}
	full, err := fetch(ctx, thin.ID, thin.Context)
	if err == nil && (full.ID != thin.ID || full.Type != thin.Type) {
		err = &badEventError{errors.New("reconcile: the event read is another than the one asked for")}
	}
	if err != nil {
		return e.unreadable(ctx, db, thin, from, err)
	}
	return e.record(ctx, db, full, from)
}

// Record records an event read in full (ev.Data set), about account, as a
// listing returned it: like Receive, without reading it again. An event
// recorded before is a duplicate.
func (e *Events) Record(ctx context.Context, db pgdb.DB, ev stripeapi.Event, account string, arrival Arrival) (Receipt, error) {
	from := origin{arrival: arrival, account: account}
	var (
		r   Receipt
		err error
	)
	if !Records(ev.Type) {
		r = Receipt{Status: ReceiptIgnored}
	} else {
		r, err = e.record(ctx, db, ev, from)
		var bad *badEventError
		if errors.As(err, &bad) {
			r, err = e.unreadable(ctx, db, ev, from, err)
		}
	}
	e.count(arrival, r, err)
	return r, err
}

// record records ev, read in full, through its type's recorder.
func (e *Events) record(ctx context.Context, db pgdb.DB, ev stripeapi.Event, from origin) (Receipt, error) {
	r, err := recorders()[ev.Type](ctx, db, e.cfg.Outbox, ev, from)
	var bad *badEventError
	if errors.As(err, &bad) {
		return e.unreadable(ctx, db, ev, from, err)
	}
	if err != nil {
		return Receipt{}, err
	}
	if r.Status == ReceiptRecorded {
		e.cfg.Logger.InfoContext(ctx, "Stripe event recorded", "event", ev.ID, "type", ev.Type, "arrival", from.arrival,
			"failed", r.Report.Failed, "noted", r.Report.Noted, "evidence_only", r.Report.EvidenceOnly, "unmatched", r.Report.Unmatched)
	}
	return r, nil
}

// unreadable records thin as unreadable when err, the failure of reading
// it, is Stripe's refusal (a 4xx other than 409 and 429) or an answer Tally
// cannot read; any other failure is an *UnavailableError.
func (e *Events) unreadable(ctx context.Context, db pgdb.DB, thin stripeapi.Event, from origin, err error) (Receipt, error) {
	code, status, _ := stripeapi.Describe(err)
	var bad *badEventError
	switch {
	case errors.As(err, &bad):
		code, status = stripeapi.CodeBadResponse, http.StatusOK
	case status < 400 || status > 499 || status == http.StatusConflict || status == http.StatusTooManyRequests:
		e.cfg.Logger.WarnContext(ctx, "reading a Stripe event failed; Stripe delivers it again, or the listing finds it",
			"event", thin.ID, "code", code, "status", status)
		return Receipt{}, &UnavailableError{Code: code, Status: status}
	}
	refusal := outbox.ErrorInfo{Code: code, Status: status}.Sanitized()
	if err := recordUnreadable(ctx, db, thin, from, refusal); err != nil {
		return Receipt{}, err
	}
	e.cfg.Logger.WarnContext(ctx, "Stripe refused to let Tally read an event about an account it exports to: recorded as unreadable, the listing reads it again",
		"event", thin.ID, "type", thin.Type, "account", from.account, "code", refusal.Code, "status", refusal.Status)
	return Receipt{Status: ReceiptUnreadable, Account: from.account, Refusal: refusal}, nil
}

// count counts a receipt by arrival and outcome.
func (e *Events) count(arrival Arrival, r Receipt, err error) {
	var ue *UnavailableError
	switch {
	case errors.As(err, &ue):
		e.metrics.received.WithLabelValues(string(arrival), outcomeUnavailable).Inc()
	case err == nil:
		e.metrics.received.WithLabelValues(string(arrival), r.Status).Inc()
	}
}

// accountOf is the account an event with context is about — the
// context's account, else (no context: the key's own) the node's
// destination — and whether Tally exports to it: the destination, or a
// connected account a tenant mapping names. A context Tally could not send
// as Stripe-Context names no account it exports to.
func (e *Events) accountOf(ctx context.Context, q pgdb.Querier, context string) (string, bool, error) {
	if !stripeapi.ValidContext(context) {
		return "", false, nil
	}
	account := stripeapi.ContextAccount(context)
	dest, err := e.cfg.Destination()
	if account == "" {
		// The event was delivered, or listed, as the key's account, as
		// every call the node makes without a context: its destination's.
		return dest.Account, true, nil
	}
	if err == nil && account == dest.Account {
		return account, true, nil
	}
	connected, err := e.cfg.Connected(ctx, q)
	if err != nil {
		return "", false, fmt.Errorf("reconcile: reading the connected accounts: %w", err)
	}
	return account, slices.Contains(connected, account), nil
}

// The statuses of stripe_events.
const (
	statusRecorded   = "recorded"
	statusForeign    = "foreign"
	statusUnreadable = "unreadable"
)

// eventStatus is the status of event id, "" when it is not recorded.
func eventStatus(ctx context.Context, q pgdb.Querier, id string) (string, error) {
	var status string
	err := q.QueryRow(ctx, `SELECT status FROM stripe_events WHERE id = $1`, id).Scan(&status)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reconcile: reading Stripe event %s: %w", id, err)
	}
	return status, nil
}

// createdOf is an event's created time, nil when Stripe gave none (the row
// takes the time it is recorded).
func createdOf(ev stripeapi.Event) *time.Time {
	if ev.Created.IsZero() {
		return nil
	}
	return &ev.Created
}

// recordForeign records an event about an account Tally does not export
// to, once; nothing else.
func recordForeign(ctx context.Context, q pgdb.Querier, ev stripeapi.Event, from origin) error {
	_, err := q.Exec(ctx, `INSERT INTO stripe_events (id, type, livemode, created, account, context, arrival, status)
		VALUES ($1, $2, $3, coalesce($4, clock_timestamp()), nullif($5, ''), nullif($6, ''), $7, 'foreign')
		ON CONFLICT (id) DO NOTHING`,
		ev.ID, ev.Type, ev.Livemode, createdOf(ev), from.account, ev.Context, string(from.arrival))
	if err != nil {
		return fmt.Errorf("reconcile: recording foreign event %s: %w", ev.ID, err)
	}
	return nil
}

// recordUnreadable records an event Stripe refused to let Tally read, or
// counts one more refusal of one recorded so before; an event recorded
// readable meanwhile stays so.
func recordUnreadable(ctx context.Context, q pgdb.Querier, ev stripeapi.Event, from origin, refusal outbox.ErrorInfo) error {
	_, err := q.Exec(ctx, `INSERT INTO stripe_events (id, type, livemode, created, account, context, arrival, status, fetch_code, fetch_status, fetch_tries)
		VALUES ($1, $2, $3, coalesce($4, clock_timestamp()), nullif($5, ''), nullif($6, ''), $7, 'unreadable', $8, nullif($9, 0), 1)
		ON CONFLICT (id) DO UPDATE SET status = 'unreadable', fetch_code = EXCLUDED.fetch_code, fetch_status = EXCLUDED.fetch_status,
		    fetch_tries = stripe_events.fetch_tries + 1, account = coalesce(stripe_events.account, EXCLUDED.account)
		WHERE stripe_events.status <> 'recorded'`,
		ev.ID, ev.Type, ev.Livemode, createdOf(ev), from.account, ev.Context, string(from.arrival), refusal.Code, refusal.Status)
	if err != nil {
		return fmt.Errorf("reconcile: recording unreadable event %s: %w", ev.ID, err)
	}
	return nil
}
