package quarantine

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// Requeuer puts quarantined items back on the way to Stripe.
type Requeuer struct {
	Outbox *outbox.Store
	Stager *meter.Stager
}

// Requeue actions.
const (
	// ActionRequeued: requeue, the item goes back to pending with its identity
	// and identifier.
	ActionRequeued = "requeued"
	// ActionReaddressed: supersede, a successor under a new identity carries the
	// item's usage, and the item is closed as superseded.
	ActionReaddressed = "readdressed"
)

// RequeueResult says what a requeue did.
type RequeueResult struct {
	ItemID int64  `json:"item_id"`
	Action string `json:"action"`
	// Successor is the new item of a re-addressing.
	Successor *int64 `json:"successor,omitempty"`
	// MappingVersion is the version the item (or its successor) now carries.
	MappingVersion int `json:"mapping_version"`
}

// MappingChangedError says the mapping version the operator gave is not the
// current one of the item's tenant and feature: look again.
type MappingChangedError struct {
	Given, Current int
}

func (e *MappingChangedError) Error() string {
	return fmt.Sprintf("quarantine: mapping changed: the current mapping version of this tenant and feature is %d, not %d", e.Current, e.Given)
}

// Code is errcode.Stale.
func (e *MappingChangedError) Code() errcode.Code { return errcode.Stale }

// Condition is "mapping_changed".
func (e *MappingChangedError) Condition() string { return "mapping_changed" }

// Is makes errors.Is(err, outbox.ErrMappingChanged) true.
func (e *MappingChangedError) Is(target error) bool { return target == outbox.ErrMappingChanged }

// StillIneligibleError says the current mappings would quarantine the item
// again: fix the cause first.
type StillIneligibleError struct {
	Reason outbox.Reason
}

func (e *StillIneligibleError) Error() string {
	return fmt.Sprintf("quarantine: the item would be quarantined again (%s); fix that first", e.Reason)
}

// Code is errcode.Conflict.
func (e *StillIneligibleError) Code() errcode.Code { return errcode.Conflict }

// Condition is "still_ineligible".
func (e *StillIneligibleError) Condition() string { return "still_ineligible" }

// PeriodClosedError says the item's billing period's invoice has closed:
// Stripe would record the usage and bill it on no invoice. A requeue with
// RequeueOptions.AcceptPeriodClosed sends it anyway.
type PeriodClosedError struct{}

func (e *PeriodClosedError) Error() string {
	return "quarantine: the item's billing period's invoice has closed (period end plus the invoice grace): Stripe would record it on no invoice; requeue it with accept_period_closed to send it anyway"
}

// Code is errcode.Conflict.
func (e *PeriodClosedError) Code() errcode.Code { return errcode.Conflict }

// Condition is "period_closed".
func (e *PeriodClosedError) Condition() string { return "period_closed" }

// RequeueOptions are what an operator may accept knowingly when requeuing.
type RequeueOptions struct {
	// AcceptPeriodClosed sends usage staged after its billing period's
	// invoice closed (period_closed): the operator knows Stripe will bill
	// it on no finalized invoice (finance bills it by other means, or the
	// invoice is still a draft in Stripe). The audit log says so.
	AcceptPeriodClosed bool
}

// Requeue is RequeueWith without options: late usage is refused.
func (r *Requeuer) Requeue(ctx context.Context, db pgdb.DB, id int64, mappingVersion int, by string) (RequeueResult, error) {
	return r.RequeueWith(ctx, db, id, mappingVersion, by, RequeueOptions{})
}

