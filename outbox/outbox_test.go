package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type testBundle struct {
	ctx   context.Context
	pool  *pgxpool.Pool
	store *outbox.Store
	reg   *prometheus.Registry
}

func setup(t *testing.T, cfg outbox.Config) *testBundle {
	t.Helper()
	reg := prometheus.NewRegistry()
	store, err := outbox.New(cfg, reg)
	require.NoError(t, err)
	return &testBundle{ctx: context.Background(), pool: testdb.New(t), store: store, reg: reg}
}

// newItem returns an eligible item whose subject is n, for customer cus_<n%keys>.
func newItem(n int) outbox.NewItem {
	return outbox.NewItem{
		Identity: outbox.Identity{
			TenantKey:          "acme",
			SubjectKind:        outbox.SubjectUsageWindow,
			SubjectRef:         fmt.Sprintf("usage:api_calls:2026-11-01T00:00:00Z:2026-11-30T%02d:00:00Z:2026-11-30T%02d:59:59Z#%d", n%24, n%24, n),
			Exporter:           "stripe_meter_events",
			DestinationAccount: "acct_123",
			Mode:               outbox.ModeTest,
			MappingVersion:     1,
		},
		Payload: outbox.Payload{
			Customer:  fmt.Sprintf("cus_%d", n),
			EventName: "api_calls",
			Value:     int64(n) + 1,
			Timestamp: 1796000000,
			Feature:   "api_calls",
			Period:    "2026-11-01T00:00:00Z",
		},
	}
}

func (b *testBundle) enqueue(t *testing.T, items ...outbox.NewItem) []int64 {
	t.Helper()
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	ids := make([]int64, len(items))
	for i, it := range items {
		res, err := b.store.Enqueue(b.ctx, tx, it)
		require.NoError(t, err)
		ids[i] = res.ID
	}
	require.NoError(t, tx.Commit(b.ctx))
	return ids
}

func (b *testBundle) claim(t *testing.T, opts outbox.ClaimOptions) []outbox.Lease {
	t.Helper()
	if opts.Owner == "" {
		opts.Owner = "test"
	}
	if opts.Limit == 0 {
		opts.Limit = 100
	}
	leases, err := b.store.Claim(b.ctx, b.pool, opts)
	require.NoError(t, err)
	return leases
}

func (b *testBundle) claimOne(t *testing.T) outbox.Lease {
	t.Helper()
	leases := b.claim(t, outbox.ClaimOptions{Limit: 1})
	require.Len(t, leases, 1)
	return leases[0]
}

func (b *testBundle) get(t *testing.T, id int64) outbox.Item {
	t.Helper()
	it, err := b.store.Get(b.ctx, b.pool, id)
	require.NoError(t, err)
	return it
}

func (b *testBundle) stale(transition outbox.Transition) float64 {
	mfs, _ := b.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "tally_outbox_stale_writes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "transition" && l.GetValue() == string(transition) {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func TestEnqueueInsertsOncePerIdentity(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})

	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	first, err := b.store.Enqueue(b.ctx, tx, newItem(1))
	require.NoError(t, err)
	require.True(t, first.Inserted)
	require.Equal(t, outbox.StatePending, first.State)
	require.Equal(t, newItem(1).Identity.Identifier(), first.Identifier)

	// stage's stale path: the same identity collapses into the existing row.
	again, err := b.store.Enqueue(b.ctx, tx, newItem(1))
	require.NoError(t, err)
	require.False(t, again.Inserted)
	require.Equal(t, first.ID, again.ID)
	require.True(t, again.SamePayload)

	changed := newItem(1)
	changed.Payload.Value = 999
	other, err := b.store.Enqueue(b.ctx, tx, changed)
	require.NoError(t, err)
	require.Equal(t, first.ID, other.ID)
	require.False(t, other.SamePayload, "the existing payload wins and the caller is told")
	require.NoError(t, tx.Commit(b.ctx))

	it := b.get(t, first.ID)
	require.Equal(t, int64(2), it.Payload.Value, "payload of the first enqueue")
	require.Equal(t, first.Identifier, it.Payload.Identifier)
	require.Equal(t, "acct_123|cus_1|api_calls", it.OrderingKey)
	require.Zero(t, it.Attempts)
	require.Nil(t, it.FirstAttemptAt)
	require.Zero(t, it.LeaseToken)
}

func TestEnqueueRollsBackWithCaller(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	_, err = b.store.Enqueue(b.ctx, tx, newItem(1))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(b.ctx))
	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, "SELECT count(*) FROM outbox_items").Scan(&n))
	require.Zero(t, n, "the enqueue lives and dies with the caller's transaction")
}

