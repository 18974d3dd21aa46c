package meter

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tallymeter/tally/mappings"
)

// batchSender sends a pgx.Batch: a pool or a connection.
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// sendGroup begins a READ COMMITTED transaction on db, inserts events in
// it in their order (sqlIngest) and reads the mappings of their tenants
// and features, and, with commit, commits it. It returns the transaction
// (nil with commit), the rows inserted by tenant and id, and the
// mappings. Where db sends batches, all of it goes in one round trip (a
// pgx.Batch that begins the transaction): a group then costs the database
// two round trips, this and its commit, or this one alone with commit.
// Without commit, the caller commits or rolls back the transaction. On an
// error nothing is stored and nothing is left open.
func sendGroup(ctx context.Context, db TxBeginner, events []Event, commit bool) (pgx.Tx, map[eventKey]insertedRow, map[[2]string]mappings.Pair, error) {
	pairs := make(map[[2]string]bool)
	for _, ev := range events {
		pairs[[2]string{ev.Tenant, ev.Feature}] = true
	}
	var st mappings.Store
	sender, ok := db.(batchSender)
	if !ok {
		tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		if err != nil {
			return nil, nil, nil, err
		}
		inserted, err := insertEvents(ctx, tx, events)
		var maps map[[2]string]mappings.Pair
		if err == nil {
			maps, err = st.LookupMany(ctx, tx, pairs)
		}
		if err == nil && commit {
			if err = tx.Commit(ctx); err == nil {
				return nil, inserted, maps, nil
			}
			err = fmt.Errorf("meter: committing %d events: %w", len(events), err)
		}
		if err != nil {
			_ = tx.Rollback(ctx)
			return nil, nil, nil, err
		}
		return tx, inserted, maps, nil
	}
	var (
		b        pgx.Batch
		inserted map[eventKey]insertedRow
		maps     map[[2]string]mappings.Pair
	)
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	b.Queue(sqlIngest, ingestArgs(events)).Query(func(rows pgx.Rows) (err error) {
		inserted, err = scanInserted(rows, len(events))
		if err != nil {
			return fmt.Errorf("meter: writing %d events: %w", len(events), err)
		}
		return nil
	})
	// LookupMany's one query, queued here and answered from the batch.
	lookup := &batchedQuery{}
	if _, err := st.LookupMany(ctx, lookup, pairs); !errors.Is(err, errQueued) {
		return nil, nil, nil, fmt.Errorf("meter: queueing the mappings' lookup: %w", err)
	}
	b.Queue(lookup.sql, lookup.args...).Query(func(rows pgx.Rows) (err error) {
		lookup.rows = rows
		maps, err = st.LookupMany(ctx, lookup, pairs)
		return err
	})
	if commit {
		b.Queue("commit").Exec(func(tag pgconn.CommandTag) error {
			if tag.String() != "COMMIT" { // a failed transaction answers ROLLBACK
				return fmt.Errorf("meter: committing %d events: %w", len(events), pgx.ErrTxCommitRollback)
			}
			return nil
		})
	}
	br := sender.SendBatch(ctx, &b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		_ = tx.Rollback(ctx)
		return nil, nil, nil, err
	}
	if commit {
		_ = tx.Rollback(ctx) // committed: this gives the connection back
		return nil, inserted, maps, nil
	}
	return tx, inserted, maps, nil
}

// batchedQuery has the one query of a function that reads through a
// mappings.Querier run in a pgx.Batch: called first, before the batch is
// sent, it notes the query and ends the call with errQueued; called again
// with the batch's rows for that query, it answers the same query with
// them. Any other use fails rather than read another query's rows.
type batchedQuery struct {
	sql  string
	args []any
	rows pgx.Rows // the batch's answer to sql; nil until the batch is sent
	used bool     // rows were handed out
}

// errQueued ends the first call through a batchedQuery.
var errQueued = errors.New("meter: query queued in a batch")

