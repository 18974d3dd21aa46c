package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/outbox"
)

// Recovery is an operator's decision about an uncertain item (recover).
type Recovery struct {
	// Expect is the state the operator saw: it must be uncertain, the only
	// state recovery leaves; the item's current state must match.
	Expect outbox.State
	// To is accepted (Stripe has it), pending (send it again, same
	// identifier) or rejected (abandon it).
	To outbox.State
	// Reason says why; required for rejected and for NotReached.
	Reason string
	// NotReached, with To = pending, records the finding that no attempt
	// reached Stripe (see outbox.Recovery).
	NotReached bool
	// ProviderRef is Stripe's evidence for accepted, optional.
	ProviderRef string
	// LeaseToken, when set, is the item's lease token as the operator (or a
	// plan) reviewed it: the recovery is refused if the item moved since.
	LeaseToken *int64
	// By is who decided: the audit log's actor.
	By string
}

// ExpectedStateError refuses a recovery whose expected state is not the
// item's (or whose item moved since it was reviewed).
type ExpectedStateError struct {
	ID                int64
	Expected, Current outbox.State
	// Moved: the state matches but the item was claimed or changed since
	// the lease token the operator reviewed.
	Moved bool
}

func (e *ExpectedStateError) Error() string {
	if e.Moved {
		return fmt.Sprintf("item %d changed since it was reviewed (it is %s again, under a later lease)", e.ID, e.Current)
	}
	return fmt.Sprintf("item %d is %s, not %s", e.ID, e.Current, e.Expected)
}

// Code is errcode.Stale.
func (e *ExpectedStateError) Code() errcode.Code { return errcode.Stale }

// Condition is "expected_state_mismatch".
func (e *ExpectedStateError) Condition() string { return "expected_state_mismatch" }

// ErrInvalidRecovery is a recovery that cannot be asked for.
var ErrInvalidRecovery = errcode.New(errcode.Invalid, "invalid_recovery", "reconcile: invalid recovery")

// Recover applies r to item id in one transaction with its audit entry.
func Recover(ctx context.Context, db pgdb.DB, store *outbox.Store, id int64, r Recovery) (outbox.Item, error) {
	if err := r.Validate(); err != nil {
		return outbox.Item{}, err
	}
	var out outbox.Item
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		out, err = recoverIn(ctx, tx, store, id, r)
		return err
	})
	return out, err
}

// Reviewed is an item of a bulk recovery with the lease token it was
// reviewed at.
type Reviewed struct {
	Item       int64
	LeaseToken int64
}

// MaxRecoverAll bounds the items of one RecoverAll: one transaction holds
// their row locks until it commits.
const MaxRecoverAll = 500

// RecoverAll applies r to every item of items, each at the lease token it
// was reviewed at, in one transaction with an audit entry per item, as
// Recover does for one: all of them or, when any is refused (it moved
// since its review, or is no longer uncertain), none, the error naming
// it. r.LeaseToken is ignored.
func RecoverAll(ctx context.Context, db pgdb.DB, store *outbox.Store, items []Reviewed, r Recovery) error {
	if err := r.Validate(); err != nil {
		return err
	}
	if len(items) == 0 || len(items) > MaxRecoverAll {
		return fmt.Errorf("%w: recover 1 to %d items at once", ErrInvalidRecovery, MaxRecoverAll)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		for _, it := range items {
			token := it.LeaseToken
			r.LeaseToken = &token
			if _, err := recoverIn(ctx, tx, store, it.Item, r); err != nil {
				return err
			}
		}
		return nil
	})
}

// Validate refuses, with ErrInvalidRecovery, a recovery that cannot be
// asked for, whatever the item: Recover and RecoverAll call it first.
func (r Recovery) Validate() error {
	if r.Expect != outbox.StateUncertain {
		return fmt.Errorf("%w: expect must be uncertain, the only state recovery leaves", ErrInvalidRecovery)
	}
	switch r.To {
	case outbox.StateAccepted, outbox.StatePending, outbox.StateRejected:
	default:
		return fmt.Errorf("%w: to must be accepted, pending or rejected", ErrInvalidRecovery)
	}
	if (r.To == outbox.StateRejected || r.NotReached) && r.Reason == "" {
		return fmt.Errorf("%w: a reason is required to reject or to record that nothing reached Stripe", ErrInvalidRecovery)
	}
	if r.NotReached && r.To != outbox.StatePending {
		return fmt.Errorf("%w: not-reached goes with a recovery to pending", ErrInvalidRecovery)
	}
	return nil
}

