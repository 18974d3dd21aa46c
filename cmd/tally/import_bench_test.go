package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// BenchmarkImport measures tally import — the binary, as an operator runs
// it — on a JSON Lines file of 1,000,000 events with 3 bad rows, in
// batches of 1,000, and, in the same run on the same database server (a
// fresh database each), the API's rate for the same good events through
// POST /v1/usage of a `tally serve` in batches of the same size: from one
// client, the import's own concurrency (one transaction at a time), and
// from 8, as BenchmarkIngestVsCopyFrom (api) posts. It also times a second
// run of the same import, which stores nothing new (all duplicates), the
// cost of resuming. Every phase is checked: the import names the 3 bad
// rows and exits 1, every answer of the API is 202 with its whole batch
// accepted, and each ledger holds every good event once. It prints the
// rates; it never fails on speed.
//
//	go test ./cmd/tally -run '^$' -bench Import -benchtime 1x
//
// TALLY_BENCH_IMPORT_EVENTS sets the events (default 1,000,000) and
// TALLY_BENCH_IMPORT_BATCH the batch size (default DefaultImportBatch).
// The database is the tests' throwaway cluster (tmpfs, fsync off: CPU and
// protocol costs) unless TALLY_TEST_DURABLE=1 (fsync and synchronous
// commit on, on disk: what a commit costs where data is kept).
func BenchmarkImport(b *testing.B) {
	events := benchEnvInt(b, "TALLY_BENCH_IMPORT_EVENTS", 1_000_000)
	batch := benchEnvInt(b, "TALLY_BENCH_IMPORT_BATCH", DefaultImportBatch)
	const clients = 8
	dir := b.TempDir()
	w := writeBenchImport(b, dir, events, batch)
	good := events - len(w.bad)

	type phase struct {
		name    string
		elapsed time.Duration
		rate    float64
		note    string
	}
	var phases []phase
	for i := 0; i < b.N; i++ {
		phases = phases[:0]

		url := testdb.URL(b)
		pool := benchPool(b, url)
		benchCheckpoint(pool)
		first := benchRunImport(b, url, w, batch)
		benchLedger(b, pool, w.prefix, good)
		phases = append(phases, phase{"tally import", first.wall, float64(good) / first.wall.Seconds(),
			fmt.Sprintf("its summary: %s events/s after start-up", first.summaryRate)})
		second := benchRunImport(b, url, w, batch)
		benchLedger(b, pool, w.prefix, good)
		phases = append(phases, phase{"tally import again (all duplicates)", second.wall, float64(good) / second.wall.Seconds(),
			fmt.Sprintf("its summary: %s events/s after start-up", second.summaryRate)})

		for _, c := range []int{1, clients} {
			url := testdb.URL(b)
			pool := benchPool(b, url)
			benchCheckpoint(pool)
			elapsed := benchPostAll(b, url, w.bodies, c)
			benchLedger(b, pool, w.prefix, good)
			phases = append(phases, phase{fmt.Sprintf("POST /v1/usage, %d client(s)", c), elapsed, float64(good) / elapsed.Seconds(), ""})
		}
	}

	pool := benchPool(b, testdb.URL(b))
	var version, fsync, syncCommit string
	if err := pool.QueryRow(context.Background(), "SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit')").
		Scan(&version, &fsync, &syncCommit); err != nil {
		b.Fatal(err)
	}
	fmt.Printf("\n%d events (%d bad rows) in batches of %d; PostgreSQL %s (fsync=%s, synchronous_commit=%s); %d CPUs, GOMAXPROCS %d\n",
		events, len(w.bad), batch, version, fsync, syncCommit, runtime.NumCPU(), runtime.GOMAXPROCS(0))
	fmt.Printf("%-40s %12s %10s\n", "phase", "events/s", "elapsed")
	for _, p := range phases {
		fmt.Printf("%-40s %12.0f %10s  %s\n", p.name, p.rate, p.elapsed.Round(time.Millisecond), p.note)
	}
	if len(phases) == 4 {
		fmt.Printf("import / API with 1 client: %.2fx; import / API with %d clients: %.2fx\n\n",
			phases[0].rate/phases[2].rate, clients, phases[0].rate/phases[3].rate)
		b.ReportMetric(phases[0].rate, "import_events/s")
		b.ReportMetric(phases[1].rate, "reimport_events/s")
		b.ReportMetric(phases[2].rate, "api_1client_events/s")
		b.ReportMetric(phases[3].rate, fmt.Sprintf("api_%dclients_events/s", clients))
	}
}