func TestEnqueueConcurrentSameIdentity(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	// Two transactions enqueue one identity; the second waits on the first's
	// uncommitted row and, after its commit, must get the existing id.
	tx1, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	r1, err := b.store.Enqueue(b.ctx, tx1, newItem(7))
	require.NoError(t, err)
	got := make(chan outbox.Enqueued, 1)
	errc := make(chan error, 1)
	go func() {
		tx2, err := b.pool.Begin(b.ctx)
		if err != nil {
			errc <- err
			return
		}
		defer func() { _ = tx2.Rollback(b.ctx) }()
		r2, err := b.store.Enqueue(b.ctx, tx2, newItem(7))
		if err != nil {
			errc <- err
			return
		}
		errc <- tx2.Commit(b.ctx)
		got <- r2
	}()
	// tx2 must be waiting on tx1's uncommitted row before tx1 commits.
	require.Eventually(t, func() bool {
		var waiting int
		err := b.pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO outbox_item_bodies%'`).Scan(&waiting)
		return err == nil && waiting == 1
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, tx1.Commit(b.ctx))
	require.NoError(t, <-errc)
	r2 := <-got
	require.False(t, r2.Inserted)
	require.Equal(t, r1.ID, r2.ID)
}

func TestEnqueueQuarantinedAndValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})

	q := newItem(1)
	q.Payload.Customer = ""
	q.Quarantine = outbox.ReasonNoCustomer
	ids := b.enqueue(t, q)
	it := b.get(t, ids[0])
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonNoCustomer, it.QuarantineReason)

	// A quarantined item is never claimed.
	require.Empty(t, b.claim(t, outbox.ClaimOptions{}))

	bad := []struct {
		name string
		edit func(*outbox.NewItem)
	}{
		{"no customer but eligible", func(it *outbox.NewItem) { it.Payload.Customer = "" }},
		{"no event name but eligible", func(it *outbox.NewItem) { it.Payload.EventName = "" }},
		{"no account but eligible", func(it *outbox.NewItem) { it.DestinationAccount = "" }},
		{"mapping version 0 but eligible", func(it *outbox.NewItem) { it.MappingVersion = 0 }},
		{"unknown reason", func(it *outbox.NewItem) { it.Quarantine = "because" }},
		{"separator in tenant", func(it *outbox.NewItem) { it.TenantKey = "a|b" }},
		{"bad mode", func(it *outbox.NewItem) { it.Mode = "sandbox" }},
		{"foreign identifier", func(it *outbox.NewItem) { it.Payload.Identifier = "tly_x" }},
		{"no period", func(it *outbox.NewItem) { it.Payload.Period = "" }},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			it := newItem(2)
			tc.edit(&it)
			tx, err := b.pool.Begin(b.ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(b.ctx) }()
			_, err = b.store.Enqueue(b.ctx, tx, it)
			require.Error(t, err)
		})
	}
}

func TestClaimLeasesDueItems(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1), newItem(2), newItem(3))

	leases := b.claim(t, outbox.ClaimOptions{Owner: "w1", Limit: 2})
	require.Len(t, leases, 2)
	for _, l := range leases {
		require.Equal(t, outbox.StateLeased, l.State)
		require.Equal(t, int64(1), l.LeaseToken)
		require.Equal(t, 1, l.Attempts)
		require.NotNil(t, l.FirstAttemptAt)
		require.NotNil(t, l.LeaseExpiresAt)
		require.Equal(t, "w1", l.LeaseOwner)
		require.WithinDuration(t, l.LeasedAt.Add(outbox.DefaultLease), *l.LeaseExpiresAt, time.Second)
	}
	// claim's stale path: nothing at all; somebody else has them.
	rest := b.claim(t, outbox.ClaimOptions{Owner: "w2", Limit: 10})
	require.Len(t, rest, 1)
	require.NotContains(t, []int64{leases[0].ID, leases[1].ID}, rest[0].ID)
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "w3", Limit: 10}))
	require.Len(t, ids, 3)

	// Not due yet: a retry scheduled in the future is not claimed.
	st, err := b.store.Retry(b.ctx, b.pool, rest[0], outbox.ErrorInfo{Code: "stripe_5xx", Status: 503}, false)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, st)
	require.Empty(t, b.claim(t, outbox.ClaimOptions{}))
}

func TestClaimOptionsValidated(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	for _, opts := range []outbox.ClaimOptions{
		{Owner: "", Limit: 1},
		{Owner: "w", Limit: 0},
		{Owner: "w", Limit: 1001},
		{Owner: "w", Limit: 1, Policy: outbox.Policy(9)},
		{Owner: "w", Limit: 1, Lease: -time.Second},
		{Owner: "w", Limit: 1, Lease: 5 * time.Hour},
	} {
		_, err := b.store.Claim(b.ctx, b.pool, opts)
		require.Error(t, err, "%+v", opts)
	}
}

