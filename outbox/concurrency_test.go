package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// event is one entry of the per-item log the concurrency test keeps from the
// workers' side. seq orders events across goroutines: a claim takes its seq
// after its transaction committed (an upper bound of its commit), a write
// takes one before it is issued (a lower bound of its effect) and one after
// it returned (done). So a claim whose seq is below a write's had committed
// before that write began.
type event struct {
	item  int64
	token int64
	owner string
	// leasedAt and expiresAt are the claim's lease by the database clock.
	leasedAt, expiresAt time.Time
	claim               bool
	ok                  bool // a write that landed
	seq                 int64
	done                int64
	landed              outbox.State
}

type eventLog struct {
	mu  sync.Mutex
	seq atomic.Int64
	evs []event
}

func (l *eventLog) add(e event) {
	l.mu.Lock()
	l.evs = append(l.evs, e)
	l.mu.Unlock()
}

// TestConcurrentClaimAndTransition runs workers on separate connections over
// thousands of items with leases short enough to expire mid-run: some workers
// die holding leases, some answer after their lease expired. It then proves
// from the per-item log of lease tokens that no item was ever held by two
// owners at once, that every stale write was refused, and that every item is
// in exactly one state.
func TestConcurrentClaimAndTransition(t *testing.T) {
	t.Parallel()
	for _, policy := range []outbox.Policy{outbox.PerKey, outbox.BestEffort} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			runConcurrent(t, policy)
		})
	}
}

