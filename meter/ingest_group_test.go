package meter

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func event(id string, v int64) Event { return Event{ID: id, Tenant: "acme", Feature: "api", Value: v} }

func pendingOf(t *testing.T, evs ...Event) *pending {
	t.Helper()
	p := &pending{events: evs}
	require.NoError(t, p.dedupe())
	return p
}

// stored is the value of every stored event of acme, by id.
func stored(t *testing.T, db pgdb.DB) map[string]int64 {
	t.Helper()
	rows, err := db.Query(context.Background(), "SELECT event_id, value FROM usage_events WHERE tenant = 'acme'")
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var (
			id string
			v  int64
		)
		require.NoError(t, rows.Scan(&id, &v))
		out[id] = v
	}
	require.NoError(t, rows.Err())
	return out
}

// A group answers each batch as if it had been ingested alone after the
// ones before it: its own counts, its own refusal, and nothing of a
// refused batch stored, while the others are.
func TestGroupAnswersEachBatchAsIfAlone(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	in := &Ingester{MaxQuarantined: 2}
	_, err := in.ingestAlone(ctx, pool, []Event{event("e0", 1)})
	require.NoError(t, err)

	var (
		changedStored = pendingOf(t, event("c1", 1), event("e0", 9))                 // e0 stored before with another value
		overCap       = pendingOf(t, event("q1", 1), event("q2", 1), event("q3", 1)) // three quarantined items, cap 2
		first         = pendingOf(t, event("a1", 1), event("a2", 1), event("e0", 1), event("a1", 1))
		second        = pendingOf(t, event("a1", 1), event("b1", 1)) // a1 as first posts it
		clash         = pendingOf(t, event("a2", 5), event("d1", 1)) // a2 as first does not post it
	)
	in.writeGroup(ctx, pool, []*pending{changedStored, overCap, first, second, clash})

	var invalid *InvalidBatchError
	require.ErrorAs(t, changedStored.err, &invalid)
	require.Len(t, invalid.Problems, 1)
	require.Equal(t, 1, *invalid.Problems[0].Index, "the problem is indexed in its own batch")
	var capped *QuarantineCapError
	require.ErrorAs(t, overCap.err, &capped)
	require.Equal(t, 3, capped.Items)
	require.NoError(t, first.err)
	require.Equal(t, Result{Accepted: 2, Duplicates: 2, Unmapped: 2}, first.res)
	require.NoError(t, second.err)
	require.Equal(t, Result{Accepted: 1, Duplicates: 1, Unmapped: 1}, second.res)
	require.ErrorAs(t, clash.err, &invalid, "written after the group, it finds a2 stored with another value")
	require.Equal(t, 0, *invalid.Problems[0].Index)
	require.Equal(t, map[string]int64{"e0": 1, "a1": 1, "a2": 1, "b1": 1}, stored(t, pool), "nothing of a refused batch is stored")
}

// A batch deferred for an id it shares with another of its group is
// stored when that other batch is refused: it is answered as if it had
// come after it.
func TestGroupDeferredBatchIsStoredWhenTheOtherIsRefused(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	in := &Ingester{}
	_, err := in.ingestAlone(ctx, pool, []Event{event("e0", 1)})
	require.NoError(t, err)
	refused := pendingOf(t, event("x1", 1), event("e0", 2))
	later := pendingOf(t, event("x1", 2))
	in.writeGroup(ctx, pool, []*pending{refused, later})
	var invalid *InvalidBatchError
	require.ErrorAs(t, refused.err, &invalid)
	require.NoError(t, later.err)
	require.Equal(t, Result{Accepted: 1, Unmapped: 1}, later.res)
	require.Equal(t, map[string]int64{"e0": 1, "x1": 2}, stored(t, pool))
}

// Many small batches posted at once through Post are each answered with
// their own result once stored, whether they shared a transaction or not;
// a batch over half a group has its own.
func TestPostGroupCommitsConcurrentBatches(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	in := &Ingester{GroupCommit: GroupCommit{Wait: 5 * time.Millisecond, MaxEvents: 8, MaxBytes: 1 << 20, Commits: 1}}
	const posts = 64
	results := make([]Result, posts)
	errs := make([]error, posts)
	var wg sync.WaitGroup
	for i := range posts {
		wg.Go(func() {
			evs := []Event{event(fmt.Sprintf("p%d", i), 1)}
			if i%2 == 1 {
				evs = append(evs, event(fmt.Sprintf("p%d", i-1), 1)) // the even post's event: one of the two is a duplicate
			}
			if i == 0 {
				evs = append(evs, event("big1", 1), event("big2", 1), event("big3", 1), event("big4", 1))
			}
			results[i], errs[i] = in.Post(ctx, pool, evs)
		})
	}
	wg.Wait()
	accepted, dups := 0, 0
	for i := range posts {
		require.NoError(t, errs[i], "post %d", i)
		accepted += results[i].Accepted
		dups += results[i].Duplicates
		require.Equal(t, results[i].Accepted, results[i].Unmapped, "post %d", i)
	}
	require.Equal(t, posts+4, accepted)
	require.Equal(t, posts/2, dups)
	require.Len(t, stored(t, pool), posts+4)
}
