package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/migrations"
)

// BenchmarkIngestVsCopyFrom measures ingest through POST /v1/usage — the
// real handler, wired as app.Serve wires it, over HTTP — at batches of 100
// and 1,000 events with 8 concurrent clients, and, in the same run on the
// same server, a pgx CopyFrom of the same rows into an identical table
// (CREATE TABLE … (LIKE usage_events INCLUDING ALL)) by 8 connections, one
// commit per batch, as the ceiling. It prints both rates and their ratio; it
// never fails on speed. Run it with one iteration:
//
//	go test ./api -run '^$' -bench IngestVsCopyFrom -benchtime 1x
//
// Commits are durable: the benchmark starts its own private cluster with
// embeddedpg's production settings (Ephemeral false: fsync on,
// synchronous_commit on, full_page_writes on), in a directory under
// os.TempDir() (so on disk unless TMPDIR points at a memory file system),
// not on the test suite's throwaway /dev/shm cluster.
func BenchmarkIngestVsCopyFrom(b *testing.B) {
	const (
		events  = 200_000 // per batch size
		clients = 8
	)
	batches := []int{100, 1000}

	ctx := context.Background()
	env := startDurable(b, nil)

	type result struct{ api, copy float64 }
	results := map[int]result{}
	for _, batch := range batches {
		w := newWorkload(b, batch, events)
		checkpoint(b, env.pool)
		apiRate := benchAPI(b, env, w, clients)
		checkpoint(b, env.pool)
		copyRate := benchCopy(b, env, w, clients)
		results[batch] = result{apiRate, copyRate}
	}

	var version string
	if err := env.pool.QueryRow(ctx, "SHOW server_version").Scan(&version); err != nil {
		b.Fatal(err)
	}
	var fsync, syncCommit string
	if err := env.pool.QueryRow(ctx, "SELECT current_setting('fsync'), current_setting('synchronous_commit')").Scan(&fsync, &syncCommit); err != nil {
		b.Fatal(err)
	}

	for _, batch := range batches {
		r := results[batch]
		b.ReportMetric(r.api, fmt.Sprintf("api_b%d_events/s", batch))
		b.ReportMetric(r.copy, fmt.Sprintf("copy_b%d_events/s", batch))
		b.ReportMetric(r.api/r.copy, fmt.Sprintf("ratio_b%d", batch))
	}
	fmt.Printf("\n%d events per batch size, %d clients; PostgreSQL %s (fsync=%s, synchronous_commit=%s) in %s; %d CPUs, GOMAXPROCS %d\n",
		events, clients, version, fsync, syncCommit, env.dir, runtime.NumCPU(), runtime.GOMAXPROCS(0))
	fmt.Printf("%-8s %18s %18s %8s\n", "batch", "POST /v1/usage /s", "CopyFrom /s", "ratio")
	for _, batch := range batches {
		r := results[batch]
		fmt.Printf("%-8d %18.0f %18.0f %7.2fx\n", batch, r.api, r.copy, r.api/r.copy)
	}
	fmt.Println()
}

// benchEnv is a durable cluster, a migrated database on it, and the real
// API handler served over HTTP with an ingest token.
type benchEnv struct {
	dir   string
	url   string
	pool  *pgxpool.Pool
	srv   *httptest.Server
	token string
}

// startDurable starts a private cluster with durable commits, creates and
// migrates a database through app.Open, and serves the handler app.Serve
// builds, configured by settings over the defaults.
func startDurable(b *testing.B, settings map[string]string) *benchEnv {
	b.Helper()
	return startDurableOn(b, settings, 0)
}

