package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// crashRequest is one POST /v1/usage of the crash test and what became of
// it before the kill.
type crashRequest struct {
	events   []e2eEvent
	answered bool // 202 before the kill
}

// TestGroupCommitCrashLosesNothingAnswered SIGKILLs a `tally serve`
// while many clients post small batches that it coalesces into shared
// transactions, then checks the ledger: every event answered 202 is stored
// once with its content, every request not answered is stored whole or
// not at all, and, once the clients retried their unanswered requests with
// the same ids on a restarted node, every event is stored exactly once.
// The rows' transaction ids show the requests did share transactions.
func TestGroupCommitCrashLosesNothingAnswered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.URL(t)
	n := &node{t: t, addr: freeAddr(t), env: []string{
		"TALLY_DATABASE_URL=" + url, "TALLY_ADMIN_TOKEN=" + chaosAdmin, "TALLY_LOG_LEVEL=error",
		"TALLY_INGEST_REQUESTS_PER_SECOND=0", "TALLY_INGEST_EVENTS_PER_SECOND=0",
		"TALLY_INGEST_GROUP_COMMIT_WAIT=3ms", "TALLY_INGEST_GROUP_COMMIT_COMMITS=1",
	}}
	n.env = append(n.env, "TALLY_LISTEN="+n.addr)
	n.start()
	t.Cleanup(n.stop)

	const clients = 32
	var (
		mu       sync.Mutex
		requests []*crashRequest
		answered atomic.Int64
		killed   atomic.Bool
		wg       sync.WaitGroup
	)
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	for c := range clients {
		wg.Go(func() {
			for k := 0; !killed.Load(); k++ {
				// Half the clients post one event a request, half three, so
				// that a request cut in two would show.
				req := &crashRequest{events: crashEvents(c, k, 1+2*(c%2))}
				mu.Lock()
				requests = append(requests, req)
				mu.Unlock()
				if postUsage(client, "http://"+n.addr, req.events) == http.StatusAccepted {
					req.answered = true
					answered.Add(1)
				}
			}
		})
	}
	require.Eventually(t, func() bool { return answered.Load() >= 500 }, 60*time.Second, 5*time.Millisecond, "the clients post")
	killed.Store(true) // no client starts another request…
	n.kill()           // …and those in flight are cut by a SIGKILL
	wg.Wait()

	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ledger := crashLedger(t, pool)
	unanswered := 0
	for _, req := range requests {
		found := 0
		for _, ev := range req.events {
			if v, ok := ledger[ev.Tenant+"/"+ev.ID]; ok {
				require.Equal(t, ev.Value, v, "event %s stored with its content", ev.ID)
				found++
			}
		}
		if req.answered {
			require.Equal(t, len(req.events), found, "every event answered 202 is stored")
			continue
		}
		unanswered++
		require.Contains(t, []int{0, len(req.events)}, found, "a request not answered is stored whole or not at all")
	}
	require.Positive(t, unanswered, "the kill came while requests were in flight")
	var transactions int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(DISTINCT xmin::text) FROM usage_events").Scan(&transactions))
	require.Less(t, transactions, int(answered.Load()), "coalesced requests share transactions")
	t.Logf("%d requests answered 202 before the kill, %d not; %d transactions wrote the ledger", answered.Load(), unanswered, transactions)

	n.start()
	total := 0
	for _, req := range requests {
		total += len(req.events)
		if !req.answered {
			require.Equal(t, http.StatusAccepted, postUsage(client, "http://"+n.addr, req.events), "a retry with the same ids is accepted")
		}
	}
	ledger = crashLedger(t, pool)
	require.Len(t, ledger, total, "after the retries every event is stored, once")
}

// crashEvents are client c's k-th request: n events with ids unique to it.
func crashEvents(c, k, n int) []e2eEvent {
	evs := make([]e2eEvent, n)
	for i := range evs {
		evs[i] = e2eEvent{ID: fmt.Sprintf("c%d-r%d-e%d", c, k, i), Tenant: fmt.Sprintf("tenant-%d", c%4), Feature: "api_calls",
			Value: int64(1 + (c*7+k*3+i)%50), Timestamp: time.Now().UTC().Format(time.RFC3339Nano)}
	}
	return evs
}

// postUsage posts events once and answers the status, 0 when no answer
// came.
func postUsage(client *http.Client, base string, events []e2eEvent) int {
	body, err := json.Marshal(map[string]any{"events": events})
	if err != nil {
		return 0
	}
	req, err := http.NewRequest(http.MethodPost, base+"/v1/usage", bytes.NewReader(body))
	if err != nil {
		return 0
	}
	req.Header.Set("Authorization", "Bearer "+chaosAdmin)
	resp, err := client.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	if _, err := out.ReadFrom(resp.Body); err != nil {
		return 0
	}
	return resp.StatusCode
}

// crashLedger is the value of every stored event, by tenant/id; a key
// stored twice fails the test.
func crashLedger(t *testing.T, pool *pgxpool.Pool) map[string]int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), "SELECT tenant || '/' || event_id, value FROM usage_events")
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var (
			k string
			v int64
		)
		require.NoError(t, rows.Scan(&k, &v))
		_, twice := out[k]
		require.False(t, twice, "event %s stored twice", k)
		out[k] = v
	}
	require.NoError(t, rows.Err())
	return out
}