func TestTransitionsOutOfLeased(t *testing.T) {
	t.Parallel()
	type check func(t *testing.T, b *testBundle, it outbox.Item)
	cases := []struct {
		name  outbox.Transition
		do    func(b *testBundle, l outbox.Lease) error
		state outbox.State
		check check
	}{
		{outbox.TransitionAccept, func(b *testBundle, l outbox.Lease) error {
			return b.store.Accept(b.ctx, b.pool, l, "req_123")
		}, outbox.StateAccepted, func(t *testing.T, b *testBundle, it outbox.Item) {
			require.Equal(t, "req_123", it.ProviderRef)
			require.NotNil(t, it.AcceptedAt)
			require.Nil(t, it.LeaseExpiresAt)
		}},
		{outbox.TransitionRetry, func(b *testBundle, l outbox.Lease) error {
			_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 502, Message: "bad gateway"}, false)
			return err
		}, outbox.StatePending, func(t *testing.T, b *testBundle, it outbox.Item) {
			require.Equal(t, &outbox.ErrorInfo{Code: "stripe_5xx", Status: 502, Message: "bad gateway"}, it.LastError)
			// backoff after attempt 1: 5s plus up to 1.25s of jitter, from
			// the database clock
			wait := it.NextAttemptAt.Sub(it.UpdatedAt)
			require.GreaterOrEqual(t, wait, 5*time.Second-10*time.Millisecond)
			require.LessOrEqual(t, wait, 6250*time.Millisecond+10*time.Millisecond)
			require.Equal(t, 0, it.RefusedAttempts)
		}},
		{outbox.TransitionRetry + " rate limited", func(b *testBundle, l outbox.Lease) error {
			_, err := b.store.RetryRateLimited(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "rate_limited", Status: 429})
			return err
		}, outbox.StatePending, func(t *testing.T, b *testBundle, it outbox.Item) {
			wait := it.NextAttemptAt.Sub(it.UpdatedAt)
			require.GreaterOrEqual(t, wait, 30*time.Second-10*time.Millisecond)
			require.LessOrEqual(t, wait, 37500*time.Millisecond+10*time.Millisecond)
			require.Equal(t, 1, it.RefusedAttempts, "a 429 is a refusal")
		}},
		{outbox.TransitionMarkUncertain, func(b *testBundle, l outbox.Lease) error {
			return b.store.MarkUncertain(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "timeout"}, false)
		}, outbox.StateUncertain, nil},
		{outbox.TransitionReject, func(b *testBundle, l outbox.Lease) error {
			return b.store.Reject(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "invalid_request", Status: 400, Message: "value must be an integer"})
		}, outbox.StateRejected, func(t *testing.T, b *testBundle, it outbox.Item) {
			require.Equal(t, 1, it.RefusedAttempts)
		}},
		{outbox.TransitionQuarantine, func(b *testBundle, l outbox.Lease) error {
			return b.store.Quarantine(b.ctx, b.pool, l, outbox.ReasonAccountMismatch, outbox.ErrorInfo{Code: "account_mismatch"})
		}, outbox.StateQuarantined, func(t *testing.T, b *testBundle, it outbox.Item) {
			require.Equal(t, outbox.ReasonAccountMismatch, it.QuarantineReason)
		}},
	}
	for _, tc := range cases {
		t.Run(string(tc.name), func(t *testing.T) {
			t.Parallel()
			b := setup(t, outbox.Config{})
			ids := b.enqueue(t, newItem(1))
			l := b.claimOne(t)
			require.NoError(t, tc.do(b, l))
			it := b.get(t, ids[0])
			require.Equal(t, tc.state, it.State)
			require.Nil(t, it.LeaseExpiresAt)
			if tc.check != nil {
				tc.check(t, b, it)
			}
			attempts, err := b.store.Attempts(b.ctx, b.pool, ids[0])
			require.NoError(t, err)
			require.Len(t, attempts, 1)
			require.Equal(t, int64(1), attempts[0].LeaseToken)
			require.Equal(t, tc.state, attempts[0].StateAfter)

			// The stale path: the same lease writes again, zero rows.
			require.ErrorIs(t, tc.do(b, l), outbox.ErrStaleLease)
			require.Equal(t, tc.state, b.get(t, ids[0]).State, "a stale write changes nothing")
			transition, _, _ := strings.Cut(string(tc.name), " ")
			require.Equal(t, 1.0, b.stale(outbox.Transition(transition)))
		})
	}
}

func TestLeaseExpiryFencesOldOwner(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1))

	old := b.claim(t, outbox.ClaimOptions{Owner: "dies", Limit: 1, Lease: 500 * time.Millisecond})
	require.Len(t, old, 1)
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "new"}), "the lease is live")
	time.Sleep(600 * time.Millisecond)

	cur := b.claim(t, outbox.ClaimOptions{Owner: "new", Limit: 1})
	require.Len(t, cur, 1)
	require.Equal(t, old[0].LeaseToken+1, cur[0].LeaseToken)
	require.Equal(t, 2, cur[0].Attempts, "the dead worker's claim consumed an attempt")
	require.Equal(t, *old[0].FirstAttemptAt, *cur[0].FirstAttemptAt, "first_attempt_at never moves")

	// The old owner wakes up and answers: fenced, whatever it says.
	for _, o := range []outbox.Outcome{
		{Lease: old[0], Kind: outbox.Accepted, ProviderRef: "req_old"},
		{Lease: old[0], Kind: outbox.Rejected},
		{Lease: old[0], Kind: outbox.Retry},
	} {
		res, err := b.store.Record(b.ctx, b.pool, []outbox.Outcome{o})
		require.NoError(t, err)
		require.ErrorIs(t, res[0].Err, outbox.ErrStaleLease)
	}
	require.Equal(t, 1.0, b.stale(outbox.TransitionAccept))
	require.NoError(t, b.store.Accept(b.ctx, b.pool, cur[0], "req_new"))
	it := b.get(t, ids[0])
	require.Equal(t, outbox.StateAccepted, it.State)
	require.Equal(t, "req_new", it.ProviderRef)

	attempts, err := b.store.Attempts(b.ctx, b.pool, ids[0])
	require.NoError(t, err)
	require.Len(t, attempts, 2)
	require.Equal(t, "abandoned", attempts[0].Outcome)
	require.Equal(t, "dies", attempts[0].LeaseOwner)
	require.Equal(t, "accepted", attempts[1].Outcome)
	require.Equal(t, "new", attempts[1].LeaseOwner)
}

func TestFirstAttemptAtNeverMoves(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	ids := b.enqueue(t, newItem(1))
	var first time.Time
	for i := 1; i <= 5; i++ {
		l := b.claimOne(t)
		require.Equal(t, i, l.Attempts)
		if i == 1 {
			first = *l.FirstAttemptAt
		}
		require.Equal(t, first, *l.FirstAttemptAt)
		st, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "timeout"}, false)
		require.NoError(t, err)
		require.Equal(t, outbox.StatePending, st)
		time.Sleep(5 * time.Millisecond)
	}
	require.Equal(t, first, *b.get(t, ids[0]).FirstAttemptAt)

	// The database refuses to move it, too.
	_, err := b.pool.Exec(b.ctx, "UPDATE outbox_item_states SET first_attempt_at = now() + interval '1 hour' WHERE id = $1", ids[0])
	require.ErrorContains(t, err, "first_attempt_at never moves")
}

