package reconcile

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/outbox"
)

// ResolutionReason is why finance closed a discrepancy: one of a fixed set.
type ResolutionReason string

// The reasons a discrepancy is resolved with. Each settles the
// discrepancy's items that are still accepted as confirmed — those
// confirmed already, in an hour whose number Stripe moved after it
// matched, are left as they are — so its numbers are closed, and the
// resolution says how billing was made right.
const (
	// ResolvedCreditedInStripe: Stripe counted more than Tally (another
	// sender, a duplicate, a replayed import; in an hour confirmed before
	// too) and the customer was credited the difference in Stripe. Only for
	// a discrepancy where Stripe has more.
	ResolvedCreditedInStripe ResolutionReason = "credited_in_stripe"
	// ResolvedReposted: Stripe counted less than Tally (or refused the
	// key's summaries) and the missing usage was posted to Stripe again
	// under a new identifier. Not for a discrepancy where Stripe has more.
	ResolvedReposted ResolutionReason = "reposted"
	// ResolvedAcceptStripe: Stripe's number stands; the difference is
	// written off (or billed) as it is.
	ResolvedAcceptStripe ResolutionReason = "accept_stripe"
	// ResolvedAcceptTally: Tally's number is right and billing follows it
	// (the difference is not Tally's usage, or was corrected elsewhere).
	ResolvedAcceptTally ResolutionReason = "accept_tally"
)

// ResolutionReasons are every reason, in the order forms offer them.
var ResolutionReasons = []ResolutionReason{ResolvedCreditedInStripe, ResolvedReposted, ResolvedAcceptStripe, ResolvedAcceptTally}

// Valid says whether r is one of ResolutionReasons.
func (r ResolutionReason) Valid() bool { return slices.Contains(ResolutionReasons, r) }

// Fits says whether r can close a discrepancy of kind: a credit answers
// Stripe having more, a repost Stripe having less (or refusing the key);
// accepting either side's number answers any.
func (r ResolutionReason) Fits(kind string) bool {
	switch r {
	case ResolvedCreditedInStripe:
		return kind == KindStripeHasMore
	case ResolvedReposted:
		return kind != KindStripeHasMore
	}
	return r.Valid()
}

// Resolution is finance's decision about the numbers of one hour of one
// key: it covers every discrepancy of that hour with the same reason and
// numbers, in any run, and a later run that finds them again does not
// record them.
type Resolution struct {
	ID int64 `json:"id"`
	// Discrepancy is the one that was resolved (this one, or the same
	// numbers recorded by another run).
	Discrepancy int64            `json:"discrepancy"`
	Reason      ResolutionReason `json:"reason"`
	Note        string           `json:"note"`
	By          string           `json:"by"`
	At          time.Time        `json:"at"`
	// SettledItems are the accepted items the resolution confirmed.
	SettledItems []int64 `json:"settled_items"`
}

// Decision is finance's decision about a discrepancy: a reason and a note.
type Decision struct {
	Reason ResolutionReason
	// Note says what was done (a credit note, the new identifier, who
	// agreed); required, sanitised, at most 200 characters kept.
	Note string
	// By is who decided: the audit log's actor.
	By string
}

// ErrInvalidResolution is a resolution that cannot be asked for: an
// unknown reason or no note.
var ErrInvalidResolution = errcode.New(errcode.Invalid, "invalid_resolution", "reconcile: invalid resolution")

// ErrResolved refuses to resolve a discrepancy whose numbers are resolved
// already.
var ErrResolved = errcode.New(errcode.Conflict, "resolved", "reconcile: the discrepancy is resolved already")

// ErrSuperseded refuses to resolve a discrepancy a later run found with
// other numbers: resolve the later one.
var ErrSuperseded = errcode.New(errcode.Stale, "superseded", "reconcile: a later run found other numbers for this hour; resolve its discrepancy")

// ItemsMovedError refuses to resolve a discrepancy some of whose items are
// neither accepted nor confirmed any more (an error report failed them,
// say): its numbers are not what was reviewed. Nothing was changed.
type ItemsMovedError struct {
	Discrepancy int64
	// Items are the items that moved, with their state now.
	Items map[int64]outbox.State
}