func runConcurrent(t *testing.T, policy outbox.Policy) {
	const (
		items   = 2000
		keys    = 150
		workers = 8
		lease   = 60 * time.Millisecond
	)
	b := setup(t, outbox.Config{
		Lease: lease, BackoffBase: 2 * time.Millisecond, BackoffCap: 10 * time.Millisecond, MaxAttempts: 6,
		RateLimitDelay: 5 * time.Millisecond,
	})
	url := testdb.URLOf(t, b.pool)
	var all []outbox.NewItem
	for i := 0; i < items; i++ {
		it := newItem(i)
		it.Payload.Customer = fmt.Sprintf("cus_%d", i%keys)
		all = append(all, it)
	}
	b.enqueue(t, all...)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var (
		log        eventLog
		staleSeen  atomic.Int64
		violations = make(chan string, 100)
		wg         sync.WaitGroup
		stop       = make(chan struct{})
	)

	// Under PerKey, no key may ever hold two unexpired leases: sampled from
	// the database throughout the run.
	if policy == outbox.PerKey {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				violations <- err.Error()
				return
			}
			defer conn.Close(context.Background())
			for {
				select {
				case <-stop:
					return
				default:
				}
				var key string
				err := conn.QueryRow(ctx, `SELECT ordering_key FROM outbox_items
					WHERE state = 'leased' AND lease_expires_at >= clock_timestamp()
					GROUP BY ordering_key HAVING count(*) > 1 LIMIT 1`).Scan(&key)
				if err == nil {
					violations <- "two live leases on key " + key
					return
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}

	// The maintenance pass sweeps items whose cap is spent by dead workers.
	wg.Add(1)
	go func() {
		defer wg.Done()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			violations <- err.Error()
			return
		}
		defer conn.Close(context.Background())
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			if _, err := b.store.Sweep(ctx, conn); err != nil && ctx.Err() == nil {
				violations <- err.Error()
				return
			}
		}
	}()

	var workerWG sync.WaitGroup
	for w := 0; w < workers; w++ {
		workerWG.Add(1)
		go func() {
			defer workerWG.Done()
			owner := fmt.Sprintf("w%d", w)
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				violations <- err.Error()
				return
			}
			defer conn.Close(context.Background())
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			idle := 0
			for ctx.Err() == nil {
				leases, err := b.store.Claim(ctx, conn, outbox.ClaimOptions{Owner: owner, Limit: 1 + rng.IntN(10), Policy: policy})
				if err != nil {
					violations <- "claim: " + err.Error()
					return
				}
				at := log.seq.Add(1)
				for _, l := range leases {
					log.add(event{item: l.ID, token: l.LeaseToken, owner: owner, claim: true, seq: at,
						leasedAt: *l.LeasedAt, expiresAt: *l.LeaseExpiresAt})
				}
				if len(leases) == 0 {
					// Done when nothing is pending or leased any more.
					var open int
					if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state IN ('pending', 'leased')`).Scan(&open); err != nil {
						violations <- err.Error()
						return
					}
					if open == 0 {
						return
					}
					idle++
					time.Sleep(time.Duration(1+rng.IntN(5)) * time.Millisecond)
					continue
				}
				var outcomes []outbox.Outcome
				for _, l := range leases {
					o := outbox.Outcome{Lease: l}
					switch p := rng.IntN(100); {
					case p < 70:
						o.Kind, o.ProviderRef = outbox.Accepted, fmt.Sprintf("req_%d_%d", l.ID, l.LeaseToken)
					case p < 82:
						o.Kind, o.Error = outbox.Retry, outbox.ErrorInfo{Code: "stripe_5xx", Status: 503}
					case p < 85:
						o.Kind, o.Error = outbox.RateLimited, outbox.ErrorInfo{Code: "rate_limited", Status: 429}
					case p < 87:
						o.Kind = outbox.Uncertain
					case p < 89:
						o.Kind, o.Error = outbox.Rejected, outbox.ErrorInfo{Code: "invalid_request", Status: 400}
					case p < 90:
						o.Kind, o.Reason = outbox.Quarantined, outbox.ReasonCustomerNotFound
					default:
						continue // the worker dies holding this lease
					}
					o.MinDelay = 0
					outcomes = append(outcomes, o)
				}
				// Some batches answer late: their leases have expired and may
				// have been claimed by somebody else.
				if rng.IntN(10) == 0 {
					time.Sleep(lease + time.Duration(rng.IntN(40))*time.Millisecond)
				}
				if len(outcomes) == 0 {
					continue
				}
				before := log.seq.Add(1)
				res, err := b.store.Record(ctx, conn, outcomes)
				after := log.seq.Add(1)
				if err != nil {
					violations <- "record: " + err.Error()
					return
				}
				for i, r := range res {
					e := event{item: r.ID, token: outcomes[i].Lease.LeaseToken, owner: owner, seq: before, done: after}
					switch {
					case r.Err == nil:
						e.ok, e.landed = true, r.State
					case errors.Is(r.Err, outbox.ErrStaleLease):
						staleSeen.Add(1)
					default:
						violations <- "record: " + r.Err.Error()
					}
					log.add(e)
				}
			}
		}()
	}
	workerWG.Wait()
	close(stop)
	wg.Wait()
	close(violations)
	for v := range violations {
		t.Error(v)
	}
	require.NoError(t, ctx.Err(), "the run did not finish")

	// The log, per item.
	byItem := map[int64][]event{}
	for _, e := range log.evs {
		byItem[e.item] = append(byItem[e.item], e)
	}
	var claims, writes, stale int
	for id, evs := range byItem {
		sort.SliceStable(evs, func(i, j int) bool { return evs[i].seq < evs[j].seq })
		claimSeq := map[int64]int64{} // token -> seq of its claim
		landed := map[int64]int{}
		var maxToken int64
		for _, e := range evs {
			if e.claim {
				claims++
				_, dup := claimSeq[e.token]
				require.False(t, dup, "item %d: token %d handed out twice", id, e.token)
				maxToken = max(maxToken, e.token)
				claimSeq[e.token] = e.seq
				continue
			}
			writes++
			if !e.ok {
				stale++
				continue
			}
			landed[e.token]++
			require.Equal(t, 1, landed[e.token], "item %d: two writes landed for token %d", id, e.token)
			// A write lands only for the newest claim: if a newer claim had
			// committed before the write was issued, the write must have
			// been fenced out.
			for tok, seq := range claimSeq {
				if tok > e.token && seq < e.seq {
					t.Fatalf("item %d: write of token %d by %s landed after token %d was claimed", id, e.token, e.owner, tok)
				}
			}
		}
		// Tokens are unique and gap-free: every claim of the item is in the log.
		require.Equal(t, int64(len(claimSeq)), maxToken, "item %d: claims %v", id, claimSeq)
	}
	require.Equal(t, staleSeen.Load(), int64(stale))
	require.Equal(t, float64(stale), b.stale("T2")+b.stale("T3")+b.stale("T4")+b.stale("T5")+b.stale("T6"),
		"every stale write was refused and counted")
	t.Logf("%s: %d claims, %d writes, %d stale writes refused", policy, claims, writes, stale)
	require.Positive(t, stale, "leases must expire mid-run for this test to mean anything")

	// No item was ever held by two owners at once: claim k+1 of an item began
	// only after lease k had expired or its holder's answer had landed
	// (outbox_attempts.recorded_at), all by the database clock.
	answered := map[[2]int64]time.Time{} // (item, token) -> when a holder's answer landed
	rows, err := b.pool.Query(b.ctx, `SELECT item_id, lease_token, recorded_at FROM outbox_attempts WHERE outcome <> 'abandoned'`)
	require.NoError(t, err)
	var (
		aItem, aToken int64
		aAt           time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&aItem, &aToken, &aAt}, func() error {
		answered[[2]int64{aItem, aToken}] = aAt
		return nil
	})
	require.NoError(t, err)
	var overlapsChecked int
	for id, evs := range byItem {
		leases := map[int64]event{}
		for _, e := range evs {
			if e.claim {
				leases[e.token] = e
			}
		}
		for tok := int64(1); tok < int64(len(leases)); tok++ {
			prev, next := leases[tok], leases[tok+1]
			freed := prev.expiresAt
			if at, ok := answered[[2]int64{id, tok}]; ok && at.Before(freed) {
				freed = at
			}
			require.False(t, next.leasedAt.Before(freed),
				"item %d: token %d leased at %s while token %d (%s) held it until %s",
				id, tok+1, next.leasedAt, tok, prev.owner, freed)
			overlapsChecked++
		}
	}
	require.Positive(t, overlapsChecked)

	// Every item is in exactly one state, and the database agrees with the log.
	g, err := b.store.ReadGauge(b.ctx, b.pool)
	require.NoError(t, err)
	var total int64
	for _, n := range g.Counts {
		total += n
	}
	require.Equal(t, int64(items), total)
	require.Zero(t, g.Counts[outbox.StatePending]+g.Counts[outbox.StateLeased])
	rows, err = b.pool.Query(b.ctx, `SELECT id, state, lease_token, attempts,
		(SELECT count(*) FROM outbox_attempts a WHERE a.item_id = o.id) FROM outbox_items o`)
	require.NoError(t, err)
	var (
		id, token, attemptRows int64
		state                  outbox.State
		attempts               int
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &state, &token, &attempts, &attemptRows}, func() error {
		require.Equal(t, token, int64(attempts))
		require.Equal(t, token, attemptRows, "item %d: every claim has exactly one recorded outcome", id)
		var last *event
		for i := range byItem[id] {
			if e := &byItem[id][i]; e.ok && (last == nil || e.token > last.token) {
				last = e
			}
		}
		if last != nil && last.token == token {
			require.Equal(t, last.landed, state, "item %d", id)
		} else {
			// The newest claim never answered: its item was swept.
			require.Equal(t, outbox.StateUncertain, state, "item %d", id)
		}
		return nil
	})
	require.NoError(t, err)
}