func TestAttemptCapEndsUncertainNeverRejected(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{MaxAttempts: 3, BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	ids := b.enqueue(t, newItem(1))
	var states []outbox.State
	for i := 0; i < 3; i++ {
		l := b.claimOne(t)
		st, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}, false)
		require.NoError(t, err)
		states = append(states, st)
		time.Sleep(5 * time.Millisecond)
	}
	require.Equal(t, []outbox.State{outbox.StatePending, outbox.StatePending, outbox.StateUncertain}, states)
	it := b.get(t, ids[0])
	require.Equal(t, outbox.StateUncertain, it.State)
	require.Equal(t, 3, it.Attempts)
	require.Empty(t, b.claim(t, outbox.ClaimOptions{}))

	// Refusals count against the cap too, and still end uncertain.
	ids = b.enqueue(t, newItem(2))
	for i := 0; i < 3; i++ {
		l := b.claimOne(t)
		st, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_auth", Status: 401}, true)
		require.NoError(t, err)
		if i == 2 {
			require.Equal(t, outbox.StateUncertain, st)
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.Equal(t, outbox.StateUncertain, b.get(t, ids[0]).State)
}

func TestCrashLoopCannotRetryForever(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{MaxAttempts: 2})
	ids := b.enqueue(t, newItem(1))
	for i := 1; i <= 2; i++ {
		leases := b.claim(t, outbox.ClaimOptions{Limit: 1, Lease: 50 * time.Millisecond})
		require.Len(t, leases, 1)
		require.Equal(t, i, leases[0].Attempts)
		time.Sleep(80 * time.Millisecond) // the worker dies; the lease expires
	}
	require.Empty(t, b.claim(t, outbox.ClaimOptions{}), "the cap is spent: no third claim")
	swept, err := b.store.Sweep(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, ids, swept)
	it := b.get(t, ids[0])
	require.Equal(t, outbox.StateUncertain, it.State)
	require.Equal(t, "attempt_cap", it.LastError.Code)
	attempts, err := b.store.Attempts(b.ctx, b.pool, ids[0])
	require.NoError(t, err)
	require.Len(t, attempts, 2)
	for _, a := range attempts {
		require.Equal(t, "abandoned", a.Outcome)
	}
}

func TestHorizonEndsUncertainByDatabaseClock(t *testing.T) {
	t.Parallel()
	const horizon = 400 * time.Millisecond
	b := setup(t, outbox.Config{Horizon: horizon, Lease: 100 * time.Millisecond,
		BackoffBase: 10 * time.Millisecond, BackoffCap: 10 * time.Millisecond})

	ids := b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	st, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, st, "inside the horizon")

	// The deliverers stall past the horizon. The timed-out attempt may have
	// landed, and the provider's dedup window runs out after the horizon: no
	// claim takes the item again, and the sweep makes it uncertain.
	time.Sleep(horizon + 50*time.Millisecond)
	fresh := b.enqueue(t, newItem(2))
	leases := b.claim(t, outbox.ClaimOptions{Limit: 10, Lease: 300 * time.Millisecond})
	require.Len(t, leases, 1)
	require.Equal(t, fresh[0], leases[0].ID, "an item never sent has no horizon yet")
	for _, l := range b.claim(t, outbox.ClaimOptions{Limit: 10, Policy: outbox.BestEffort}) {
		require.NotEqual(t, ids[0], l.ID, "past the horizon, never sent again")
	}

	swept, err := b.store.Sweep(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, ids, swept)
	it := b.get(t, ids[0])
	require.Equal(t, outbox.StateUncertain, it.State)
	require.Equal(t, "horizon", it.LastError.Code)
	// The same lease, expired past the horizon, is swept and its attempt
	// recorded as abandoned.
	time.Sleep(horizon + 50*time.Millisecond)
	swept, err = b.store.Sweep(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, fresh, swept)
	attempts, err := b.store.Attempts(b.ctx, b.pool, fresh[0])
	require.NoError(t, err)
	require.Len(t, attempts, 1)
	require.Equal(t, "abandoned", attempts[0].Outcome)
	require.Equal(t, outbox.StateUncertain, attempts[0].StateAfter)
}

func TestRetryPastHorizonBecomesUncertain(t *testing.T) {
	t.Parallel()
	// The backoff (5s) reaches past a 1s horizon: the retry becomes uncertain.
	b := setup(t, outbox.Config{Horizon: time.Second, Lease: 100 * time.Millisecond})
	ids := b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	st, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 503}, false)
	require.NoError(t, err)
	require.Equal(t, outbox.StateUncertain, st)
	require.Equal(t, outbox.StateUncertain, b.get(t, ids[0]).State)

	// A refusal of an item some earlier attempt of which may have reached
	// the provider is uncertain past the horizon too: that attempt may
	// have been recorded.
	ids = b.enqueue(t, newItem(2))
	l = b.claimOne(t)
	require.Equal(t, ids[0], l.ID)
	_, err = b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}, false)
	require.NoError(t, err)
	require.Equal(t, outbox.StateUncertain, b.get(t, ids[0]).State)

	// Only when every attempt was refused, this one included, does a retry
	// past the horizon stay pending (docs/outbox.md, "Where Tally
	// differs"): nothing of it can have been recorded, and the claim takes
	// it again; only the attempt cap ends it.
	ids = b.enqueue(t, newItem(3))
	l = b.claimOne(t)
	require.Equal(t, ids[0], l.ID)
	st, err = b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "lock_timeout", Status: 429}, true)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, st)
	it := b.get(t, ids[0])
	require.Equal(t, it.Attempts, it.RefusedAttempts)
}

