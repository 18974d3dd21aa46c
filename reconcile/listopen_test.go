package reconcile_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// The open discrepancies of every run come newest first, a page at a
// time keyed by id; a resolved one is left out; a kind and a tenant keep
// their own, an unknown kind is refused; and a page walks the index of
// the current discrepancies, not the table.
func TestListOpenPagesNewestFirstByTenant(t *testing.T) {
	t.Parallel()
	r, _, ds, _ := droppedRun(t)

	page, err := reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{Tenant: "nobody"})
	require.NoError(t, err)
	require.Empty(t, page.Discrepancies, "an unknown tenant has none")
	require.Zero(t, page.Next)

	var ids []int64
	for before := int64(0); ; {
		page, err := reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{Before: before, Limit: 3})
		require.NoError(t, err)
		for _, d := range page.Discrepancies {
			require.True(t, d.Open())
			ids = append(ids, d.ID)
		}
		if page.Next == 0 {
			break
		}
		require.Len(t, page.Discrepancies, 3, "a page that says more may follow is full")
		before = page.Next
	}
	require.Len(t, ids, len(ds))
	for i := 1; i < len(ids); i++ {
		require.Greater(t, ids[i-1], ids[i], "newest first, each once")
	}

	_, err = reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, ids[0], reconcile.Decision{Reason: reconcile.ResolvedAcceptStripe,
		Note: "agreed", By: "test"})
	require.NoError(t, err)
	page, err = reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{})
	require.NoError(t, err)
	require.Len(t, page.Discrepancies, len(ds)-1)
	require.Equal(t, ids[1], page.Discrepancies[0].ID, "the resolved one is no longer open")

	_, err = reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{Kind: "stripe_has_most"})
	require.ErrorIs(t, err, reconcile.ErrUnknownKind)
	page, err = reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{Kind: reconcile.KindStripeHasLess})
	require.NoError(t, err)
	require.Len(t, page.Discrepancies, len(ds)-1, "every drop is Stripe having less")
	page, err = reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{Kind: reconcile.KindStripeHasMore})
	require.NoError(t, err)
	require.Empty(t, page.Discrepancies)

	page, err = reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{})
	require.NoError(t, err)
	tenant := page.Discrepancies[0].Tenants[0]
	page, err = reconcile.ListOpen(r.Ctx, r.Pool, reconcile.OpenQuery{Tenant: tenant})
	require.NoError(t, err)
	require.NotEmpty(t, page.Discrepancies)
	for _, d := range page.Discrepancies {
		require.Contains(t, d.Tenants, tenant)
	}

	// The plan with sequential scans priced out: the page reads the
	// partial index by id, whatever the table's size makes cheapest here.
	var plan string
	require.NoError(t, pgx.BeginFunc(r.Ctx, r.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(r.Ctx, `SET LOCAL enable_seqscan = off`); err != nil {
			return err
		}
		rows, err := tx.Query(r.Ctx, `EXPLAIN (FORMAT TEXT) SELECT id FROM reconcile_discrepancies d
			WHERE cleared_by_run IS NULL AND id < 1000 ORDER BY id DESC LIMIT 51`)
		if err != nil {
			return err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		plan = strings.Join(lines, "\n")
		return err
	}))
	require.Contains(t, plan, "reconcile_discrepancies_current_id")
}

// uncertainEnv stages n items and records every attempt uncertain.
func uncertainEnv(t *testing.T, n int) (*stagetest.Env, []outbox.Lease) {
	t.Helper()
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	env.Tenant(t, "beta", nil)
	for i := 0; i < n; i++ {
		env.MustIngest(t, stagetest.Ev(string(rune('a'+i)), "beta", "api", int64(i+1), stagetest.Ago(time.Duration(3+i)*time.Hour)))
	}
	env.Pass(t)
	leases, err := env.Outbox.Claim(env.Ctx, env.Pool, outbox.ClaimOptions{Owner: "test", Limit: n, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, n)
	outcomes := make([]outbox.Outcome, n)
	for i, l := range leases {
		outcomes[i] = outbox.Outcome{Lease: l, Kind: outbox.Uncertain, Error: outbox.ErrorInfo{Code: "timeout"}}
	}
	_, err = env.Outbox.Record(env.Ctx, env.Pool, outcomes)
	require.NoError(t, err)
	return env, leases
}

// A bulk recovery is one transaction: with no outcome, no item, or one
// item that moved since its review, nothing moves and nothing is audited;
// else every item moves, each audited as a single recovery is.
func TestRecoverAllIsAllOrNothing(t *testing.T) {
	t.Parallel()
	env, leases := uncertainEnv(t, 3)
	reviewed := make([]reconcile.Reviewed, len(leases))
	for i, l := range leases {
		reviewed[i] = reconcile.Reviewed{Item: l.ID, LeaseToken: l.LeaseToken}
	}
	stale := append([]reconcile.Reviewed(nil), reviewed...)
	stale[2].LeaseToken--
	audited := func() int {
		var n int
		require.NoError(t, env.Pool.QueryRow(env.Ctx, `SELECT count(*) FROM audit_log WHERE action = 'recover'`).Scan(&n))
		return n
	}
	for _, c := range []struct {
		name  string
		items []reconcile.Reviewed
		r     reconcile.Recovery
	}{
		{"no outcome", reviewed, reconcile.Recovery{Expect: outbox.StateUncertain, Reason: "r", By: "test"}},
		{"no item", nil, reconcile.Recovery{Expect: outbox.StateUncertain, To: outbox.StateAccepted, By: "test"}},
		{"rejected without a reason", reviewed, reconcile.Recovery{Expect: outbox.StateUncertain, To: outbox.StateRejected, By: "test"}},
		{"an item moved", stale, reconcile.Recovery{Expect: outbox.StateUncertain, To: outbox.StateAccepted, By: "test"}},
	} {
		err := reconcile.RecoverAll(env.Ctx, env.Pool, env.Outbox, c.items, c.r)
		require.Error(t, err, c.name)
		var se *reconcile.ExpectedStateError
		if errors.As(err, &se) {
			require.Equal(t, "an item moved", c.name)
			require.Equal(t, leases[2].ID, se.ID)
			require.True(t, se.Moved)
		} else {
			require.ErrorIs(t, err, reconcile.ErrInvalidRecovery, c.name)
		}
		for _, l := range leases {
			it, err := env.Outbox.Get(env.Ctx, env.Pool, l.ID)
			require.NoError(t, err)
			require.Equal(t, outbox.StateUncertain, it.State, c.name)
		}
		require.Zero(t, audited(), c.name)
	}

	require.NoError(t, reconcile.RecoverAll(env.Ctx, env.Pool, env.Outbox, reviewed,
		reconcile.Recovery{Expect: outbox.StateUncertain, To: outbox.StatePending, Reason: "resend", By: "console:otto"}))
	for _, l := range leases {
		it, err := env.Outbox.Get(env.Ctx, env.Pool, l.ID)
		require.NoError(t, err)
		require.Equal(t, outbox.StatePending, it.State)
		es, err := audit.List(env.Ctx, env.Pool, audit.Item(l.ID), 10)
		require.NoError(t, err)
		require.Len(t, es, 1)
		require.Equal(t, "console:otto", es[0].Actor)
		require.Equal(t, "resend", es[0].Reason)
	}
}
