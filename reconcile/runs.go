package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Run is a reconcile run as recorded.
type Run struct {
	ID          int64      `json:"id"`
	Status      string     `json:"status"`
	Trigger     string     `json:"trigger"`
	RequestedBy string     `json:"requested_by"`
	Settle      string     `json:"settle"`
	Since       *time.Time `json:"since"`
	Account     string     `json:"destination_account"`
	Mode        string     `json:"mode"`
	// Progress and totals.
	KeysTotal      int    `json:"keys_total"`
	KeysDone       int    `json:"keys_done"`
	HoursCompared  int    `json:"hours_compared"`
	HoursMatched   int    `json:"hours_matched"`
	HoursSkipped   int    `json:"hours_skipped"`
	ItemsConfirmed int64  `json:"items_confirmed"`
	Discrepancies  int    `json:"discrepancies"`
	StripeCalls    int    `json:"stripe_calls"`
	ErrorCode      string `json:"error_code,omitempty"`
	Error          string `json:"error,omitempty"`
	// Times.
	CreatedAt   time.Time  `json:"created_at"`
	StartedAt   *time.Time `json:"started_at"`
	HeartbeatAt *time.Time `json:"heartbeat_at"`
	FinishedAt  *time.Time `json:"finished_at"`
}

// Discrepancy is what a run could not confirm, with its reason: one hour of
// one (customer, meter) where Stripe's summary and what Tally holds as
// accepted or confirmed differ (ReasonMismatch), or a whole key whose
// summaries Stripe refused (ReasonSummariesRefused). Its items stay
// accepted. It is open until finance resolves it or a later run compares
// the hour again (ClearedByRun).
type Discrepancy struct {
	// ID names the discrepancy (to resolve it); 0 before it is recorded.
	ID        int64  `json:"id"`
	RunID     int64  `json:"run_id"`
	Account   string `json:"destination_account"`
	Mode      string `json:"mode"`
	EventName string `json:"event_name"`
	Meter     string `json:"meter"`
	Customer  string `json:"customer"`
	// Reason is ReasonMismatch or ReasonSummariesRefused.
	Reason string `json:"reason"`
	// Kind is what the numbers say (KindStripeHasMore, KindStripeHasLess,
	// KindSummariesRefused), derived by the database from the reason and
	// the numbers.
	Kind string `json:"kind"`
	// ErrorCode and ErrorStatus are, for ReasonSummariesRefused, Stripe's
	// error code (else its error type) and HTTP status; empty and 0 for a
	// mismatch.
	ErrorCode   string `json:"error_code,omitempty"`
	ErrorStatus int    `json:"error_status,omitempty"`
	// Hour is the hour compared; for a refused key, the first hour of the
	// key's compared range (its items may span many hours).
	Hour    time.Time `json:"hour"`
	Formula string    `json:"formula"`
	// Expected is Tally's value, Provider Stripe's (nil: a last meter with
	// no event in the hour, or a refused key), Difference = Provider -
	// Expected. Decimal strings: they are exact. For a refused key Expected
	// is what Tally holds over the range's comparable hours, by the formula
	// (for last, the latest item's value).
	Expected   string  `json:"expected"`
	Provider   *string `json:"provider"`
	Difference *string `json:"difference"`
	// ExpectedItems are the accepted and confirmed items Tally counts;
	// UncertainItems the hour's (the range's) uncertain ones; ExplainedBy
	// the uncertain items whose landing explains the difference exactly,
	// when exactly one such set exists (Explanation "explained"; else
	// "ambiguous" or "unexplained"; "not_compared" for a refused key).
	ExpectedItems  []int64 `json:"expected_items"`
	UncertainItems []int64 `json:"uncertain_items"`
	// ConfirmedItems are the expected items that were confirmed already
	// when the hour was compared: Stripe's number had matched Tally's, and
	// moved since. Empty for a refused key.
	ConfirmedItems []int64 `json:"confirmed_items"`
	ExplainedBy    []int64 `json:"explained_by"`
	Explanation    string  `json:"explanation"`
	// ReportedItems are the expected items Stripe's meter error reports
	// name: accepted, then failed at Stripe. A report normally moves its
	// items out of accepted when it arrives (fail_accepted), so this lists the ones
	// it could not move then (an item still leased, say).
	ReportedItems []int64 `json:"reported_items"`
	// Tenants and Features are whose usage the discrepancy is about: the
	// tenant keys and features of its items (expected and uncertain),
	// ascending. Read with the discrepancy, never recorded.
	Tenants  []string `json:"tenants"`
	Features []string `json:"features"`
	// Resolution is finance's decision about these numbers of this hour,
	// nil while nobody has resolved them (see Resolve).
	Resolution *Resolution `json:"resolution"`
	// ClearedByRun is the later run that compared the hour of the key
	// again (for a refused key: read the key again) and saw it match,
	// or recorded, or found resolved, numbers of its own: this discrepancy
	// is no longer the current one. nil while it is.
	ClearedByRun *int64 `json:"cleared_by_run"`
}

