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

// concurrentRun is one run of the concurrency test: what its goroutines
// share and what they log.
type concurrentRun struct {
	t      *testing.T
	b      *testBundle
	policy outbox.Policy
	lease  time.Duration
	url    string
	ctx    context.Context
	// log is written by the workers and read after they are done.
	log       eventLog
	staleSeen atomic.Int64
	// violations is written by every goroutine and read after all are done.
	violations chan string
	// stop is closed when the workers are done, to stop the watchers.
	stop chan struct{}
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
	var all []outbox.NewItem
	for i := 0; i < items; i++ {
		it := newItem(i)
		it.Payload.Customer = fmt.Sprintf("cus_%d", i%keys)
		all = append(all, it)
	}
	b.enqueue(t, all...)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r := &concurrentRun{
		t: t, b: b, policy: policy, lease: lease, url: testdb.URLOf(t, b.pool), ctx: ctx,
		violations: make(chan string, 100), stop: make(chan struct{}),
	}
	var wg sync.WaitGroup
	if policy == outbox.PerKey {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.watchKeys()
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.sweep()
	}()
	var workerWG sync.WaitGroup
	for w := 0; w < workers; w++ {
		workerWG.Add(1)
		go func() {
			defer workerWG.Done()
			r.work(w)
		}()
	}
	workerWG.Wait()
	close(r.stop)
	wg.Wait()
	close(r.violations)
	for v := range r.violations {
		t.Error(v)
	}
	require.NoError(t, ctx.Err(), "the run did not finish")

	byItem := map[int64][]event{}
	for _, e := range r.log.evs {
		byItem[e.item] = append(byItem[e.item], e)
	}
	r.checkFencing(byItem)
	r.checkNoOverlap(byItem)
	r.checkStates(byItem, items)
}

// connect opens a connection of the goroutine's own, or reports why not.
func (r *concurrentRun) connect() *pgx.Conn {
	conn, err := pgx.Connect(r.ctx, r.url)
	if err != nil {
		r.violations <- err.Error()
		return nil
	}
	return conn
}