// recoverIn applies r, validated, to item id in tx with its audit entry.
func recoverIn(ctx context.Context, tx pgx.Tx, store *outbox.Store, id int64, r Recovery) (outbox.Item, error) {
	it, err := store.Get(ctx, tx, id)
	if err != nil {
		return outbox.Item{}, err
	}
	if it.State != r.Expect {
		return outbox.Item{}, &ExpectedStateError{ID: id, Expected: r.Expect, Current: it.State}
	}
	token := it.LeaseToken
	if r.LeaseToken != nil {
		token = *r.LeaseToken
	}
	err = store.Recover(ctx, tx, id, outbox.Recovery{To: r.To, ExpectLeaseToken: token, NotReached: r.NotReached,
		ProviderRef: r.ProviderRef, Reason: r.Reason})
	var se *outbox.StateError
	if errors.As(err, &se) {
		return outbox.Item{}, &ExpectedStateError{ID: id, Expected: r.Expect, Current: se.Current, Moved: se.Current == r.Expect}
	}
	if err != nil {
		return outbox.Item{}, err
	}
	details := map[string]any{"lease_token": token}
	if r.NotReached {
		details["not_reached"] = true
	}
	if r.ProviderRef != "" {
		details["provider_ref"] = r.ProviderRef
	}
	if err := audit.Record(ctx, tx, audit.Entry{Actor: r.By, Action: audit.ActionRecover, Subject: audit.Item(id),
		From: string(it.State), To: string(r.To), Reason: r.Reason, Details: details}); err != nil {
		return outbox.Item{}, err
	}
	return store.Get(ctx, tx, id)
}

// Plan is what a run suggests doing about its discrepancies: recover to
// accepted the uncertain items whose landing explains one exactly. An
// operator reviews it and applies it with `tally recover --plan FILE`; each
// action carries the item's lease token, so an item that moved since is
// left alone.
type Plan struct {
	RunID   int64        `json:"run_id"`
	Created time.Time    `json:"created"`
	Actions []PlanAction `json:"actions"`
	// Unplanned counts the open discrepancies no action resolves
	// (ambiguous or unexplained): they are for finance to look into and
	// resolve (Resolve).
	Unplanned int `json:"unplanned_discrepancies"`
}

// PlanAction is one recovery of a plan, with the evidence behind it.
type PlanAction struct {
	Item       int64        `json:"item"`
	Expect     outbox.State `json:"expect"`
	To         outbox.State `json:"to"`
	LeaseToken int64        `json:"lease_token"`
	Reason     string       `json:"reason"`
	Evidence   Discrepancy  `json:"evidence"`
}

// PlanOf builds the plan of run id from its discrepancies, against the
// items as they are now: an item no longer uncertain gets no action.
func PlanOf(ctx context.Context, q pgdb.Querier, store *outbox.Store, id int64) (Plan, error) {
	if _, err := Get(ctx, q, id); err != nil {
		return Plan{}, err
	}
	ds, err := Discrepancies(ctx, q, id)
	if err != nil {
		return Plan{}, err
	}
	p := Plan{RunID: id, Created: time.Now().UTC(), Actions: []PlanAction{}}
	for _, d := range ds {
		if d.Explanation != "explained" {
			if d.Open() {
				p.Unplanned++
			}
			continue
		}
		for _, itemID := range d.ExplainedBy {
			it, err := store.Get(ctx, q, itemID)
			if err != nil {
				return Plan{}, err
			}
			if it.State != outbox.StateUncertain {
				continue
			}
			provider := "nothing"
			if d.Provider != nil {
				provider = *d.Provider
			}
			p.Actions = append(p.Actions, PlanAction{Item: itemID, Expect: outbox.StateUncertain, To: outbox.StateAccepted,
				LeaseToken: it.LeaseToken, Evidence: d,
				Reason: fmt.Sprintf("reconcile run %d: Stripe's %s of %s for %s at %s is %s where Tally's accepted items give %s; this item explains the difference",
					id, d.Formula, d.EventName, d.Customer, d.Hour.Format("2006-01-02T15Z"), provider, d.Expected)})
		}
	}
	return p, nil
}

// PlanResult is what one action of a plan came to.
type PlanResult struct {
	Item    int64        `json:"item"`
	To      outbox.State `json:"to"`
	Applied bool         `json:"applied"`
	Error   string       `json:"error,omitempty"`
}

// ApplyPlan applies every action of p, each in its own transaction, and
// says what became of each: an item that moved since the plan was written
// is refused and left as it is.
func ApplyPlan(ctx context.Context, db pgdb.DB, store *outbox.Store, p Plan, by string) []PlanResult {
	out := make([]PlanResult, 0, len(p.Actions))
	for _, a := range p.Actions {
		token := a.LeaseToken
		_, err := Recover(ctx, db, store, a.Item, Recovery{Expect: a.Expect, To: a.To, Reason: a.Reason, LeaseToken: &token, By: by})
		r := PlanResult{Item: a.Item, To: a.To, Applied: err == nil}
		if err != nil {
			r.Error = err.Error()
		}
		out = append(out, r)
	}
	return out
}