// An item every attempt of which was refused is never made uncertain by the
// horizon — not by a retry, the claim or the sweep — only by the attempt
// cap.
func TestRefusedAttemptsOutliveTheHorizonUntilTheCap(t *testing.T) {
	t.Parallel()
	const horizon = 300 * time.Millisecond
	b := setup(t, outbox.Config{Horizon: horizon, Lease: 100 * time.Millisecond, MaxAttempts: 3,
		BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	ids := b.enqueue(t, newItem(1))
	for attempt := 1; attempt <= 3; attempt++ {
		var l outbox.Lease
		require.Eventually(t, func() bool {
			got := b.claim(t, outbox.ClaimOptions{})
			if len(got) == 0 {
				return false
			}
			l = got[0]
			return true
		}, 5*time.Second, 5*time.Millisecond, "attempt %d is claimed past the horizon", attempt)
		require.Equal(t, ids[0], l.ID)
		st, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "lock_timeout", Status: 429}, true)
		require.NoError(t, err)
		if attempt == 1 {
			time.Sleep(horizon + 50*time.Millisecond)
		}
		if attempt < 3 {
			require.Equal(t, outbox.StatePending, st, "attempt %d", attempt)
			res, err := b.store.Maintain(b.ctx, b.pool)
			require.NoError(t, err)
			require.Empty(t, res.Swept, "the sweep leaves a refused item alone past the horizon")
			continue
		}
		require.Equal(t, outbox.StateUncertain, st, "the attempt cap ends it")
	}
	it := b.get(t, ids[0])
	require.Equal(t, 3, it.RefusedAttempts, "still provably unrecorded: recovery to pending needs no evidence")
}

func TestNothingAutomaticLeavesRejected(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{MaxAttempts: 1, Horizon: 200 * time.Millisecond, Lease: 50 * time.Millisecond})
	ids := b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	require.NoError(t, b.store.Reject(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "invalid_request", Status: 400}))
	time.Sleep(250 * time.Millisecond) // past lease and horizon

	require.Empty(t, b.claim(t, outbox.ClaimOptions{}))
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Policy: outbox.BestEffort}))
	res, err := b.store.Maintain(b.ctx, b.pool)
	require.NoError(t, err)
	require.Empty(t, res.Swept)
	_, refused, err := b.store.Confirm(b.ctx, b.pool, ids)
	require.NoError(t, err)
	require.ErrorIs(t, refused[ids[0]], outbox.ErrStateMismatch)
	require.ErrorIs(t, b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{To: outbox.StatePending, ExpectLeaseToken: 1}), outbox.ErrStateMismatch)
	require.ErrorIs(t, b.store.Requeue(b.ctx, b.pool, ids[0], 1), outbox.ErrStateMismatch)
	for _, o := range []outbox.OutcomeKind{outbox.Accepted, outbox.Retry, outbox.Uncertain} {
		r, err := b.store.Record(b.ctx, b.pool, []outbox.Outcome{{Lease: l, Kind: o}})
		require.NoError(t, err)
		require.ErrorIs(t, r[0].Err, outbox.ErrStaleLease)
	}
	require.Equal(t, outbox.StateRejected, b.get(t, ids[0]).State)

	// Not even SQL at a prompt gets it out: the guard refuses the edge.
	_, err = b.pool.Exec(b.ctx, "UPDATE outbox_item_states SET state = 'pending' WHERE id = $1", ids[0])
	require.ErrorContains(t, err, "not an edge of the state machine")
}

func TestConfirm(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1), newItem(2), newItem(3))
	leases := b.claim(t, outbox.ClaimOptions{Limit: 3})
	require.NoError(t, b.store.Accept(b.ctx, b.pool, leases[0], "req_1"))
	require.NoError(t, b.store.Accept(b.ctx, b.pool, leases[1], "req_2"))

	confirmed, refused, err := b.store.Confirm(b.ctx, b.pool, []int64{leases[0].ID, leases[1].ID, leases[2].ID, 999999})
	require.NoError(t, err)
	require.ElementsMatch(t, []int64{leases[0].ID, leases[1].ID}, confirmed)
	var se *outbox.StateError
	require.ErrorAs(t, refused[leases[2].ID], &se)
	require.Equal(t, outbox.StateLeased, se.Current)
	require.ErrorIs(t, refused[999999], outbox.ErrNotFound)
	require.Equal(t, 2.0, b.stale(outbox.TransitionConfirm))
	it := b.get(t, leases[0].ID)
	require.Equal(t, outbox.StateConfirmed, it.State)
	require.NotNil(t, it.ConfirmedAt)

	// The stale path: confirming twice reports the current state.
	_, refused, err = b.store.Confirm(b.ctx, b.pool, []int64{leases[0].ID})
	require.NoError(t, err)
	require.ErrorAs(t, refused[leases[0].ID], &se)
	require.Equal(t, outbox.StateConfirmed, se.Current)
	require.Len(t, ids, 3)
}