// benchEnvInt reads a positive whole number from the environment, or def.
func benchEnvInt(b *testing.B, name string, def int) int {
	b.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s must be a positive whole number, got %q", name, v)
	}
	return n
}

// benchImport is the benchmark's file and the same good events as request
// bodies.
type benchImport struct {
	path   string
	prefix string // of every event id
	bad    []int  // the bad rows' lines
	bodies [][]byte
}

// writeBenchImport writes n events as JSON Lines — unique ids over 4
// tenants and 3 features, timestamps within the last two hours — with 3 bad
// rows among them (a malformed line, a row without its tenant, a row that
// repeats an earlier id with another value), and keeps the good events as
// POST /v1/usage bodies of batch events each.
func writeBenchImport(b *testing.B, dir string, n, batch int) *benchImport {
	b.Helper()
	if n < 20 {
		b.Fatal("TALLY_BENCH_IMPORT_EVENTS must be at least 20")
	}
	w := &benchImport{path: filepath.Join(dir, "usage.jsonl"), prefix: "imp-"}
	f, err := os.Create(w.path)
	if err != nil {
		b.Fatal(err)
	}
	out := bufio.NewWriterSize(f, 1<<20)
	base := time.Now().UTC().Add(-2 * time.Hour).Truncate(time.Second)
	badAt := map[int]string{
		n / 10:   `{"id":"imp-bad-1","tenant":"tenant-0","feature":"feature-0","value":`,
		n / 2:    `{"id":"imp-bad-2","feature":"feature-0","value":1}`,
		n - n/20: fmt.Sprintf(`{"id":"%s%09d","tenant":"tenant-%d","feature":"feature-%d","value":1000,"timestamp":%q}`, w.prefix, 5, 5%4, 5%3, base.Format(time.RFC3339Nano)),
	}
	var body bytes.Buffer
	inBody := 0
	seal := func() {
		if inBody == 0 {
			return
		}
		body.WriteString("]}")
		w.bodies = append(w.bodies, bytes.Clone(body.Bytes()))
		body.Reset()
		inBody = 0
	}
	var line []byte
	for l := 1; l <= n; l++ {
		if bad, ok := badAt[l]; ok {
			w.bad = append(w.bad, l)
			_, _ = out.WriteString(bad + "\n")
			continue
		}
		i := l - 1
		ts := base.Add(time.Duration(i) * 5 * time.Millisecond).Format(time.RFC3339Nano)
		line = fmt.Appendf(line[:0], `{"id":"%s%09d","tenant":"tenant-%d","feature":"feature-%d","value":%d,"timestamp":%q}`,
			w.prefix, i, i%4, i%3, i%100+1, ts)
		_, _ = out.Write(line)
		_ = out.WriteByte('\n')
		if inBody == 0 {
			body.WriteString(`{"events":[`)
		} else {
			body.WriteByte(',')
		}
		body.Write(line)
		if inBody++; inBody == batch {
			seal()
		}
	}
	seal()
	if err := out.Flush(); err != nil {
		b.Fatal(err)
	}
	if err := f.Close(); err != nil {
		b.Fatal(err)
	}
	return w
}