// errNotBatched is any use of a batchedQuery but its one query.
var errNotBatched = errors.New("meter: only one query can be queued in a batch this way")

func (q *batchedQuery) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	switch {
	case q.rows == nil && q.sql == "":
		q.sql, q.args = sql, args
		return nil, errQueued
	case q.rows != nil && !q.used && sql == q.sql:
		q.used = true
		return q.rows, nil
	}
	return nil, errNotBatched
}

func (q *batchedQuery) QueryRow(context.Context, string, ...any) pgx.Row { return errRow{} }

func (q *batchedQuery) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errNotBatched
}

// errRow is a row that fails with errNotBatched.
type errRow struct{}

func (errRow) Scan(...any) error { return errNotBatched }

// commitsAtOnce says whether a group's transaction can be committed in the
// round trip that writes it, before its outcome is seen: when each of its
// batches (live) has one event to insert, so that an event refused once
// the transaction has committed leaves nothing of its batch stored, and
// when, as far as recent groups read the mappings, none of its events
// (evs) is of a feature staged at ingest (a per-event feature), whose
// staging must share the transaction. An event of a feature mapped per
// event since is left to the stager's next pass, as it is when the
// mapping comes just after an ingest's read of it.
func (in *Ingester) commitsAtOnce(db TxBeginner, live []*pending, evs []Event) bool {
	if _, ok := db.(batchSender); !ok {
		return false
	}
	for _, p := range live {
		if len(p.unique) != 1 {
			return false
		}
	}
	if in.Stager == nil {
		return true
	}
	b := &in.batch
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, ev := range evs {
		if perEvent, known := b.staged[ev.Feature]; !known || perEvent {
			return false
		}
	}
	return true
}

// writeCommitted writes a group that commitsAtOnce allows in one round
// trip, transaction and commit, and then answers each batch: a batch
// whose event collided with one stored before is that event's duplicate,
// or, with other content, refused on its own (nothing of it was stored);
// a batch whose collision cannot be read fails with that error, though
// the others were stored. Any other error is the group's: nothing was
// stored.
func (in *Ingester) writeCommitted(ctx context.Context, db TxBeginner, firsts []owned, evs []Event) error {
	_, inserted, maps, err := sendGroup(ctx, db, evs, true)
	if err != nil {
		return err
	}
	in.batch.learn(maps)
	if len(inserted) < len(firsts) {
		unique := make([]int, len(evs))
		for j := range unique {
			unique[j] = j
		}
		if err := in.compareExisting(ctx, db, evs, unique, inserted, &Result{}); err != nil {
			if _, err := refuseChanged(err, firsts); err != nil {
				for _, o := range firsts {
					ev := o.req.events[o.i]
					if _, ok := inserted[eventKey{ev.Tenant, ev.ID}]; !ok {
						o.req.err = err
					}
				}
			}
		}
	}
	for _, o := range firsts {
		if o.req.err != nil {
			continue
		}
		ev := o.req.events[o.i]
		if _, ok := inserted[eventKey{ev.Tenant, ev.ID}]; !ok {
			o.req.res.Duplicates++
			continue
		}
		o.req.res.Accepted++
		if p := maps[[2]string{ev.Tenant, ev.Feature}]; p.Feature == nil || p.Tenant == nil {
			o.req.res.Unmapped++
		}
	}
	return nil
}

// learnt bounds batcher.staged: past it, what was learnt is forgotten.
const learnt = 10_000

// learn notes, from the mappings a group read, which of its features are
// staged at ingest (commitsAtOnce).
func (b *batcher) learn(maps map[[2]string]mappings.Pair) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.staged == nil || len(b.staged) >= learnt {
		b.staged = make(map[string]bool)
	}
	for k, p := range maps {
		b.staged[k[1]] = p.Feature != nil && p.Feature.Aggregation.PerEvent()
	}
}