func (e *ItemsMovedError) Error() string {
	ids := make([]int64, 0, len(e.Items))
	for id := range e.Items {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	var b strings.Builder
	for i, id := range ids {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d (%s)", id, e.Items[id])
	}
	return fmt.Sprintf("discrepancy %d: its items %s are no longer accepted or confirmed; run reconcile again and resolve what it finds",
		e.Discrepancy, b.String())
}

// Code is errcode.Stale.
func (e *ItemsMovedError) Code() errcode.Code { return errcode.Stale }

// Condition is "items_moved".
func (e *ItemsMovedError) Condition() string { return "items_moved" }

// ActionResolve is the audit log's action of a resolution; its subject is
// Subject(id).
const ActionResolve = "discrepancy.resolve"

// Subject is the audit log's subject of discrepancy id.
func Subject(id int64) string { return fmt.Sprintf("discrepancy:%d", id) }

// Resolve resolves discrepancy id in one transaction: it confirms (confirm,
// through package outbox) the discrepancy's items that are still accepted,
// records the resolution and its audit entry, and returns the discrepancy
// resolved. It refuses, changing nothing, a discrepancy that is resolved
// (ErrResolved), that a later run found with other numbers
// (ErrSuperseded), or whose items moved out of accepted and confirmed
// (*ItemsMovedError); an item that moves while it is being confirmed is
// refused the same way, never retried. A reason that does not fit the
// discrepancy's kind (ResolutionReason.Fits) is ErrInvalidResolution.
// Resolving closes the discrepancy: it is no longer open, and runs do not
// record its numbers of its hour again.
func Resolve(ctx context.Context, db pgdb.DB, store *outbox.Store, id int64, req Decision) (Discrepancy, error) {
	if !req.Reason.Valid() {
		return Discrepancy{}, fmt.Errorf("%w: the reason must be credited_in_stripe, reposted, accept_stripe or accept_tally", ErrInvalidResolution)
	}
	req.Note = redact.Message(req.Note)
	if req.Note == "" {
		return Discrepancy{}, fmt.Errorf("%w: a note is required: what was done, and where to find it", ErrInvalidResolution)
	}
	var out Discrepancy
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		d, err := lockDiscrepancy(ctx, tx, id)
		if err != nil {
			return err
		}
		if !req.Reason.Fits(d.Kind) {
			return fmt.Errorf("%w: %s does not answer a discrepancy where %s", ErrInvalidResolution, req.Reason, kindText(d.Kind))
		}
		settled, err := settleItems(ctx, tx, store, d)
		if err != nil {
			return err
		}
		if err := recordResolution(ctx, tx, d, req, settled); err != nil {
			return err
		}
		out, err = GetDiscrepancy(ctx, tx, id)
		return err
	})
	return out, err
}

// sqlSuperseded says whether a later run recorded the hour of discrepancy
// d with other numbers.
const sqlSuperseded = `
SELECT EXISTS (
    SELECT 1 FROM reconcile_discrepancies l, reconcile_discrepancies d
    WHERE d.id = @id AND l.run_id > d.run_id
      AND l.destination_account = d.destination_account AND l.mode = d.mode AND l.event_name = d.event_name
      AND l.customer = d.customer AND l.hour = d.hour
      AND ((l.reason, l.expected) IS DISTINCT FROM (d.reason, d.expected) OR l.provider IS DISTINCT FROM d.provider))`

// lockDiscrepancy locks discrepancy id for a resolution and reads it,
// refusing one that is resolved or superseded.
func lockDiscrepancy(ctx context.Context, tx pgx.Tx, id int64) (Discrepancy, error) {
	var one int
	err := tx.QueryRow(ctx, `SELECT 1 FROM reconcile_discrepancies WHERE id = $1 FOR UPDATE`, id).Scan(&one)
	if errors.Is(err, pgx.ErrNoRows) {
		return Discrepancy{}, fmt.Errorf("%w: %d", ErrDiscrepancyNotFound, id)
	}
	if err != nil {
		return Discrepancy{}, fmt.Errorf("reconcile: locking discrepancy %d: %w", id, err)
	}
	d, err := GetDiscrepancy(ctx, tx, id)
	if err != nil {
		return Discrepancy{}, err
	}
	if d.Resolution != nil {
		return Discrepancy{}, ErrResolved
	}
	var superseded bool
	if err := tx.QueryRow(ctx, sqlSuperseded, pgx.NamedArgs{"id": id}).Scan(&superseded); err != nil {
		return Discrepancy{}, fmt.Errorf("reconcile: reading later runs of discrepancy %d: %w", id, err)
	}
	if superseded {
		return Discrepancy{}, ErrSuperseded
	}
	return d, nil
}

