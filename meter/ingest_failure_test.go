package meter

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// singles are single-event batches of acme's api feature, value 1.
func singles(t *testing.T, ids ...string) []*pending {
	t.Helper()
	out := make([]*pending, len(ids))
	for i, id := range ids {
		out[i] = pendingOf(t, event(id, 1))
	}
	return out
}

// refuseAtCommit makes the commit of any transaction that inserted the
// event id fail, as a deferred constraint does.
func refuseAtCommit(t *testing.T, pool *pgxpool.Pool, id string) {
	t.Helper()
	_, err := pool.Exec(context.Background(), fmt.Sprintf(`
		CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused at commit'; END $$;
		CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON usage_events
		DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.event_id = '%s')
		EXECUTE FUNCTION refuse_at_commit()`, id))
	require.NoError(t, err)
}

// A group whose commit fails stores nothing and answers every batch of
// it with the error — never 202 — whether its batches are single events
// or not; no connection is left behind, and the next group is written.
func TestFailedCommitFailsEveryBatchOfTheGroup(t *testing.T) {
	t.Parallel()
	for name, group := range map[string]func(t *testing.T) []*pending{
		"single events": func(t *testing.T) []*pending { return singles(t, "a1", "boom", "a2") },
		"with a batch of two": func(t *testing.T) []*pending {
			return append(singles(t, "a1", "boom"), pendingOf(t, event("a2", 1), event("a3", 1)))
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, pool := context.Background(), testdb.New(t)
			refuseAtCommit(t, pool, "boom")
			in := &Ingester{}
			reqs := group(t)
			in.writeGroup(ctx, pool, reqs)
			for i, p := range reqs {
				require.ErrorContains(t, p.err, "refused at commit", "batch %d", i)
			}
			require.Empty(t, stored(t, pool))
			require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() == 0 }, 10*time.Second, 10*time.Millisecond)
			reqs = singles(t, "a1", "a2")
			in.writeGroup(ctx, pool, reqs)
			require.NoError(t, reqs[0].err, "the next group is written")
			require.Len(t, stored(t, pool), 2)
		})
	}
}

// A client that goes away while its batch waits in a group fails no one:
// the group, its own batch included, is written and answered.
func TestPostOfAClientGoneIsStillWrittenWithItsGroup(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	in := &Ingester{GroupCommit: GroupCommit{Wait: time.Minute, MaxEvents: 500, MaxBytes: 1 << 20, Commits: 2}}
	in.committer.recent = recentOf(time.Minute, repeat(20, 4)...)
	target, _ := in.committer.recent.peerWait(in.GroupCommit.Wait)
	gone, leave := context.WithCancel(ctx)
	errs := make([]error, target)
	var wg sync.WaitGroup
	wg.Go(func() { _, errs[0] = in.Post(gone, pool, []Event{event("w0", 1)}) })
	require.Eventually(t, func() bool { // its leader holds a slot and waits for peers
		in.committer.mu.Lock()
		defer in.committer.mu.Unlock()
		return in.committer.open != nil && in.committer.open.enough != nil
	}, 30*time.Second, time.Millisecond)
	leave()
	for i := 1; i < target; i++ {
		wg.Go(func() { _, errs[i] = in.Post(ctx, pool, []Event{event(fmt.Sprintf("w%d", i), 1)}) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "post %d", i)
	}
	require.Len(t, stored(t, pool), target)
	require.Equal(t, 1, transactions(t, pool))
}

// A pool closed (the node shutting down) while a group waits for peers
// fails the group's batches with an error and stores nothing: no batch
// is told it was stored.
func TestGroupOnAClosedPoolFailsEveryBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testdb.New(t).Config().ConnString())
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	in := &Ingester{GroupCommit: GroupCommit{Wait: time.Minute, MaxEvents: 500, MaxBytes: 1 << 20, Commits: 2}}
	in.committer.recent = recentOf(time.Minute, repeat(20, 3)...)
	target, _ := in.committer.recent.peerWait(in.GroupCommit.Wait)
	errs := make([]error, target)
	var wg sync.WaitGroup
	wg.Go(func() { _, errs[0] = in.Post(ctx, pool, []Event{event("c0", 1)}) })
	require.Eventually(t, func() bool { // its leader holds a slot and waits for peers
		in.committer.mu.Lock()
		defer in.committer.mu.Unlock()
		return in.committer.open != nil && in.committer.open.enough != nil
	}, 30*time.Second, time.Millisecond)
	pool.Close()
	for i := 1; i < target; i++ {
		wg.Go(func() { _, errs[i] = in.Post(ctx, pool, []Event{event(fmt.Sprintf("c%d", i), 1)}) })
	}
	wg.Wait()
	for i, err := range errs {
		require.Error(t, err, "post %d", i)
	}
	other, err := pgx.Connect(ctx, cfg.ConnString())
	require.NoError(t, err)
	defer other.Close(ctx)
	var n int
	require.NoError(t, other.QueryRow(ctx, "SELECT count(*) FROM usage_events").Scan(&n))
	require.Zero(t, n)
}