func TestRecover(t *testing.T) {
	t.Parallel()
	for _, to := range []outbox.State{outbox.StateAccepted, outbox.StatePending, outbox.StateRejected} {
		t.Run(string(to), func(t *testing.T) {
			t.Parallel()
			b := setup(t, outbox.Config{MaxAttempts: 1, Horizon: 300 * time.Millisecond, Lease: 100 * time.Millisecond})
			ids := b.enqueue(t, newItem(1))
			l := b.claimOne(t)
			require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "timeout"}, false))
			time.Sleep(350 * time.Millisecond) // past the horizon and the cap

			// The stale path: a token the operator did not review.
			err := b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{To: to, ExpectLeaseToken: 7})
			var se *outbox.StateError
			require.ErrorAs(t, err, &se)
			require.Equal(t, outbox.StateUncertain, se.Current)
			require.Equal(t, int64(1), se.CurrentLeaseToken)
			require.Equal(t, 1.0, b.stale(outbox.TransitionRecover))

			if to == outbox.StatePending {
				// The timed-out attempt may have landed and the horizon has
				// passed: without evidence, no resend.
				err := b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{To: to, ExpectLeaseToken: l.LeaseToken})
				require.ErrorIs(t, err, outbox.ErrPastHorizon)
				require.Error(t, b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{To: to, ExpectLeaseToken: l.LeaseToken, NotReached: true}),
					"a not-reached finding needs a reason")
				require.Equal(t, outbox.StateUncertain, b.get(t, ids[0]).State)
			}
			require.NoError(t, b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{
				To: to, ExpectLeaseToken: l.LeaseToken, ProviderRef: "evidence", Reason: "checked with finance sk_live_abcdef",
				NotReached: to == outbox.StatePending,
			}))
			it := b.get(t, ids[0])
			require.Equal(t, to, it.State)
			switch to {
			case outbox.StateAccepted:
				require.Equal(t, "evidence", it.ProviderRef)
				require.NotNil(t, it.AcceptedAt)
			case outbox.StateRejected:
				require.Equal(t, "operator_rejected", it.LastError.Code)
				require.NotContains(t, it.LastError.Message, "sk_live", "secrets never reach the row")
				require.Contains(t, it.LastError.Message, "checked with finance")
			case outbox.StatePending:
				// Past the horizon and at the cap, the operator's finding that
				// nothing reached Stripe yields one more attempt with the same
				// identifier.
				require.Equal(t, "operator_not_reached", it.LastError.Code)
				l2 := b.claimOne(t)
				require.Equal(t, ids[0], l2.ID)
				require.Equal(t, 2, l2.Attempts)
				require.Equal(t, l.Identifier, l2.Identifier)
				// An ambiguous answer past the horizon is uncertain again.
				st, err := b.store.Retry(b.ctx, b.pool, l2, outbox.ErrorInfo{Code: "timeout"}, false)
				require.NoError(t, err)
				require.Equal(t, outbox.StateUncertain, st)
			}
			// Once recovered, a second recovery finds it moved.
			if to != outbox.StatePending {
				require.ErrorIs(t, b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{To: to, ExpectLeaseToken: l.LeaseToken}), outbox.ErrStateMismatch)
			}
		})
	}
}

func TestRecoverRefusesOtherTargets(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	for _, to := range []outbox.State{outbox.StateConfirmed, outbox.StateLeased, outbox.StateQuarantined, ""} {
		require.Error(t, b.store.Recover(b.ctx, b.pool, 1, outbox.Recovery{To: to}))
	}
}

func TestRequeue(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{Horizon: 300 * time.Millisecond, Lease: 100 * time.Millisecond})

	// Quarantined at claim time (quarantine): never sent, so requeueing it
	// after the horizon is safe and it goes out again with the same
	// identifier.
	ids := b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	require.NoError(t, b.store.Quarantine(b.ctx, b.pool, l, outbox.ReasonMeterNotFound, outbox.ErrorInfo{Code: "meter_not_found", Status: 400}))
	time.Sleep(350 * time.Millisecond)

	require.ErrorIs(t, b.store.Requeue(b.ctx, b.pool, ids[0], 2), outbox.ErrMappingChanged)
	require.ErrorIs(t, b.store.Requeue(b.ctx, b.pool, 424242, 1), outbox.ErrNotFound)
	require.Equal(t, 2.0, b.stale(outbox.TransitionRequeue))
	require.NoError(t, b.store.Requeue(b.ctx, b.pool, ids[0], 1))
	it := b.get(t, ids[0])
	require.Equal(t, outbox.StatePending, it.State)
	require.Empty(t, it.QuarantineReason)
	var se *outbox.StateError
	require.ErrorAs(t, b.store.Requeue(b.ctx, b.pool, ids[0], 1), &se)
	require.Equal(t, outbox.StatePending, se.Current)

	l2 := b.claimOne(t)
	require.Equal(t, ids[0], l2.ID)
	require.Equal(t, l.Identifier, l2.Identifier)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l2, "req_ok"))

	// An item staged without what a send needs cannot go back as it is.
	for _, edit := range []func(*outbox.NewItem){
		func(it *outbox.NewItem) { it.Payload.Customer, it.Quarantine = "", outbox.ReasonNoCustomer },
		func(it *outbox.NewItem) {
			it.Payload.EventName, it.MappingVersion, it.Quarantine = "", 0, outbox.ReasonFeatureUnmapped
		},
		func(it *outbox.NewItem) { it.DestinationAccount, it.Quarantine = "", outbox.ReasonNoAccount },
	} {
		it := newItem(50 + len(ids))
		edit(&it)
		q := b.enqueue(t, it)
		require.ErrorIs(t, b.store.Requeue(b.ctx, b.pool, q[0], it.MappingVersion), outbox.ErrNotSendable)
		require.Equal(t, outbox.StateQuarantined, b.get(t, q[0]).State)
		ids = append(ids, q[0])
	}
}

