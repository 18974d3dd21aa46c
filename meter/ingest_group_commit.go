package meter

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// GroupCommit is how Ingester.Post shares one transaction and one commit
// between concurrent small batches (group commit): a batch of at most half of MaxEvents
// events joins the open group (the first to join leads it); the group
// closes when it holds MaxEvents events or MaxBytes bytes, or once one of
// Commits transactions is free and it holds as many batches as the group
// of a typical batch recently held (or Wait, or a recent write's time, has
// passed; see peerWait), and is then written in one transaction and one
// commit. While every commit slot is busy a group keeps filling, so under
// load groups grow by themselves, and a lone client never waits. The zero
// value (MaxEvents 0) groups nothing: every batch is its own transaction.
type GroupCommit struct {
	// Wait is the most a group with a commit slot waits for as many
	// batches as recent groups held (TALLY_INGEST_GROUP_COMMIT_WAIT); it
	// never waits longer than a recent write took, and 0 waits for none.
	// serve's default is DefaultGroupCommitWait.
	Wait time.Duration
	// MaxEvents is the most events of one group, and a batch with more
	// than half as many is written alone
	// (TALLY_INGEST_GROUP_COMMIT_EVENTS); 0 turns group commit off.
	// serve's default is DefaultGroupCommitEvents.
	MaxEvents int
	// MaxBytes is the most bytes (ids, tenants and features, and 32 for
	// the rest of each event) of one group (TALLY_INGEST_GROUP_COMMIT_BYTES).
	// serve's default is DefaultGroupCommitBytes.
	MaxBytes int
	// Commits is how many groups may be written at once
	// (TALLY_INGEST_GROUP_COMMIT_COMMITS), at least 1. serve's default is
	// DefaultGroupCommitCommits.
	Commits int
}

// serve's defaults of GroupCommit, chosen with
// BenchmarkSingleEventIngestVsInsert.
const (
	// DefaultGroupCommitWait bounds how long a small request waits for
	// others to share its commit; a group also waits no longer than a
	// recent write took.
	DefaultGroupCommitWait = 5 * time.Millisecond
	// DefaultGroupCommitEvents is the most events a group holds.
	DefaultGroupCommitEvents = 500
	// DefaultGroupCommitBytes is the most bytes of events a group holds.
	DefaultGroupCommitBytes = 256 << 10
	// DefaultGroupCommitCommits is two groups written at once: one fills
	// the WAL while the other waits for its flush.
	DefaultGroupCommitCommits = 2
)

// eventOverhead is what an event weighs in a group beyond its strings.
const eventOverhead = 32

// pending is one batch in a group and, once the group is written, its
// answer.
type pending struct {
	events []Event
	unique []int // indexes of events first with their (tenant, id)
	dups   int   // events repeating one earlier in the batch (then, in a group, or in an earlier batch of it)
	res    Result
	err    error
}

// Post ingests one batch (already decoded and authorised) in a transaction
// of db, and answers only after that transaction committed: with
// GroupCommit set, small batches posted at the same time share one (see
// ingestGroup); a batch refused (an *InvalidBatchError, a
// *QuarantineCapError) stores nothing and fails no other batch.
func (in *Ingester) Post(ctx context.Context, db pgdb.DB, events []Event) (Result, error) {
	c := in.GroupCommit
	if c.MaxEvents <= 0 || len(events) > c.MaxEvents/2 || len(events) == 0 {
		return in.ingestAlone(ctx, db, events)
	}
	p := &pending{events: events}
	if err := p.dedupe(); err != nil {
		return Result{}, err
	}
	g, leader := in.join(p)
	if leader {
		in.lead(ctx, db, g)
	}
	<-g.done
	return p.res, p.err
}

// ingestAlone ingests a batch in a transaction of its own.
func (in *Ingester) ingestAlone(ctx context.Context, db pgdb.DB, events []Event) (res Result, err error) {
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		res, err = in.Ingest(ctx, tx, events)
		return err
	})
	return res, err
}

// dedupe notes the batch's events first with their (tenant, id) and counts
// the repeats with the same content; a repeat with other content refuses
// the batch before it joins a group, as Ingest would.
func (p *pending) dedupe() error {
	first := make(map[eventKey]int, len(p.events))
	var problems []Problem
	for i, ev := range p.events {
		k := eventKey{ev.Tenant, ev.ID}
		j, seen := first[k]
		switch {
		case !seen:
			first[k] = i
			p.unique = append(p.unique, i)
		case sameContent(p.events[j], ev):
			p.dups++
		default:
			idx := i
			problems = append(problems, Problem{Index: &idx, Field: "id",
				Reason: fmt.Sprintf("repeats the id of event %d with different content", j)})
		}
	}
	if len(problems) > 0 {
		return &InvalidBatchError{Problems: problems}
	}
	return nil
}

// writeGroup writes the group's batches, retrying without each batch
// refused on its own (see ingestGroup), and then, each in a transaction of
// its own, the batches deferred for repeating an id of another batch of
// the group.
func (in *Ingester) writeGroup(ctx context.Context, db pgdb.DB, reqs []*pending) {
	live := reqs
	var deferred []*pending
	for len(live) > 0 {
		err := pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			var (
				refused int
				err     error
			)
			refused, deferred, err = in.ingestGroup(ctx, tx, live)
			if err == nil && refused > 0 {
				err = errRetryGroup
			}
			return err
		})
		switch {
		case errors.Is(err, errRetryGroup):
			live = without(live)
			continue
		case err != nil:
			for _, p := range live {
				p.res, p.err = Result{}, err
			}
			for _, p := range deferred {
				p.err = err
			}
			return
		}
		break
	}
	for _, p := range deferred {
		p.res, p.err = in.ingestAlone(ctx, db, p.events)
	}
}

// errGroupPanicked answers the batches of a group whose writing panicked.
var errGroupPanicked = errors.New("meter: writing the group failed")

// errRetryGroup rolls back a group's transaction that refused a batch.
var errRetryGroup = errors.New("meter: a batch of the group was refused")

// without is live less the batches refused (those with an error).
func without(live []*pending) []*pending {
	out := live[:0:0]
	for _, p := range live {
		if p.err == nil {
			out = append(out, p)
		}
	}
	return out
}
