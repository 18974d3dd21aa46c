package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/client"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestClientRidesOutServerKills is issue 18's acceptance run for the Go
// client: several goroutines add usage through one buffered client while
// the `tally serve` it posts to is killed with SIGKILL and restarted three
// times — batches cut in flight, replies lost, the node refusing
// connections while it is down. Once the client is closed, every event
// added is in the ledger exactly once (counted by id: none missing, none
// twice), with its value and the timestamp Add gave it.
func TestClientRidesOutServerKills(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.URL(t)
	code, out, errs := tally(t, url, "tokens", "create", "--role", "ingest", "--name", "client-e2e")
	require.Equal(t, 0, code, errs)
	token := strings.TrimSpace(out)
	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_LOG_LEVEL=error"}
	n.start()
	t.Cleanup(n.stop)

	logs := &syncbuf.Buffer{}
	c, err := client.New("http://"+n.addr, token,
		client.WithBatchSize(50), client.WithBufferSize(500), client.WithFlushInterval(5*time.Millisecond),
		client.WithBackoff(10*time.Millisecond, 200*time.Millisecond), client.WithRetryBudget(time.Minute),
		client.WithHTTPClient(&http.Client{Timeout: 5 * time.Second}),
		client.WithLogger(slog.New(slog.NewTextHandler(logs, nil))))
	require.NoError(t, err)

	const writers = 4
	var (
		stop  atomic.Bool
		wg    sync.WaitGroup
		added [writers][]client.Event // each writer's events that Add accepted
	)
	for w := range writers {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				ev := client.Event{ID: fmt.Sprintf("w%d-%d", w, i), Tenant: fmt.Sprintf("tenant-%d", w), Feature: "api_calls", Value: int64(1 + i%50)}
				if err := c.Add(ctx, ev); err != nil {
					t.Errorf("writer %d: %v", w, err)
					return
				}
				added[w] = append(added[w], ev)
				time.Sleep(500 * time.Microsecond)
			}
		})
	}
	const kills = 3
	for range kills {
		time.Sleep(700 * time.Millisecond) // usage flows…
		n.kill()                           // …batches are cut in flight…
		time.Sleep(200 * time.Millisecond) // …the node is down: the buffer fills, Add waits…
		n.start()                          // …and it comes back
	}
	time.Sleep(300 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	closing, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	require.NoError(t, c.Close(closing), "every event added was delivered")

	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	type stored struct {
		times int
		value int64
		given bool
	}
	ledger := map[string]stored{}
	rows, err := pool.Query(ctx, `SELECT tenant || '/' || event_id, count(*), max(value), bool_and(timestamp_given)
		FROM usage_events GROUP BY tenant, event_id`)
	require.NoError(t, err)
	var (
		key string
		s   stored
	)
	_, err = pgx.ForEachRow(rows, []any{&key, &s.times, &s.value, &s.given}, func() error {
		ledger[key] = s
		return nil
	})
	require.NoError(t, err)
	total := 0
	for _, evs := range added {
		total += len(evs)
		for _, ev := range evs {
			got, ok := ledger[ev.Tenant+"/"+ev.ID]
			require.True(t, ok, "event %s/%s is stored", ev.Tenant, ev.ID)
			require.Equal(t, 1, got.times, "event %s/%s is stored once", ev.Tenant, ev.ID)
			require.Equal(t, ev.Value, got.value, ev.ID)
			require.True(t, got.given, "%s: stored with the timestamp Add gave it", ev.ID)
		}
	}
	require.Len(t, ledger, total, "nothing else is stored")
	retries := strings.Count(logs.String(), "retrying POST /v1/usage")
	require.Positive(t, retries, "the kills were felt: the client retried")
	require.NotContains(t, logs.String(), token, "the token is never logged")
	refused := strings.Count(logs.String(), "connection refused")
	t.Logf("%d events added by %d goroutines across %d kills, each stored once; %d retries, %d of a refused connection, %d of a request cut or its reply lost",
		total, writers, kills, retries, refused, retries-refused)
}