// RequeueWith requeues quarantined item id under mappingVersion, which must be
// the current mapping version of its tenant and feature (the one the
// operator looked at after fixing the cause; otherwise a
// *MappingChangedError). The item is rebuilt from its ledger rows under the
// current mappings and this node's destination: if that is the item itself,
// it goes back to pending (requeue); if the fix changed what it must carry, a
// successor is enqueued and the item closed as superseded (supersede) — only when
// no attempt of it may have reached Stripe (outbox.ErrMayHaveReached
// otherwise). An item that was sent and that Stripe is proven to have
// recorded no attempt of — every attempt refused, or failed by an error
// report (fail_accepted) — is re-addressed even when the rebuild is the item itself:
// its successor's subject ref is the next re-address generation
// (outbox.ReaddressRef), so it carries a new identifier. Both happen in one
// transaction, with the audit log's entry naming by, the operator. An item
// whose billing period's invoice has closed is refused with a
// *PeriodClosedError unless opts.AcceptPeriodClosed.
func (r *Requeuer) RequeueWith(ctx context.Context, db pgdb.DB, id int64, mappingVersion int, by string, opts RequeueOptions) (RequeueResult, error) {
	var res RequeueResult
	err := pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		it, err := r.Outbox.Get(ctx, tx, id)
		if err != nil {
			return err
		}
		if it.State != outbox.StateQuarantined {
			return &outbox.StateError{ID: id, Transition: outbox.TransitionRequeue, Expected: outbox.StateQuarantined, Current: it.State, CurrentLeaseToken: it.LeaseToken}
		}
		if it.SubjectKind == outbox.SubjectUsageCancellation {
			// A cancellation Stripe cannot apply (too late, a last value),
			// or one whose answer Tally could not read: kept for finance,
			// never sent again by a requeue (docs/design.md).
			return &StillIneligibleError{Reason: it.QuarantineReason}
		}
		// The version is checked and the item rebuilt from this one reading
		// of the mappings, so a change committed meanwhile cannot slip in.
		var st mappings.Store
		pair, err := st.Lookup(ctx, tx, it.TenantKey, it.Payload.Feature)
		if err != nil {
			return err
		}
		if cur := pair.Version(); cur != mappingVersion {
			return &MappingChangedError{Given: mappingVersion, Current: cur}
		}
		successor, err := r.Stager.Rebuild(ctx, tx, it, pair)
		if err != nil {
			return err
		}
		acceptedLate := false
		if successor.Quarantine == outbox.ReasonPeriodClosed {
			if !opts.AcceptPeriodClosed {
				return &PeriodClosedError{}
			}
			successor.Quarantine, acceptedLate = "", true
		}
		if successor.Quarantine != "" {
			return &StillIneligibleError{Reason: successor.Quarantine}
		}
		res = RequeueResult{ItemID: id, MappingVersion: successor.MappingVersion}
		entry := audit.Entry{Actor: by, Subject: audit.Item(id), From: string(outbox.StateQuarantined),
			Reason:  "quarantined: " + string(it.QuarantineReason),
			Details: map[string]any{"mapping_version": mappingVersion, "item_mapping_version": it.MappingVersion}}
		if acceptedLate {
			entry.Details["accepted_period_closed"] = "sent knowingly after its billing period's invoice closed"
		}
		if successor.Identity == it.Identity && provenUnrecorded(it) {
			// Sent, and every attempt refused or failed by the provider's
			// error report: Stripe recorded nothing under the identifier,
			// but it may remember it (a saved answer, a failed event in its
			// dedup window), so a resend under it could read as accepted
			// while nothing is counted. A new identifier cannot bill twice.
			successor.SubjectRef = outbox.ReaddressRef(it.SubjectRef)
			entry.Details["readdressed_because"] = "every attempt was refused or reported failed by Stripe"
		}
		if successor.Identity == it.Identity {
			res.Action = ActionRequeued
			if err := r.Outbox.Requeue(ctx, tx, id, it.MappingVersion); err != nil {
				return err
			}
			entry.Action, entry.To = audit.ActionRequeue, string(outbox.StatePending)
			return audit.Record(ctx, tx, entry)
		}
		enq, err := r.Outbox.Supersede(ctx, tx, id, it.MappingVersion, successor)
		if err != nil {
			return err
		}
		res.Action, res.Successor = ActionReaddressed, &enq.ID
		entry.Action, entry.To = audit.ActionReaddress, string(outbox.StateSuperseded)
		entry.Details["successor"] = enq.ID
		return audit.Record(ctx, tx, entry)
	})
	if err != nil {
		return RequeueResult{}, err
	}
	return res, nil
}

// provenUnrecorded reports whether the item was sent and the provider is
// proven to have recorded none of its attempts: each was refused outright,
// or the provider's error report failed the only one that may have reached
// it (fail_accepted then counts every attempt refused).
func provenUnrecorded(it outbox.Item) bool {
	return it.Attempts > 0 && it.RefusedAttempts == it.Attempts
}

// IsConflict reports whether err is a requeue refusal the caller should see
// as a conflict (409) rather than a failure.
func IsConflict(err error) bool {
	var (
		se *outbox.StateError
		ie *StillIneligibleError
	)
	var pc *PeriodClosedError
	return errors.As(err, &se) || errors.As(err, &ie) || errors.As(err, &pc) || errors.Is(err, outbox.ErrMappingChanged) ||
		errors.Is(err, outbox.ErrMayHaveReached) || errors.Is(err, outbox.ErrNotSendable) ||
		errors.Is(err, outbox.ErrSuccessorExists) || errors.Is(err, meter.ErrAggregationChanged) ||
		errors.Is(err, meter.ErrStalled)
}