func benchPool(b *testing.B, url string) *pgxpool.Pool {
	b.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// benchCheckpoint starts a phase with no dirty buffers left over from the
// one before (when the database user may: on the tests' own cluster).
func benchCheckpoint(pool *pgxpool.Pool) {
	_, _ = pool.Exec(context.Background(), "CHECKPOINT")
}

// benchLedger checks that the ledger holds want events of the benchmark,
// each once.
func benchLedger(b *testing.B, pool *pgxpool.Pool, prefix string, want int) {
	b.Helper()
	var n, distinct int
	if err := pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT (tenant, event_id)) FROM usage_events WHERE starts_with(event_id, $1)`,
		prefix).Scan(&n, &distinct); err != nil {
		b.Fatal(err)
	}
	if n != want || distinct != want {
		b.Fatalf("the ledger holds %d events (%d distinct), want %d", n, distinct, want)
	}
}

// benchImportRun is one run of tally import: its wall time and the rate
// its summary gives.
type benchImportRun struct {
	wall        time.Duration
	summaryRate string
}

// benchRunImport runs tally import on the file and checks that it named
// the bad rows and only them, and exited 1.
func benchRunImport(b *testing.B, url string, w *benchImport, batch int) benchImportRun {
	b.Helper()
	var out, errs bytes.Buffer
	cmd := exec.Command(binary, "import", "--batch", strconv.Itoa(batch), w.path)
	cmd.Env = append(os.Environ(), "TALLY_DATABASE_URL="+url)
	cmd.Stdout, cmd.Stderr = &out, &errs
	start := time.Now()
	err := cmd.Run()
	wall := time.Since(start)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		b.Fatalf("tally import: %v, want exit status 1\nstdout:\n%s\nstderr:\n%s", err, &out, &errs)
	}
	named := regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(w.path)+`:(\d+): `).FindAllStringSubmatch(errs.String(), -1)
	var lines []int
	for _, m := range named {
		l, _ := strconv.Atoi(m[1])
		lines = append(lines, l)
	}
	if fmt.Sprint(lines) != fmt.Sprint(w.bad) {
		b.Fatalf("tally import named lines %v, want %v\nstderr:\n%s", lines, w.bad, &errs)
	}
	rate := regexp.MustCompile(`(?m)^events/s\s+(\d+)`).FindStringSubmatch(out.String())
	if rate == nil {
		b.Fatalf("no events/s in the summary:\n%s", &out)
	}
	return benchImportRun{wall: wall, summaryRate: rate[1]}
}

// benchPostAll starts tally serve on url, posts every body from clients
// goroutines, checks each answer (202, the whole batch accepted), stops the
// node and returns the time the posting took.
func benchPostAll(b *testing.B, url string, bodies [][]byte, clients int) time.Duration {
	b.Helper()
	const admin = "bench-import-admin-token-0123456789"
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	var logs bytes.Buffer
	cmd := exec.Command(binary, "serve")
	cmd.Env = append(os.Environ(), "TALLY_DATABASE_URL="+url, "TALLY_LISTEN="+addr, "TALLY_ADMIN_TOKEN="+admin,
		"TALLY_INGEST_EVENTS_PER_SECOND=0", "TALLY_INGEST_REQUESTS_PER_SECOND=0", "TALLY_LOG_LEVEL=error")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}()
	base := "http://" + addr
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if code, _ := get(base + "/healthz"); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("tally serve did not start:\n%s", &logs)
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * clients, MaxIdleConnsPerHost: 2 * clients}}
	defer client.CloseIdleConnections()
	var (
		next   atomic.Int64
		failed atomic.Bool
		wg     sync.WaitGroup
		first  error
		once   sync.Once
	)
	start := time.Now()
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !failed.Load() {
				i := int(next.Add(1)) - 1
				if i >= len(bodies) {
					return
				}
				if err := benchPost(client, base, admin, bodies[i]); err != nil {
					once.Do(func() { first = fmt.Errorf("request %d: %w", i, err) })
					failed.Store(true)
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if first != nil {
		b.Fatal(first)
	}
	return elapsed
}

// noDuplicates matches an answer of POST /v1/usage without duplicates.
var noDuplicates = regexp.MustCompile(`"duplicates":0\b`)

// benchPost posts one body and wants every event of it accepted.
func benchPost(client *http.Client, base, token string, body []byte) error {
	req, err := http.NewRequest(http.MethodPost, base+"/v1/usage", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
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
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	if !noDuplicates.Match(answer) {
		return errors.New("duplicates in a batch of new events")
	}
	return nil
}