// watchKeys samples the database throughout the run: under PerKey, no key
// may ever hold two unexpired leases.
func (r *concurrentRun) watchKeys() {
	conn := r.connect()
	if conn == nil {
		return
	}
	defer conn.Close(context.Background())
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		var key string
		err := conn.QueryRow(r.ctx, `SELECT ordering_key FROM outbox_items
			WHERE state = 'leased' AND lease_expires_at >= clock_timestamp()
			GROUP BY ordering_key HAVING count(*) > 1 LIMIT 1`).Scan(&key)
		if err == nil {
			r.violations <- "two live leases on key " + key
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// sweep runs the maintenance pass, which sweeps items whose cap is spent by
// dead workers.
func (r *concurrentRun) sweep() {
	conn := r.connect()
	if conn == nil {
		return
	}
	defer conn.Close(context.Background())
	for {
		select {
		case <-r.stop:
			return
		case <-time.After(20 * time.Millisecond):
		}
		if _, err := r.b.store.Sweep(r.ctx, conn); err != nil && r.ctx.Err() == nil {
			r.violations <- err.Error()
			return
		}
	}
}

// work is worker w: it claims, answers most leases (some late, some never)
// and logs every claim and write, until nothing is pending or leased.
func (r *concurrentRun) work(w int) {
	owner := fmt.Sprintf("w%d", w)
	conn := r.connect()
	if conn == nil {
		return
	}
	defer conn.Close(context.Background())
	rng := rand.New(rand.NewPCG(uint64(w), 42))
	for r.ctx.Err() == nil {
		leases, err := r.b.store.Claim(r.ctx, conn, outbox.ClaimOptions{Owner: owner, Limit: 1 + rng.IntN(10), Policy: r.policy})
		if err != nil {
			r.violations <- "claim: " + err.Error()
			return
		}
		at := r.log.seq.Add(1)
		for _, l := range leases {
			r.log.add(event{item: l.ID, token: l.LeaseToken, owner: owner, claim: true, seq: at,
				leasedAt: *l.LeasedAt, expiresAt: *l.LeaseExpiresAt})
		}
		if len(leases) == 0 {
			// Done when nothing is pending or leased any more.
			var open int
			if err := conn.QueryRow(r.ctx, `SELECT count(*) FROM outbox_items WHERE state IN ('pending', 'leased')`).Scan(&open); err != nil {
				r.violations <- err.Error()
				return
			}
			if open == 0 {
				return
			}
			time.Sleep(time.Duration(1+rng.IntN(5)) * time.Millisecond)
			continue
		}
		outcomes := randomOutcomes(rng, leases)
		// Some batches answer late: their leases have expired and may
		// have been claimed by somebody else.
		if rng.IntN(10) == 0 {
			time.Sleep(r.lease + time.Duration(rng.IntN(40))*time.Millisecond)
		}
		if len(outcomes) == 0 {
			continue
		}
		if !r.record(conn, owner, outcomes) {
			return
		}
	}
}

// randomOutcomes draws an outcome for most leases; the worker dies holding
// the others.
func randomOutcomes(rng *rand.Rand, leases []outbox.Lease) []outbox.Outcome {
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
	return outcomes
}

// record records a batch of outcomes and logs each write; false when the
// run must stop.
func (r *concurrentRun) record(conn *pgx.Conn, owner string, outcomes []outbox.Outcome) bool {
	before := r.log.seq.Add(1)
	res, err := r.b.store.Record(r.ctx, conn, outcomes)
	after := r.log.seq.Add(1)
	if err != nil {
		r.violations <- "record: " + err.Error()
		return false
	}
	for i, got := range res {
		e := event{item: got.ID, token: outcomes[i].Lease.LeaseToken, owner: owner, seq: before, done: after}
		switch {
		case got.Err == nil:
			e.ok, e.landed = true, got.State
		case errors.Is(got.Err, outbox.ErrStaleLease):
			r.staleSeen.Add(1)
		default:
			r.violations <- "record: " + got.Err.Error()
		}
		r.log.add(e)
	}
	return true
}

// checkFencing proves from the per-item log that every lease token was
// handed out once, that at most one write landed per token, and that a
// write landed only for the newest claim; every other write was refused and
// counted.
func (r *concurrentRun) checkFencing(byItem map[int64][]event) {
	t := r.t
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
	b := r.b
	require.Equal(t, r.staleSeen.Load(), int64(stale))
	require.Equal(t, float64(stale), b.stale(outbox.TransitionAccept)+b.stale(outbox.TransitionRetry)+b.stale(outbox.TransitionMarkUncertain)+b.stale(outbox.TransitionReject)+b.stale(outbox.TransitionQuarantine),
		"every stale write was refused and counted")
	t.Logf("%s: %d claims, %d writes, %d stale writes refused", r.policy, claims, writes, stale)
	require.Positive(t, stale, "leases must expire mid-run for this test to mean anything")
}

// checkNoOverlap proves that no item was ever held by two owners at once:
// claim k+1 of an item began only after lease k had expired or its holder's
// answer had landed (outbox_attempts.recorded_at), all by the database
// clock.
func (r *concurrentRun) checkNoOverlap(byItem map[int64][]event) {
	t, b := r.t, r.b
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
}

// checkStates proves that every item is in exactly one state, and that the
// database agrees with the log.
func (r *concurrentRun) checkStates(byItem map[int64][]event, items int) {
	t, b := r.t, r.b
	g, err := b.store.ReadGauge(b.ctx, b.pool)
	require.NoError(t, err)
	var total int64
	for _, n := range g.Counts {
		total += n
	}
	require.Equal(t, int64(items), total)
	require.Zero(t, g.Counts[outbox.StatePending]+g.Counts[outbox.StateLeased])
	rows, err := b.pool.Query(b.ctx, `SELECT id, state, lease_token, attempts,
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