// startDurableOn is startDurable on a Citus coordinator with workers
// workers (`make citus`), Tally's tables distributed, when workers > 0.
func startDurableOn(b *testing.B, settings map[string]string, workers int) *benchEnv {
	b.Helper()
	ctx := context.Background()
	quiet := slog.New(slog.DiscardHandler)
	dir, err := os.MkdirTemp(os.TempDir(), "tally-bench-pg-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	// When the benchmark runs as root, the cluster runs as an unprivileged
	// user that must be able to enter the directory.
	if err := os.Chmod(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	pgcfg := embeddedpg.Config{DataDir: dir, Ephemeral: false, Logger: quiet}
	if workers > 0 {
		if pgcfg.BinDir, err = embeddedpg.FindCitus(); err != nil {
			b.Skip(err)
		}
		pgcfg.Workers = workers
	}
	cluster, err := embeddedpg.Start(ctx, pgcfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cluster.Stop(sctx); err != nil {
			b.Error(err)
		}
	})
	if err := cluster.EnsureDatabase(ctx, "tally_bench"); err != nil {
		b.Fatal(err)
	}
	url := cluster.URL("tally_bench")

	// The configuration as cmd/tally reads it, from nothing but the URL.
	cfg := benchConfig(b, url, settings)
	// app.Open: the pool as the service makes it, and migrations.Apply.
	db, err := app.Open(ctx, cfg, quiet, false)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(db.Close)
	if workers > 0 {
		if _, err := migrations.Distribute(ctx, db.Pool, quiet); err != nil {
			b.Fatal(err)
		}
	}
	srv := serveBench(b, db.Pool, cfg)
	tok, err := auth.CreateToken(ctx, db.Pool, "bench ingest", auth.RoleIngest, nil)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE usage_events_copy (LIKE usage_events INCLUDING ALL)"); err != nil {
		b.Fatal(err)
	}
	return &benchEnv{dir: dir, url: url, pool: db.Pool, srv: srv, token: tok.Secret}
}

// benchConfig is the configuration cmd/tally reads from the URL and the
// settings.
func benchConfig(b *testing.B, url string, settings map[string]string) config.Config {
	b.Helper()
	getenv := map[string]string{"TALLY_DATABASE_URL": url}
	for k, v := range settings {
		getenv[k] = v
	}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return getenv[k] })
	if err := fs.Parse(nil); err != nil {
		b.Fatal(err)
	}
	cfg, err := load()
	if err != nil {
		b.Fatal(err)
	}
	return cfg
}

// serveBench serves, over HTTP, the handler app.Serve builds from cfg on
// pool.
func serveBench(b *testing.B, pool *pgxpool.Pool, cfg config.Config) *httptest.Server {
	b.Helper()
	parts, err := app.Build(cfg)
	if err != nil {
		b.Fatal(err)
	}
	// As app.Serve builds it; the readiness checks are left out (not on the
	// ingest path), River's stager is not started, and no quota is set
	// (the zero IngestQuota: no limit), so that one token stands for many
	// clients.
	handler := api.New(api.Options{
		Logger:  slog.New(slog.DiscardHandler),
		Metrics: promhttp.HandlerFor(parts.Registry, promhttp.HandlerOpts{}),
		V1: &api.Deps{Pool: pool, Outbox: parts.Outbox, Mappings: parts.Mappings, Ingester: parts.Ingester,
			Requeuer: parts.Requeuer, Metrics: parts.API},
	})
	srv := httptest.NewServer(handler)
	b.Cleanup(srv.Close)
	return srv
}

// checkpoint starts each measured phase with no dirty buffers left over
// from the one before.
func checkpoint(b *testing.B, pool *pgxpool.Pool) {
	b.Helper()
	if _, err := pool.Exec(context.Background(), "CHECKPOINT"); err != nil {
		b.Fatal(err)
	}
}

// workload is one batch size's events, both as the JSON bodies clients post
// and as the rows CopyFrom writes.
type workload struct {
	batch  int
	prefix string // of every event id
	bodies [][]byte
	rows   [][][]any
}

type wireEvent struct {
	ID        string `json:"id"`
	Tenant    string `json:"tenant"`
	Feature   string `json:"feature"`
	Value     int64  `json:"value"`
	Timestamp string `json:"timestamp"`
}

// newWorkload makes n events with unique ids across 4 tenants and 3
// features, with explicit timestamps within the last two hours.
func newWorkload(b *testing.B, batch, n int) *workload {
	b.Helper()
	w := &workload{batch: batch, prefix: fmt.Sprintf("b%d-", batch)}
	base := time.Now().UTC().Add(-2 * time.Hour).Truncate(time.Second)
	for start := 0; start < n; start += batch {
		evs := make([]wireEvent, 0, batch)
		rows := make([][]any, 0, batch)
		for i := start; i < min(start+batch, n); i++ {
			ev := wireEvent{
				ID:      fmt.Sprintf("%s%07d", w.prefix, i),
				Tenant:  fmt.Sprintf("tenant-%d", i%4),
				Feature: fmt.Sprintf("feature-%d", i%3),
				Value:   int64(i%100 + 1),
			}
			ts := base.Add(time.Duration(i) * 10 * time.Millisecond)
			ev.Timestamp = ts.Format(time.RFC3339Nano)
			evs = append(evs, ev)
			rows = append(rows, []any{ev.Tenant, ev.ID, ev.Feature, ev.Value, ts, true, tenantbucket.Of(ev.Tenant)})
		}
		body, err := json.Marshal(map[string]any{"events": evs})
		if err != nil {
			b.Fatal(err)
		}
		w.bodies = append(w.bodies, body)
		w.rows = append(w.rows, rows)
	}
	return w
}