func TestSupersede(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})

	unmapped := newItem(1)
	unmapped.MappingVersion = 0
	unmapped.Payload.EventName = ""
	unmapped.Quarantine = outbox.ReasonFeatureUnmapped
	ids := b.enqueue(t, unmapped)

	fixed := newItem(1)
	fixed.MappingVersion = 3

	supersede := func(id int64, version int, succ outbox.NewItem) (outbox.Enqueued, error) {
		tx, err := b.pool.Begin(b.ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(b.ctx) }()
		res, err := b.store.Supersede(b.ctx, tx, id, version, succ)
		if err != nil {
			return res, err
		}
		return res, tx.Commit(b.ctx)
	}

	// Wrong expectations are refused and leave nothing behind.
	_, err := supersede(ids[0], 1, fixed)
	require.ErrorIs(t, err, outbox.ErrMappingChanged)
	other := fixed
	other.SubjectRef = "usage:other"
	_, err = supersede(ids[0], 0, other)
	require.Error(t, err)
	_, err = supersede(ids[0], 0, unmapped)
	require.Error(t, err, "the same identity is a requeue, not a re-address")

	succ, err := supersede(ids[0], 0, fixed)
	require.NoError(t, err)
	require.True(t, succ.Inserted)
	require.Equal(t, outbox.StatePending, succ.State)
	old := b.get(t, ids[0])
	require.Equal(t, outbox.StateSuperseded, old.State)
	require.Equal(t, succ.ID, *old.SupersededBy)
	require.Equal(t, outbox.ReasonFeatureUnmapped, old.QuarantineReason, "the old reason stays for the record")
	require.NotEqual(t, old.Identifier, succ.Identifier)

	// Twice: the old item is no longer quarantined.
	_, err = supersede(ids[0], 0, fixed)
	require.Error(t, err)

	// An item one attempt of which may have reached the provider keeps its
	// identifier for good: a 5xx, then a claim-time quarantine.
	l := b.claimOne(t)
	require.Equal(t, succ.ID, l.ID)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req"))
	ids = b.enqueue(t, newItem(2))
	l = b.claimOne(t)
	_, err = b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}, false)
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond)
	l = b.claimOne(t)
	require.NoError(t, b.store.Quarantine(b.ctx, b.pool, l, outbox.ReasonAccountMismatch, outbox.ErrorInfo{Code: "account_mismatch"}))
	moved := newItem(2)
	moved.DestinationAccount = "acct_other"
	_, err = supersede(ids[0], 1, moved)
	require.ErrorIs(t, err, outbox.ErrMayHaveReached)
	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, "SELECT count(*) FROM outbox_items WHERE destination_account = 'acct_other'").Scan(&n))
	require.Zero(t, n, "the successor's insert rolled back with the refusal")
	require.Equal(t, outbox.StateQuarantined, b.get(t, ids[0]).State)
}

func TestRecordInputErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	_, err := b.store.Record(b.ctx, b.pool, []outbox.Outcome{{Lease: l, Kind: outbox.Accepted}, {Lease: l, Kind: outbox.Retry}})
	require.ErrorContains(t, err, "twice")
	_, err = b.store.Record(b.ctx, b.pool, []outbox.Outcome{{Lease: l, Kind: outbox.Quarantined}})
	require.ErrorContains(t, err, "reason")
	_, err = b.store.Record(b.ctx, b.pool, []outbox.Outcome{{Lease: l, Kind: 0}})
	require.Error(t, err)
	require.Equal(t, outbox.StateLeased, b.get(t, l.ID).State)
}

func TestRecordMixedBatch(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	for i := 0; i < 6; i++ {
		b.enqueue(t, newItem(i))
	}
	leases := b.claim(t, outbox.ClaimOptions{Limit: 6})
	require.Len(t, leases, 6)
	stale := leases[5]
	stale.LeaseToken = 99
	res, err := b.store.Record(b.ctx, b.pool, []outbox.Outcome{
		{Lease: leases[0], Kind: outbox.Accepted, ProviderRef: "req_a"},
		{Lease: leases[1], Kind: outbox.Retry, Error: outbox.ErrorInfo{Code: "timeout"}},
		{Lease: leases[2], Kind: outbox.Uncertain},
		{Lease: leases[3], Kind: outbox.Rejected},
		{Lease: leases[4], Kind: outbox.Quarantined, Reason: outbox.ReasonCustomerNotFound},
		{Lease: stale, Kind: outbox.Accepted},
	})
	require.NoError(t, err)
	want := []outbox.State{outbox.StateAccepted, outbox.StatePending, outbox.StateUncertain,
		outbox.StateRejected, outbox.StateQuarantined}
	for i, w := range want {
		require.NoError(t, res[i].Err)
		require.Equal(t, w, res[i].State)
		require.Equal(t, w, b.get(t, leases[i].ID).State)
	}
	require.ErrorIs(t, res[5].Err, outbox.ErrStaleLease)
	require.Equal(t, outbox.StateLeased, b.get(t, leases[5].ID).State)
}

