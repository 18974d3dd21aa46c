package api_test

import (
	"bytes"
	"context"
	"fmt"
	"math/bits"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// BenchmarkSingleEventIngestVsInsert measures the way most product
// services post usage — one event per request — with 64 clients posting
// single-event batches with unique ids to POST /v1/usage (the real
// handler, wired as app.Serve wires it, over HTTP), beside, in the same run
// on the same durable cluster, 64 connections each committing one
// single-row INSERT per transaction into an identical table (pgbench's
// shape: the database's own rate for this workload). The API runs twice:
// with group commit as serve's defaults set it, and with it off
// (TALLY_INGEST_COALESCE_EVENTS=0: a transaction per request, as before).
// It prints events a second, p50 and p99 latency of each and the ratios;
// it never fails on speed. Run it with one iteration:
//
//	go test ./api -run '^$' -bench SingleEventIngestVsInsert -benchtime 1x
//
// TALLY_BENCH_SINGLE_EVENTS sets the events of each phase (default
// 32,000); TALLY_BENCH_SINGLE_ROUNDS (default 1) splits them into rounds
// that take turns (measurePhases), for a machine whose load changes;
// TALLY_INGEST_COALESCE_* in the environment tune the group commit phase
// as they tune serve.
// Commits are durable: see BenchmarkIngestVsCopyFrom.
func BenchmarkSingleEventIngestVsInsert(b *testing.B) {
	const clients = 64
	events := 32_000
	if v, err := strconv.Atoi(os.Getenv("TALLY_BENCH_SINGLE_EVENTS")); err == nil && v > 0 {
		events = v
	}
	rounds := 1
	if v, err := strconv.Atoi(os.Getenv("TALLY_BENCH_SINGLE_ROUNDS")); err == nil && v > 0 && v <= events {
		rounds = v
	}
	tuned := map[string]string{}
	for _, k := range []string{"TALLY_INGEST_COALESCE_WAIT", "TALLY_INGEST_COALESCE_EVENTS", "TALLY_INGEST_COALESCE_BYTES", "TALLY_INGEST_COALESCE_COMMITS"} {
		if v, ok := os.LookupEnv(k); ok {
			tuned[k] = v
		}
	}
	env := startDurable(b, tuned)
	off := serveBench(b, env.pool, benchConfig(b, env.url, map[string]string{"TALLY_INGEST_COALESCE_EVENTS": "0"}))

	phases := []phase{
		{"INSERT, a transaction each", func(prefix string, n int) []time.Duration { return insertSingles(b, env, prefix, n, clients) }},
		{"POST /v1/usage, group commit", func(prefix string, n int) []time.Duration { return postSingles(b, env, env.srv, prefix, n, clients) }},
		{"POST /v1/usage, no group commit", func(prefix string, n int) []time.Duration { return postSingles(b, env, off, prefix, n, clients) }},
	}
	results := measurePhases(b, env, phases, events, rounds)
	groups := groupSizes(b, env, "s1-")
	var fsync, syncCommit string
	if err := env.pool.QueryRow(context.Background(), "SELECT current_setting('fsync'), current_setting('synchronous_commit')").Scan(&fsync, &syncCommit); err != nil {
		b.Fatal(err)
	}
	base := results[0].rate
	b.ReportMetric(base, "insert_events/s")
	b.ReportMetric(results[1].rate, "api_events/s")
	b.ReportMetric(results[1].rate/base, "ratio")
	b.ReportMetric(float64(results[1].p99.Microseconds())/1000, "api_p99_ms")
	fmt.Printf("\n%d single-event requests per phase in %d rounds, %d clients; fsync=%s, synchronous_commit=%s in %s; %d CPUs, GOMAXPROCS %d\n",
		events/rounds*rounds, rounds, clients, fsync, syncCommit, env.dir, runtime.NumCPU(), runtime.GOMAXPROCS(0))
	fmt.Printf("%-34s %10s %9s %9s %8s\n", "phase", "events/s", "p50", "p99", "ratio")
	for i, ph := range phases {
		r := results[i]
		fmt.Printf("%-34s %10.0f %9s %9s %7.2fx\n", ph.name, r.rate, r.p50.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond), r.rate/base)
	}
	fmt.Printf("group commit: %s\n\n", groups)
}

// groupSizes describes how the group commit phase's requests (one event
// each, ids starting with prefix) shared transactions: the transactions,
// their mean requests, and how many carried 1, 2–3, 4–7, … requests. A
// row's xmin is the transaction that wrote it.
func groupSizes(b *testing.B, env *benchEnv, prefix string) string {
	b.Helper()
	rows, err := env.pool.Query(context.Background(),
		"SELECT count(*) FROM usage_events WHERE starts_with(event_id, $1) GROUP BY xmin::text", prefix)
	if err != nil {
		b.Fatal(err)
	}
	sizes, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		b.Fatal(err)
	}
	var (
		total   int
		buckets [8]int // 1, 2–3, 4–7, …, 128+
	)
	for _, n := range sizes {
		total += n
		buckets[min(len(buckets)-1, bits.Len(uint(n))-1)]++
	}
	out := fmt.Sprintf("%d transactions, %.1f requests each;", len(sizes), float64(total)/float64(max(1, len(sizes))))
	for k, c := range buckets {
		lo, hi := 1<<k, 1<<(k+1)-1
		switch {
		case c == 0:
			continue
		case lo == hi:
			out += fmt.Sprintf(" %d:%d", lo, c)
		case k == len(buckets)-1:
			out += fmt.Sprintf(" %d+:%d", lo, c)
		default:
			out += fmt.Sprintf(" %d-%d:%d", lo, hi, c)
		}
	}
	return out
}