// Open says whether d is finance's work: nobody resolved it and no later
// run cleared it.
func (d Discrepancy) Open() bool { return d.Resolution == nil && d.ClearedByRun == nil }

// AfterConfirmation says whether Stripe's number moved away from Tally's
// after the hour had matched: some of its items were confirmed already.
func (d Discrepancy) AfterConfirmation() bool { return len(d.ConfirmedItems) > 0 }

// The kinds of discrepancy, in the order lists show them.
const (
	// KindStripeHasMore: Stripe's number is above Tally's (an event Tally
	// did not send, a correction Stripe did not count): the customer may
	// be billed too much.
	KindStripeHasMore = "stripe_has_more"
	// KindStripeHasLess: Stripe's number is below Tally's, or Stripe has
	// no value where Tally expects one: usage that is not billed.
	KindStripeHasLess = "stripe_has_less"
	// KindSummariesRefused: Stripe refused the key's summaries; no number
	// to compare.
	KindSummariesRefused = "summaries_refused"
)

// Kinds are every kind, Stripe-has-more first: the order lists, the
// console and the metric show them in.
var Kinds = []string{KindStripeHasMore, KindStripeHasLess, KindSummariesRefused}

// Discrepancy reasons.
const (
	// ReasonMismatch is an hour where Stripe's summary and what Tally holds
	// differ.
	ReasonMismatch = "mismatch"
	// ReasonSummariesRefused is a key whose summaries Stripe refused with a
	// 4xx about that key (a customer or meter Stripe does not know): none
	// of its hours was compared.
	ReasonSummariesRefused = "summaries_refused"
)

// Refused says whether d is a whole key whose summaries Stripe refused
// rather than one hour's mismatch.
func (d Discrepancy) Refused() bool { return d.Reason == ReasonSummariesRefused }

// ExplanationNotCompared is the explanation of a refused key's
// discrepancy: there was no number of Stripe's to explain.
const ExplanationNotCompared = "not_compared"

const runColumns = `id, status, trigger, requested_by, settle::text, since, coalesce(destination_account, ''), coalesce(mode, ''),
	keys_total, keys_done, hours_compared, hours_matched, hours_skipped, items_confirmed, discrepancies, stripe_calls,
	coalesce(error_code, ''), coalesce(error, ''), created_at, started_at, heartbeat_at, finished_at`

func scanRun(row pgx.Row) (Run, error) {
	var r Run
	err := row.Scan(&r.ID, &r.Status, &r.Trigger, &r.RequestedBy, &r.Settle, &r.Since, &r.Account, &r.Mode,
		&r.KeysTotal, &r.KeysDone, &r.HoursCompared, &r.HoursMatched, &r.HoursSkipped, &r.ItemsConfirmed, &r.Discrepancies,
		&r.StripeCalls, &r.ErrorCode, &r.Error, &r.CreatedAt, &r.StartedAt, &r.HeartbeatAt, &r.FinishedAt)
	return r, err
}

// Get reads one run.
func Get(ctx context.Context, q pgdb.Querier, id int64) (Run, error) {
	r, err := scanRun(q.QueryRow(ctx, `SELECT `+runColumns+` FROM reconcile_runs WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Run{}, fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return Run{}, fmt.Errorf("reconcile: reading run %d: %w", id, err)
	}
	return r, nil
}

// List reads the latest runs, newest first.
func List(ctx context.Context, q pgdb.Querier, limit int) ([]Run, error) {
	rows, err := q.Query(ctx, `SELECT `+runColumns+` FROM reconcile_runs ORDER BY id DESC LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("reconcile: listing runs: %w", err)
	}
	runs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Run, error) { return scanRun(row) })
	if err != nil {
		return nil, fmt.Errorf("reconcile: listing runs: %w", err)
	}
	return runs, nil
}

// Discrepancies reads a run's discrepancies, by meter, customer and hour (a
// refused key at the first hour of its range), each with its tenants,
// features and resolution.
func Discrepancies(ctx context.Context, q pgdb.Querier, runID int64) ([]Discrepancy, error) {
	return readDiscrepancies(ctx, q, `WHERE d.run_id = @run`, pgx.NamedArgs{"run": runID})
}
