package quarantine

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// Bulk requeue limits: how many quarantined items one call reads and
// requeues. A call that read a full page answers NextAfter; the next call
// continues from there.
const (
	// DefaultBulkLimit is the number of items a bulk requeue takes when
	// the caller names none.
	DefaultBulkLimit = 1000
	// MaxBulkLimit is the most items one bulk requeue takes: each is its
	// own transaction, and the whole call answers one HTTP request well
	// within the server's write timeout.
	MaxBulkLimit = 2000
)

// ActionRefused is a bulk requeue's answer for an item it did not requeue;
// BulkItem.Refusal says why.
const ActionRefused = "refused"

// BulkRequest is what a bulk requeue requeues: every quarantined item the
// filter matches with an id above After, by id, at most Limit of them.
type BulkRequest struct {
	Filter Filter
	// After skips the items up to this id: the NextAfter of the call
	// before.
	After int64
	// Limit is 1 to MaxBulkLimit. Defaults to DefaultBulkLimit.
	Limit int
	// DryRun answers what the requeues would do and changes nothing.
	DryRun bool
	// By is the operator the audit log names.
	By string
	// Options are what the operator accepts knowingly, for every item.
	Options RequeueOptions
}

// BulkItem is what a bulk requeue did (or, in a dry run, would do) with
// one item.
type BulkItem struct {
	ItemID int64 `json:"item_id"`
	// Action is requeued, readdressed or refused.
	Action string `json:"action"`
	// Refusal is the code of a refusal (RefusalCode), as the single
	// requeue answers it.
	Refusal string `json:"refusal,omitempty"`
	// Successor is the new item of a re-addressing; none in a dry run.
	Successor *int64 `json:"successor,omitempty"`
	// MappingVersion is the current mapping version read with the item,
	// the one the requeue checked.
	MappingVersion int `json:"mapping_version"`
}

// BulkTotals counts a bulk requeue's items per action, and its refusals
// per code.
type BulkTotals struct {
	Requeued    int            `json:"requeued"`
	Readdressed int            `json:"readdressed"`
	Refused     int            `json:"refused"`
	RefusedBy   map[string]int `json:"refused_by"`
}

// BulkResult is a bulk requeue's answer.
type BulkResult struct {
	DryRun bool       `json:"dry_run"`
	Items  []BulkItem `json:"items"`
	Totals BulkTotals `json:"totals"`
	// NextAfter, set when the call read a full page, is the After of the
	// next call: more items may match.
	NextAfter *int64 `json:"next_after,omitempty"`
}

// ErrBulkLimit is a bulk requeue's limit out of its range.
var ErrBulkLimit = fmt.Errorf("quarantine: the limit must be 1 to %d", MaxBulkLimit)

// RequeueMatching requeues every quarantined item req matches (at most
// its limit, by id) under the current mappings: the mapping version each
// item needs is read with it, and Requeue checks it again, so an item whose
// tenant's or feature's mapping changes between that read and its requeue
// is refused (mapping_changed) while the rest proceed. Each item is its own
// decision and its own transaction, audited like a single requeue (one
// entry per item requeued or re-addressed, naming req.By; refusals change
// nothing and record nothing); an item committed stays committed if a
// later one fails.
//
// A dry run makes the same requeues, in the same order, with the same
// checks and the same transactions, but commits none of them (each
// transaction's commit is a rollback), through an outbox store whose
// metrics count on no registry: it answers what the requeues would do now
// and leaves nothing behind — no state, no audit entry, no successor, no
// metric.
func (r *Requeuer) RequeueMatching(ctx context.Context, db pgdb.DB, req BulkRequest) (BulkResult, error) {
	return r.requeueMatching(ctx, db, req, nil)
}

