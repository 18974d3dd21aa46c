package exporter_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
)

// lockingExporter accepts every item at once, but first locks the first
// item it is given in a transaction of its own (held until release), so
// that writing that item's outcome waits.
type lockingExporter struct {
	instant
	pool   *pgxpool.Pool
	mu     sync.Mutex
	held   pgx.Tx
	locked chan int64 // the id locked, once
}

func (e *lockingExporter) Send(ctx context.Context, l outbox.Lease) outbox.Outcome {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.held == nil {
		tx, err := e.pool.Begin(ctx)
		if err == nil {
			_, err = tx.Exec(ctx, "SELECT id FROM outbox_item_states WHERE id = $1 FOR UPDATE", l.ID)
		}
		if err != nil {
			return outbox.Outcome{Kind: outbox.Retry, Error: outbox.ErrorInfo{Code: "test_lock", Message: err.Error()}}
		}
		e.held = tx
		e.locked <- l.ID
	}
	return outbox.Outcome{Kind: outbox.Accepted}
}

func (e *lockingExporter) release(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.held.Rollback(ctx)
}

// With Recorders > 1 a batch of outcomes that waits (here on a row lock;
// in production on a slow transaction) does not hold back the batches
// behind it; with one recorder it does. Either way every item ends
// accepted once, with one attempt.
func TestRecordersWriteBatchesConcurrently(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		recorders         int
		othersWhileLocked bool
	}{
		{recorders: 1, othersWhileLocked: false},
		{recorders: 2, othersWhileLocked: true},
	} {
		t.Run(map[int]string{1: "one recorder", 2: "two recorders"}[tc.recorders], func(t *testing.T) {
			t.Parallel()
			const n = 5
			ctx := context.Background()
			pool, store := benchOutboxOf(t, n, exporter.StripeMeterEvents)
			exp := &lockingExporter{pool: pool, locked: make(chan int64, 1)}
			d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 1, Batch: 1, InFlight: 1, RecordBatch: 1,
				Recorders: tc.recorders, PollInterval: 20 * time.Millisecond, FlushEvery: 5 * time.Millisecond},
				store, pool, exp, time.Second, func() (exporter.Destination, error) {
					return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
				}, exporter.NewLimiter(1000), nil, nil)
			require.NoError(t, err)
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = d.Run(runCtx) }()
			defer func() { stop(); <-done }()

			lockedID := <-exp.locked
			accepted := func() (others int, locked bool) {
				rows, err := pool.Query(ctx, "SELECT id FROM outbox_item_states WHERE state = 'accepted'")
				require.NoError(t, err)
				ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
				require.NoError(t, err)
				for _, id := range ids {
					if id == lockedID {
						locked = true
					} else {
						others++
					}
				}
				return others, locked
			}
			if tc.othersWhileLocked {
				require.Eventually(t, func() bool { others, _ := accepted(); return others == n-1 }, 10*time.Second, 10*time.Millisecond,
					"the other items' outcomes are written while the first batch waits")
			} else {
				time.Sleep(500 * time.Millisecond)
			}
			others, locked := accepted()
			require.False(t, locked, "the locked item's outcome waits for the lock")
			if !tc.othersWhileLocked {
				require.Zero(t, others, "one recorder: every later batch waits behind the one that waits")
			}

			require.NoError(t, exp.release(ctx))
			require.Eventually(t, func() bool { others, locked := accepted(); return others == n-1 && locked }, 10*time.Second, 10*time.Millisecond)
			var attempts, logged int
			require.NoError(t, pool.QueryRow(ctx, "SELECT sum(attempts), (SELECT count(*) FROM outbox_attempts) FROM outbox_item_states").Scan(&attempts, &logged))
			require.Equal(t, [2]int{n, n}, [2]int{attempts, logged}, "one attempt an item, each logged once")
		})
	}
}