func (w *workload) events() int {
	n := 0
	for _, r := range w.rows {
		n += len(r)
	}
	return n
}

// benchAPI posts every body of w with clients goroutines and returns events
// per second over the wall time of the whole run. Every answer must be 202
// with the whole batch accepted, and the ledger must hold every event.
func benchAPI(b *testing.B, env *benchEnv, w *workload, clients int) float64 {
	b.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * clients, MaxIdleConnsPerHost: 2 * clients}}
	defer client.CloseIdleConnections()
	var (
		next   atomic.Int64
		failed atomic.Bool
		wg     sync.WaitGroup
	)
	start := time.Now()
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !failed.Load() {
				i := int(next.Add(1)) - 1
				if i >= len(w.bodies) {
					return
				}
				if err := post(client, env, w.bodies[i], len(w.rows[i])); err != nil {
					if failed.CompareAndSwap(false, true) {
						b.Errorf("batch %d, request %d: %v", w.batch, i, err)
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if failed.Load() {
		b.FailNow()
	}
	var stored int
	if err := env.pool.QueryRow(context.Background(), "SELECT count(*) FROM usage_events WHERE starts_with(event_id, $1)", w.prefix).Scan(&stored); err != nil {
		b.Fatal(err)
	}
	if stored != w.events() {
		b.Fatalf("batch %d: the ledger holds %d of %d events", w.batch, stored, w.events())
	}
	return float64(w.events()) / elapsed.Seconds()
}

func post(client *http.Client, env *benchEnv, body []byte, want int) error {
	req, err := http.NewRequest(http.MethodPost, env.srv.URL+"/v1/usage", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+env.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusAccepted {
		return fmt.Errorf("status %d: %s", resp.StatusCode, answer)
	}
	var res struct{ Accepted, Duplicates int }
	if err := json.Unmarshal(answer, &res); err != nil {
		return err
	}
	if res.Accepted != want || res.Duplicates != 0 {
		return fmt.Errorf("accepted %d and %d duplicates of %d", res.Accepted, res.Duplicates, want)
	}
	return nil
}

// benchCopy writes the rows of w into usage_events_copy with clients
// goroutines, each on its own connection, one CopyFrom per batch (a
// statement outside a transaction block: one commit per batch), and returns
// events per second over the wall time of the whole run.
func benchCopy(b *testing.B, env *benchEnv, w *workload, clients int) float64 {
	b.Helper()
	ctx := context.Background()
	columns := []string{"tenant", "event_id", "feature", "value", "occurred_at", "timestamp_given", "bucket"}
	conns := make([]*pgx.Conn, clients)
	for c := range conns {
		conn, err := pgx.Connect(ctx, env.url)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close(ctx)
		conns[c] = conn
	}
	var (
		next   atomic.Int64
		failed atomic.Bool
		wg     sync.WaitGroup
	)
	start := time.Now()
	for _, conn := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !failed.Load() {
				i := int(next.Add(1)) - 1
				if i >= len(w.rows) {
					return
				}
				n, err := conn.CopyFrom(ctx, pgx.Identifier{"usage_events_copy"}, columns, pgx.CopyFromRows(w.rows[i]))
				if err == nil && int(n) != len(w.rows[i]) {
					err = fmt.Errorf("copied %d of %d rows", n, len(w.rows[i]))
				}
				if err != nil {
					if failed.CompareAndSwap(false, true) {
						b.Errorf("CopyFrom, batch %d, copy %d: %v", w.batch, i, err)
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if failed.Load() {
		b.FailNow()
	}
	var stored int
	if err := env.pool.QueryRow(ctx, "SELECT count(*) FROM usage_events_copy WHERE starts_with(event_id, $1)", w.prefix).Scan(&stored); err != nil {
		b.Fatal(err)
	}
	if stored != w.events() {
		b.Fatalf("CopyFrom batch %d: the table holds %d of %d events", w.batch, stored, w.events())
	}
	return float64(w.events()) / elapsed.Seconds()
}