func TestDatabaseGuards(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1))
	cases := []struct{ sql, want string }{
		{"DELETE FROM outbox_item_states WHERE id = $1", "never deleted"},
		{"DELETE FROM outbox_item_bodies WHERE id = $1", "never deleted"},
		{"UPDATE outbox_item_bodies SET payload = payload || '{\"value\": 5}' WHERE id = $1", "immutable"},
		{"UPDATE outbox_item_bodies SET mapping_version = 2 WHERE id = $1", "immutable"},
		{"UPDATE outbox_item_bodies SET tenant_key = tenant_key WHERE id = $1", "immutable"},
		{"UPDATE outbox_item_states SET ordering_key = 'acct|cus|other' WHERE id = $1", "immutable"},
		{"UPDATE outbox_item_states SET exporter = 'other' WHERE id = $1", "immutable"},
		{"UPDATE outbox_item_states SET created_at = now() - interval '1 day' WHERE id = $1", "immutable"},
		{"UPDATE outbox_item_states SET state = 'accepted', accepted_at = now() WHERE id = $1", "not an edge"},
		{"UPDATE outbox_item_states SET state = 'bogus' WHERE id = $1", "not an edge"},
		{"UPDATE outbox_items SET state = 'leased' WHERE id = $1", "cannot update view"},
	}
	for _, tc := range cases {
		_, err := b.pool.Exec(b.ctx, tc.sql, ids[0])
		require.ErrorContains(t, err, tc.want, tc.sql)
	}
	for _, table := range []string{"outbox_item_states", "outbox_item_bodies"} {
		_, err := b.pool.Exec(b.ctx, "TRUNCATE "+table+" CASCADE")
		require.ErrorContains(t, err, "never deleted", table)
	}

	l := b.claimOne(t)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req"))
	_, err := b.pool.Exec(b.ctx, "DELETE FROM outbox_attempts")
	require.ErrorContains(t, err, "append-only")
	_, err = b.pool.Exec(b.ctx, "UPDATE outbox_attempts SET outcome = 'rejected'")
	require.ErrorContains(t, err, "append-only")

	// The identifier column is the same pure function of the identity.
	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, "SELECT count(*) FROM outbox_items WHERE identifier = $1", l.Identity.Identifier()).Scan(&n))
	require.Equal(t, 1, n)
}

func TestGauge(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	q := newItem(9)
	q.Quarantine = outbox.ReasonTimestampWindow
	b.enqueue(t, newItem(1), newItem(2), newItem(3), q)
	l := b.claim(t, outbox.ClaimOptions{Limit: 1})[0]
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "r"))
	b.claim(t, outbox.ClaimOptions{Limit: 1})
	time.Sleep(20 * time.Millisecond)

	g, err := b.store.ReadGauge(b.ctx, b.pool)
	require.NoError(t, err)
	require.Len(t, g.Counts, len(outbox.States))
	require.Equal(t, map[outbox.State]int64{
		outbox.StatePending: 1, outbox.StateLeased: 1, outbox.StateAccepted: 1, outbox.StateConfirmed: 0,
		outbox.StateUncertain: 0, outbox.StateRejected: 0, outbox.StateQuarantined: 1, outbox.StateSuperseded: 0, outbox.StateWithdrawn: 0,
	}, g.Counts)
	require.Greater(t, g.OldestPendingAgeSeconds, 0.01)
	require.Less(t, g.OldestPendingAgeSeconds, 60.0)

	require.NoError(t, testutil.GatherAndCompare(b.reg, stringsReader(`
# HELP tally_outbox_items Outbox items by state, sampled by the maintenance pass.
# TYPE tally_outbox_items gauge
tally_outbox_items{state="accepted"} 1
tally_outbox_items{state="confirmed"} 0
tally_outbox_items{state="leased"} 1
tally_outbox_items{state="pending"} 1
tally_outbox_items{state="quarantined"} 1
tally_outbox_items{state="rejected"} 0
tally_outbox_items{state="superseded"} 0
tally_outbox_items{state="uncertain"} 0
tally_outbox_items{state="withdrawn"} 0
`), "tally_outbox_items"))

	empty := setup(t, outbox.Config{})
	g, err = empty.store.ReadGauge(empty.ctx, empty.pool)
	require.NoError(t, err)
	require.Zero(t, g.OldestPendingAgeSeconds)
}

func TestConfigValidated(t *testing.T) {
	t.Parallel()
	require.NoError(t, outbox.Config{}.Validate())
	bad := []outbox.Config{
		{Lease: -time.Second},
		{BackoffBase: time.Minute, BackoffCap: time.Second},
		{MaxAttempts: -1},
		{Horizon: 25 * time.Hour},
		{Horizon: time.Second, Lease: 2 * time.Second},
		{Horizon: 23*time.Hour + 59*time.Minute, Lease: 10 * time.Minute},
		{RateLimitDelay: -1},
		{ClaimScan: -1},
	}
	for _, c := range bad {
		require.Error(t, c.Validate(), "%+v", c)
		_, err := outbox.New(c, nil)
		require.Error(t, err)
	}
}

// An error of an earlier attempt is not the item's once the provider
// accepted it: CurrentError shows it while the item is pending, and no
// longer once accepted or confirmed; LastError and the attempt log keep it.
func TestCurrentErrorEndsWithTheAcceptance(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	failure := outbox.ErrorInfo{Code: "stripe_5xx", Status: 502, Message: "bad gateway"}
	require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, l, failure, false))
	it := b.get(t, ids[0])
	require.Equal(t, &failure, it.CurrentError(), "uncertain: the error is why")

	require.NoError(t, b.store.Recover(b.ctx, b.pool, ids[0], outbox.Recovery{To: outbox.StatePending, ExpectLeaseToken: l.LeaseToken, NotReached: true, Reason: "checked: never reached"}))
	it = b.get(t, ids[0])
	require.NotNil(t, it.CurrentError(), "pending again: the last error still says what happened")

	l = b.claimOne(t)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req_1"))
	it = b.get(t, ids[0])
	require.Nil(t, it.CurrentError(), "accepted: an earlier attempt's error is stale")
	require.NotNil(t, it.LastError, "kept in the row")
	attempts, err := b.store.Attempts(b.ctx, b.pool, ids[0])
	require.NoError(t, err)
	require.Len(t, attempts, 2)
	require.NotNil(t, attempts[0].Error, "and in the attempt log")

	confirmed, _, err := b.store.Confirm(b.ctx, b.pool, []int64{ids[0]})
	require.NoError(t, err)
	require.Equal(t, []int64{ids[0]}, confirmed)
	require.Nil(t, b.get(t, ids[0]).CurrentError(), "confirmed: stale too")
}