// phase is one way of writing single events: run writes n of them with
// ids starting with prefix and returns each one's latency.
type phase struct {
	name string
	run  func(prefix string, n int) []time.Duration
}

// figures are a phase's events a second and latency percentiles.
type figures struct {
	rate     float64
	p50, p99 time.Duration
}

// measurePhases runs each phase for events, in rounds: each round runs
// every phase in turn on events/rounds events, after a checkpoint, so
// that a machine whose load changes during the run weighs on every phase
// alike. Phase i's ids start with "s<i>-".
func measurePhases(b *testing.B, env *benchEnv, phases []phase, events, rounds int) []figures {
	b.Helper()
	elapsed := make([]time.Duration, len(phases))
	lats := make([][]time.Duration, len(phases))
	for r := range rounds {
		for i, ph := range phases {
			checkpoint(b, env.pool)
			start := time.Now()
			lats[i] = append(lats[i], ph.run(fmt.Sprintf("s%d-r%d-", i, r), events/rounds)...)
			elapsed[i] += time.Since(start)
		}
	}
	results := make([]figures, len(phases))
	for i, lat := range lats {
		slices.Sort(lat)
		results[i] = figures{float64(len(lat)) / elapsed[i].Seconds(), lat[len(lat)/2], lat[len(lat)*99/100]}
	}
	return results
}

// postSingles posts n single-event batches with unique ids from clients
// goroutines to srv and returns each request's latency. Every answer must
// be 202 with its event accepted, and the ledger must hold every event.
func postSingles(b *testing.B, env *benchEnv, srv *httptest.Server, prefix string, n, clients int) []time.Duration {
	b.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * clients, MaxIdleConnsPerHost: 2 * clients}}
	defer client.CloseIdleConnections()
	at := time.Now().UTC().Add(-time.Hour).Format(time.RFC3339)
	lat := make([]time.Duration, n)
	each(b, n, clients, func(i int) error {
		body := fmt.Appendf(nil, `{"events":[{"id":"%s%07d","tenant":"tenant-%d","feature":"feature-%d","value":1,"timestamp":"%s"}]}`,
			prefix, i, i%4, i%3, at)
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/usage", bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+env.token)
		req.Header.Set("Content-Type", "application/json")
		start := time.Now()
		err = answered(client, req, 1)
		lat[i] = time.Since(start)
		return err
	})
	countStored(b, env, "usage_events", prefix, n)
	return lat
}

// answered sends req and checks the answer: 202, want accepted.
func answered(client *http.Client, req *http.Request, want int) error {
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusAccepted || !bytes.Contains(buf.Bytes(), fmt.Appendf(nil, `"accepted":%d,`, want)) {
		return fmt.Errorf("status %d: %s", resp.StatusCode, buf.Bytes())
	}
	return nil
}

// insertSingles commits n single-row INSERTs (each its own transaction)
// into usage_events_copy from clients connections and returns each
// statement's latency.
func insertSingles(b *testing.B, env *benchEnv, prefix string, n, clients int) []time.Duration {
	b.Helper()
	ctx := context.Background()
	conns := make(chan *pgx.Conn, clients)
	for range clients {
		conn, err := pgx.Connect(ctx, env.url)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close(ctx)
		conns <- conn
	}
	at := time.Now().UTC().Add(-time.Hour)
	lat := make([]time.Duration, n)
	each(b, n, clients, func(i int) error {
		conn := <-conns
		defer func() { conns <- conn }()
		start := time.Now()
		_, err := conn.Exec(ctx, `INSERT INTO usage_events_copy (tenant, event_id, feature, value, occurred_at, timestamp_given)
			VALUES ($1, $2, $3, 1, $4, true)`, fmt.Sprintf("tenant-%d", i%4), fmt.Sprintf("%s%07d", prefix, i), fmt.Sprintf("feature-%d", i%3), at)
		lat[i] = time.Since(start)
		return err
	})
	countStored(b, env, "usage_events_copy", prefix, n)
	return lat
}

// each runs do(0) … do(n-1) from clients goroutines and fails the
// benchmark on the first error.
func each(b *testing.B, n, clients int, do func(i int) error) {
	b.Helper()
	var (
		next   atomic.Int64
		failed atomic.Bool
		wg     sync.WaitGroup
	)
	for range clients {
		wg.Go(func() {
			for !failed.Load() {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if err := do(i); err != nil {
					if failed.CompareAndSwap(false, true) {
						b.Errorf("request %d: %v", i, err)
					}
					return
				}
			}
		})
	}
	wg.Wait()
	if failed.Load() {
		b.FailNow()
	}
}

// countStored checks that table holds the n events of the phase.
func countStored(b *testing.B, env *benchEnv, table, prefix string, n int) {
	b.Helper()
	var stored int
	if err := env.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table+" WHERE starts_with(event_id, $1)", prefix).Scan(&stored); err != nil {
		b.Fatal(err)
	}
	if stored != n {
		b.Fatalf("%s holds %d of %d events", table, stored, n)
	}
}
