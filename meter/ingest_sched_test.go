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

// recentOf is what a groupCommitter learns from groups of these sizes, each
// written in took.
func recentOf(took time.Duration, sizes ...int) recent {
	var r recent
	for _, n := range sizes {
		r.observe(n, took)
	}
	return r
}

// repeat is sizes n times over.
func repeat(n int, sizes ...int) []int {
	var out []int
	for range n {
		out = append(out, sizes...)
	}
	return out
}

// The typical group is the one a typical batch was in: groups of one
// slipping between large ones do not make it small.
func TestTypicalGroupWeighsGroupsByTheirBatches(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		sizes    []int
		min, max float64
	}{
		{"no group written yet", nil, 0, 0},
		{"a lone client", repeat(20, 1), 1, 1},
		{"two groups of 32 a cycle", repeat(20, 32), 32, 32},
		{"63 and 1 alternating", repeat(20, 63, 1), 55, 63},
		{"clients gone: a hundred groups of 1 after groups of 32", append(repeat(20, 32), repeat(100, 1)...), 1, 1.9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := recentOf(time.Millisecond, tc.sizes...)
			require.GreaterOrEqual(t, r.typical(), tc.min)
			require.LessOrEqual(t, r.typical(), tc.max)
		})
	}
}

// A group with a commit slot waits for as many peers as clients were
// seen posting together — a lone client's own batch is enough — and never
// longer than the configured bound nor than a recent write.
func TestPeerWaitIsBoundedAndSparesALoneClient(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	for _, tc := range []struct {
		name                 string
		recent               recent
		limit                time.Duration
		wantWait             time.Duration
		minTarget, maxTarget int
	}{
		{"the first group does not wait", recent{}, 5 * ms, 0, 0, 0},
		{"a lone client's own batch is enough", recentOf(3*ms, repeat(20, 1)...), 5 * ms, 3 * ms, 1, 1},
		{"groups of 32: wait for 32, a write long", recentOf(3*ms, repeat(20, 32)...), 5 * ms, 3 * ms, 32, 32},
		{"63 and 1 alternating: wait for most of the 63", recentOf(3*ms, repeat(20, 63, 1)...), 5 * ms, 3 * ms, 55, 63},
		{"a slow write: the configured bound", recentOf(80*ms, repeat(20, 32)...), 5 * ms, 5 * ms, 32, 32},
		{"bound 0: no wait", recentOf(3*ms, repeat(20, 32)...), 0, 0, 0, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			target, wait := tc.recent.peerWait(tc.limit)
			require.Equal(t, tc.wantWait, wait)
			require.GreaterOrEqual(t, target, tc.minTarget)
			require.LessOrEqual(t, target, tc.maxTarget)
		})
	}
}

// transactions counts the transactions that wrote acme's events.
func transactions(t *testing.T, db pgdb.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(),
		"SELECT count(DISTINCT xmin::text) FROM usage_events WHERE tenant = 'acme'").Scan(&n))
	return n
}

// A group that has its slot waits for as many peers as peerWait names
// and is written with them in one transaction, well before its bound.
func TestPostWaitsForPeersThenWritesThemTogether(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	in := &Ingester{GroupCommit: GroupCommit{Wait: time.Minute, MaxEvents: 500, MaxBytes: 1 << 20, Commits: 2}}
	in.committer.recent = recentOf(time.Minute, repeat(20, 8)...)
	target, _ := in.committer.recent.peerWait(in.GroupCommit.Wait)
	require.Greater(t, target, 1)

	errs := make([]error, target)
	var wg sync.WaitGroup
	wg.Go(func() { _, errs[0] = in.Post(ctx, pool, []Event{event("w0", 1)}) })
	require.Eventually(t, func() bool { // its leader holds a slot and waits for peers
		in.committer.mu.Lock()
		defer in.committer.mu.Unlock()
		return in.committer.open != nil && in.committer.open.enough != nil
	}, 30*time.Second, time.Millisecond)
	for i := 1; i < target; i++ {
		wg.Go(func() { _, errs[i] = in.Post(ctx, pool, []Event{event(fmt.Sprintf("w%d", i), 1)}) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "post %d", i)
	}
	require.Len(t, stored(t, pool), target)
	require.Equal(t, 1, transactions(t, pool), "the first waited for the others")
}

// A group whose peers do not come is written once its bound has passed:
// the wait never outlasts it.
func TestPostWaitForPeersEndsAtItsBound(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	in := &Ingester{GroupCommit: GroupCommit{Wait: 20 * time.Millisecond, MaxEvents: 500, MaxBytes: 1 << 20, Commits: 2}}
	in.committer.recent = recentOf(time.Hour, repeat(20, 64)...)
	answered := make(chan error, 1)
	go func() {
		_, err := in.Post(ctx, pool, []Event{event("alone", 1)})
		answered <- err
	}()
	select {
	case err := <-answered:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		t.Fatal("a batch waited for peers past its bound")
	}
	require.Equal(t, map[string]int64{"alone": 1}, stored(t, pool))
}