// requeueMatching is RequeueMatching with a step between the read of the
// items and their requeues (tests change a mapping there).
func (r *Requeuer) requeueMatching(ctx context.Context, db pgdb.DB, req BulkRequest, afterRead func(context.Context) error) (BulkResult, error) {
	if req.Limit == 0 {
		req.Limit = DefaultBulkLimit
	}
	if req.Limit < 1 || req.Limit > MaxBulkLimit {
		return BulkResult{}, ErrBulkLimit
	}
	items, err := ItemsAfter(ctx, db, req.Filter, req.After, req.Limit)
	if err != nil {
		return BulkResult{}, err
	}
	if afterRead != nil {
		if err := afterRead(ctx); err != nil {
			return BulkResult{}, err
		}
	}
	requeuer := r
	if req.DryRun {
		quiet, err := outbox.New(r.Outbox.Config(), nil)
		if err != nil {
			return BulkResult{}, err
		}
		requeuer, db = &Requeuer{Outbox: quiet, Stager: r.Stager}, rollbacks{db}
	}
	res := BulkResult{DryRun: req.DryRun, Items: make([]BulkItem, 0, len(items)), Totals: BulkTotals{RefusedBy: map[string]int{}}}
	for i, it := range items {
		done, err := requeuer.RequeueWith(ctx, db, it.ID, it.CurrentVersion, req.By, req.Options)
		bi := BulkItem{ItemID: it.ID, MappingVersion: it.CurrentVersion, Action: done.Action}
		if !req.DryRun {
			bi.Successor = done.Successor // a dry run's was never kept
		}
		if err != nil {
			code := RefusalCode(err)
			if code == "" {
				return BulkResult{}, fmt.Errorf("quarantine: bulk requeue: item %d, after %d of %d items done: %w", it.ID, i, len(items), err)
			}
			bi.Action, bi.Refusal = ActionRefused, code
			res.Totals.RefusedBy[code]++
		}
		res.count(bi)
	}
	if len(items) == req.Limit {
		last := items[len(items)-1].ID
		res.NextAfter = &last
	}
	return res, nil
}

// count adds an item's answer to the result.
func (res *BulkResult) count(bi BulkItem) {
	switch bi.Action {
	case ActionRequeued:
		res.Totals.Requeued++
	case ActionReaddressed:
		res.Totals.Readdressed++
	case ActionRefused:
		res.Totals.Refused++
	}
	res.Items = append(res.Items, bi)
}

// rollbacks begins each requeue of a dry run as a transaction of its own,
// as the requeue would run, whose commit is a rollback.
type rollbacks struct{ pgdb.DB }

func (r rollbacks) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	tx, err := r.DB.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return rolledBack{tx}, nil
}

// rolledBack is a dry run's transaction: its commit rolls it back.
type rolledBack struct{ pgx.Tx }

func (t rolledBack) Commit(ctx context.Context) error { return t.Tx.Rollback(ctx) }

// Refusal codes: why a requeue did not happen, as the API and the CLI
// answer it.
const (
	RefusalNotFound           = "not_found"
	RefusalMappingChanged     = "mapping_changed"
	RefusalNotQuarantined     = "not_quarantined"
	RefusalStillIneligible    = "still_ineligible"
	RefusalMayHaveReached     = "may_have_reached"
	RefusalNotSendable        = "not_sendable"
	RefusalAggregationChanged = "aggregation_changed"
	RefusalExportStalled      = "export_stalled"
	RefusalSuccessorExists    = "successor_exists"
	RefusalPeriodClosed       = "period_closed"
)

// RefusalCode is the code of a requeue's refusal, or "" when err is not
// one (a failure).
func RefusalCode(err error) string {
	var (
		se *outbox.StateError
		ie *StillIneligibleError
		pc *PeriodClosedError
	)
	switch {
	case err == nil:
		return ""
	case errors.As(err, &pc):
		return RefusalPeriodClosed
	case errors.Is(err, outbox.ErrNotFound):
		return RefusalNotFound
	case errors.Is(err, outbox.ErrMappingChanged):
		return RefusalMappingChanged
	case errors.As(err, &se):
		return RefusalNotQuarantined
	case errors.As(err, &ie):
		return RefusalStillIneligible
	case errors.Is(err, outbox.ErrMayHaveReached):
		return RefusalMayHaveReached
	case errors.Is(err, outbox.ErrNotSendable):
		return RefusalNotSendable
	case errors.Is(err, meter.ErrAggregationChanged):
		return RefusalAggregationChanged
	case errors.Is(err, meter.ErrStalled):
		return RefusalExportStalled
	case errors.Is(err, outbox.ErrSuccessorExists):
		return RefusalSuccessorExists
	}
	return ""
}