// kindText says what a kind of discrepancy means, for an error.
func kindText(kind string) string {
	switch kind {
	case KindStripeHasMore:
		return "Stripe has more than Tally"
	case KindStripeHasLess:
		return "Stripe has less than Tally"
	}
	return "Stripe refused the summaries"
}

// settleItems confirms (confirm) the accepted items discrepancy d counts and
// returns those it confirmed; one confirmed already (before the run, or
// meanwhile) is not confirmed again and not among them. An item neither
// accepted nor confirmed, now or when it is confirmed, refuses the
// resolution.
func settleItems(ctx context.Context, tx pgx.Tx, store *outbox.Store, d Discrepancy) ([]int64, error) {
	states, err := store.StatesOf(ctx, tx, d.ExpectedItems)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading the items of discrepancy %d: %w", d.ID, err)
	}
	var (
		accepted []int64
		moved    = map[int64]outbox.State{}
	)
	for _, itemID := range d.ExpectedItems {
		switch state := states[itemID]; state {
		case outbox.StateAccepted:
			accepted = append(accepted, itemID)
		case outbox.StateConfirmed:
		default:
			moved[itemID] = state
		}
	}
	if len(moved) > 0 {
		return nil, &ItemsMovedError{Discrepancy: d.ID, Items: moved}
	}
	settled := []int64{}
	for rest := accepted; len(rest) > 0; {
		n := min(len(rest), confirmBatch)
		done, refused, err := store.Confirm(ctx, tx, rest[:n])
		if err != nil {
			return nil, err
		}
		for id, rerr := range refused {
			var se *outbox.StateError
			if !errors.As(rerr, &se) {
				return nil, rerr
			}
			if se.Current != outbox.StateConfirmed {
				moved[id] = se.Current
			} // else confirmed meanwhile (a run's match, or a resolution of the same numbers, which the insert finds)
		}
		settled = append(settled, done...)
		rest = rest[n:]
	}
	if len(moved) > 0 {
		return nil, &ItemsMovedError{Discrepancy: d.ID, Items: moved}
	}
	slices.Sort(settled)
	return settled, nil
}

// recordResolution records the resolution of d and its audit entry.
func recordResolution(ctx context.Context, tx pgx.Tx, d Discrepancy, req Decision, settled []int64) error {
	_, err := tx.Exec(ctx, `INSERT INTO reconcile_resolutions (discrepancy_id, destination_account, mode, event_name, customer,
			hour, reason, expected, provider, resolution, note, resolved_by, settled_items)
		SELECT id, destination_account, mode, event_name, customer, hour, reason, expected, provider,
			@resolution, @note, @by, @settled
		FROM reconcile_discrepancies WHERE id = @id`,
		pgx.NamedArgs{"id": d.ID, "resolution": string(req.Reason), "note": req.Note, "by": actorOf(req.By), "settled": settled})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.ConstraintName == "reconcile_resolutions_numbers" {
		return ErrResolved // the same numbers of another run, resolved meanwhile
	}
	if err != nil {
		return fmt.Errorf("reconcile: recording the resolution of discrepancy %d: %w", d.ID, err)
	}
	provider := "none"
	if d.Provider != nil {
		provider = *d.Provider
	}
	return audit.Record(ctx, tx, audit.Entry{Actor: req.By, Action: ActionResolve, Subject: Subject(d.ID),
		From: "open", To: string(req.Reason), Reason: req.Note, Details: map[string]any{
			"run": d.RunID, "event_name": d.EventName, "customer": d.Customer, "hour": d.Hour,
			"tenants": d.Tenants, "features": d.Features, "expected": d.Expected, "provider": provider,
			"settled_items": settled}})
}

// actorOf is the actor recorded: "unknown" when none is given, as the audit
// log does.
func actorOf(by string) string {
	if by == "" {
		return "unknown"
	}
	return by
}
