package api_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/bits"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/embeddedpg"
)

// BenchmarkSingleEventIngestVsInsert measures the way most product
// services post usage — one event per request — with 64 clients, each on a
// connection it keeps, posting single-event batches with unique ids to
// POST /v1/usage (the real handler, wired as app.Serve wires it, over
// HTTP), beside, in the same run on the same durable cluster (so the same
// binaries, disk and settings), pgbench's one-row inserts: `pgbench -n
// -c 64 -j 2 -M prepared`, one INSERT of a ledger-like row a transaction
// into an identical table (see runPgbench) — the database's own rate for
// this workload, with the protocol mode that suits it best. Each phase
// runs for the same time. It prints events a second and p50 and p99
// latency of each and the ratio; it never fails on speed. Run it with one
// iteration:
//
//	go test ./api -run '^$' -bench SingleEventIngestVsInsert -benchtime 1x
//
// TALLY_BENCH_SINGLE_SECONDS sets each phase's time (default 20, pgbench's
// -T); TALLY_BENCH_SINGLE_ROUNDS (default 1) splits it into rounds that
// take turns (measurePhases), for a machine whose load changes;
// TALLY_BENCH_SINGLE_UNGROUPED=1 adds a phase with group commit off
// (TALLY_INGEST_GROUP_COMMIT_EVENTS=0: a transaction a request);
// TALLY_INGEST_GROUP_COMMIT_* in the environment tune the group commit phase
// as they tune serve. pgbench is looked for beside the cluster's
// binaries, then on PATH; without it the benchmark is skipped.
// Commits are durable: see BenchmarkIngestVsCopyFrom.
func BenchmarkSingleEventIngestVsInsert(b *testing.B) {
	const clients = 64
	seconds := 20
	if v, err := strconv.Atoi(os.Getenv("TALLY_BENCH_SINGLE_SECONDS")); err == nil && v > 0 {
		seconds = v
	}
	rounds := 1
	if v, err := strconv.Atoi(os.Getenv("TALLY_BENCH_SINGLE_ROUNDS")); err == nil && v > 0 && v <= seconds {
		rounds = v
	}
	pgbench := findPgbench(b)
	tuned := map[string]string{}
	for _, k := range []string{"TALLY_INGEST_GROUP_COMMIT_WAIT", "TALLY_INGEST_GROUP_COMMIT_EVENTS", "TALLY_INGEST_GROUP_COMMIT_BYTES", "TALLY_INGEST_GROUP_COMMIT_COMMITS"} {
		if v, ok := os.LookupEnv(k); ok {
			tuned[k] = v
		}
	}
	env := startDurable(b, tuned)

	phases := []phase{
		{"pgbench -M prepared, INSERT each", func(prefix string, d time.Duration) (int, time.Duration, []time.Duration) {
			return runPgbench(b, env, pgbench, prefix, d, clients)
		}},
		{"POST /v1/usage, group commit", func(prefix string, d time.Duration) (int, time.Duration, []time.Duration) {
			return postSingles(b, env, env.srv, prefix, d, clients)
		}},
	}
	if os.Getenv("TALLY_BENCH_SINGLE_UNGROUPED") == "1" {
		off := serveBench(b, env.pool, benchConfig(b, env.url, map[string]string{"TALLY_INGEST_GROUP_COMMIT_EVENTS": "0"}))
		phases = append(phases, phase{"POST /v1/usage, no group commit", func(prefix string, d time.Duration) (int, time.Duration, []time.Duration) {
			return postSingles(b, env, off, prefix, d, clients)
		}})
	}
	results := measurePhases(b, env, phases, time.Duration(seconds)*time.Second, rounds)
	groups := groupSizes(b, env, "s1-")
	var fsync, syncCommit string
	if err := env.pool.QueryRow(context.Background(), "SELECT current_setting('fsync'), current_setting('synchronous_commit')").Scan(&fsync, &syncCommit); err != nil {
		b.Fatal(err)
	}
	base := results[0].rate
	b.ReportMetric(base, "pgbench_tps")
	b.ReportMetric(results[1].rate, "api_events/s")
	b.ReportMetric(results[1].rate/base, "ratio")
	b.ReportMetric(float64(results[1].p50.Microseconds())/1000, "api_p50_ms")
	b.ReportMetric(float64(results[1].p99.Microseconds())/1000, "api_p99_ms")
	fmt.Printf("\n%d s a phase in %d rounds, %d clients keeping their connections; pgbench -n -c %d -j 2 -M prepared; fsync=%s, synchronous_commit=%s in %s; %d CPUs, GOMAXPROCS %d\n",
		seconds, rounds, clients, clients, fsync, syncCommit, env.dir, runtime.NumCPU(), runtime.GOMAXPROCS(0))
	fmt.Printf("%-34s %10s %10s %9s %9s %8s\n", "phase", "events", "events/s", "p50", "p99", "ratio")
	for i, ph := range phases {
		r := results[i]
		fmt.Printf("%-34s %10d %10.0f %9s %9s %7.2fx\n", ph.name, r.events, r.rate, r.p50.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond), r.rate/base)
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

// phase is one way of writing single events: run writes them for d, with
// ids starting with prefix, and returns how many it wrote, in what time,
// and each one's latency.
type phase struct {
	name string
	run  func(prefix string, d time.Duration) (n int, elapsed time.Duration, lat []time.Duration)
}

// figures are a phase's events, events a second and latency percentiles.
type figures struct {
	events   int
	rate     float64
	p50, p99 time.Duration
}

// measurePhases runs each phase for d, in rounds: each round runs every
// phase in turn for d/rounds, after a checkpoint, so that a machine whose
// load changes during the run weighs on every phase alike. Phase i's ids
// start with "s<i>-".
func measurePhases(b *testing.B, env *benchEnv, phases []phase, d time.Duration, rounds int) []figures {
	b.Helper()
	elapsed := make([]time.Duration, len(phases))
	events := make([]int, len(phases))
	lats := make([][]time.Duration, len(phases))
	for r := range rounds {
		for i, ph := range phases {
			checkpoint(b, env.pool)
			n, took, lat := ph.run(fmt.Sprintf("s%d-r%d-", i, r), d/time.Duration(rounds))
			events[i] += n
			elapsed[i] += took
			lats[i] = append(lats[i], lat...)
		}
	}
	results := make([]figures, len(phases))
	for i, lat := range lats {
		if len(lat) == 0 {
			b.Fatalf("%s wrote nothing", phases[i].name)
		}
		slices.Sort(lat)
		results[i] = figures{events[i], float64(events[i]) / elapsed[i].Seconds(), lat[len(lat)/2], lat[len(lat)*99/100]}
	}
	return results
}

// postSingles posts single-event batches with unique ids from clients
// goroutines to srv for d and returns how many, in what time, and each
// request's latency. Every answer must be 202 with its event accepted,
// and the ledger must hold every event.
func postSingles(b *testing.B, env *benchEnv, srv *httptest.Server, prefix string, d time.Duration, clients int) (int, time.Duration, []time.Duration) {
	b.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * clients, MaxIdleConnsPerHost: 2 * clients}}
	defer client.CloseIdleConnections()
	at := time.Now().UTC().Add(-time.Hour).Format(time.RFC3339)
	start := time.Now()
	n, lat := during(b, start.Add(d), clients, func(i int) error {
		body := fmt.Appendf(nil, `{"events":[{"id":"%s%07d","tenant":"tenant-%d","feature":"feature-%d","value":1,"timestamp":"%s"}]}`,
			prefix, i, i%4, i%3, at)
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/usage", bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+env.token)
		req.Header.Set("Content-Type", "application/json")
		return answered(client, req, 1)
	})
	took := time.Since(start)
	countStored(b, env, "usage_events", prefix, n)
	return n, took, lat
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

// pgbenchScript is one transaction of the baseline: one INSERT of a row
// as wide as a single event's ledger row — the tenant and feature of the
// API phase's (4 tenants, 3 features), an id unique to the client and its
// transaction, with the phase's prefix, as long as the API phase's ids,
// value 1 and a posted timestamp.
const pgbenchScript = `\set k :k + 1
\set t :client_id % 4
\set f :k % 3
INSERT INTO usage_events_copy (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
VALUES ('tenant-' || :t, :prefix || lpad((:client_id * 100000 + :k)::text, 7, '0'), 'feature-' || :f, 1, :at, true,
        tally_bucket('tenant-' || :t));
`

// findPgbench is pgbench beside the cluster's server binaries (the same
// PostgreSQL), else on PATH; the benchmark is skipped without it.
func findPgbench(b *testing.B) string {
	b.Helper()
	if dir, err := embeddedpg.FindBinaries(); err == nil {
		if p := filepath.Join(dir, "pgbench"); isFile(p) {
			return p
		}
	}
	p, err := exec.LookPath("pgbench")
	if err != nil {
		b.Skip("pgbench not found beside the PostgreSQL binaries nor on PATH: the baseline cannot run")
	}
	return p
}

func isFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// runPgbench runs pgbench's baseline for d with clients connections over
// two threads: -n (no vacuum of pgbench's own tables), -M prepared (each
// connection prepares the INSERT once, as pgx's statement cache does for
// the API's statements), pgbenchScript a transaction, every transaction
// logged (-l) for its latency. It connects over TCP as the benchmark
// does, with the password in PGPASSWORD, so it runs as whoever runs the
// benchmark while the cluster runs as its own user. It returns the
// transactions, the time they took (pgbench's, without its connections'
// start) and each one's latency, and checks that the table holds them.
func runPgbench(b *testing.B, env *benchEnv, pgbench, prefix string, d time.Duration, clients int) (int, time.Duration, []time.Duration) {
	b.Helper()
	cfg, err := pgx.ParseConfig(env.url)
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	script := filepath.Join(dir, "insert.sql")
	if err := os.WriteFile(script, []byte(pgbenchScript), 0o644); err != nil {
		b.Fatal(err)
	}
	at := time.Now().UTC().Add(-time.Hour).Format(time.RFC3339)
	cmd := exec.Command(pgbench, "-n", "-c", strconv.Itoa(clients), "-j", "2", "-T", strconv.Itoa(max(1, int(d.Round(time.Second).Seconds()))),
		"-M", "prepared", "-f", script, "-D", "k=0", "-D", "prefix="+prefix, "-D", "at="+at,
		"-l", "--log-prefix", filepath.Join(dir, "log"),
		"-h", cfg.Host, "-p", strconv.Itoa(int(cfg.Port)), "-U", cfg.User, cfg.Database)
	cmd.Env = append(os.Environ(), "PGPASSWORD="+cfg.Password, "PGSSLMODE=disable")
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("pgbench: %v\n%s", err, out)
	}
	n, tps := pgbenchFigures(b, out)
	lat := pgbenchLatencies(b, dir)
	if len(lat) != n {
		b.Fatalf("pgbench logged %d transactions and reported %d", len(lat), n)
	}
	countStored(b, env, "usage_events_copy", prefix, n)
	return n, time.Duration(float64(n) / tps * float64(time.Second)), lat
}

// pgbenchFigures reads, from pgbench's output, the transactions it
// processed and its rate without the initial connection time.
func pgbenchFigures(b *testing.B, out []byte) (n int, tps float64) {
	b.Helper()
	var errN, errTPS error = errors.New("missing"), errors.New("missing")
	for line := range strings.Lines(string(out)) {
		if v, ok := strings.CutPrefix(line, "number of transactions actually processed: "); ok {
			n, errN = strconv.Atoi(strings.TrimSpace(v))
		}
		if v, ok := strings.CutPrefix(line, "tps = "); ok && strings.Contains(v, "without initial connection time") {
			tps, errTPS = strconv.ParseFloat(strings.Fields(v)[0], 64)
		}
	}
	if errN != nil || errTPS != nil || n == 0 || tps <= 0 {
		b.Fatalf("pgbench's output has no transaction count or rate:\n%s", out)
	}
	return n, tps
}

// pgbenchLatencies reads every transaction's latency from pgbench's logs
// in dir (one file a thread; the third field is the latency in µs).
func pgbenchLatencies(b *testing.B, dir string) []time.Duration {
	b.Helper()
	logs, err := filepath.Glob(filepath.Join(dir, "log.*"))
	if err != nil || len(logs) == 0 {
		b.Fatalf("no pgbench log in %s: %v", dir, err)
	}
	var lat []time.Duration
	for _, name := range logs {
		data, err := os.ReadFile(name)
		if err != nil {
			b.Fatal(err)
		}
		for line := range strings.Lines(string(data)) {
			f := strings.Fields(line)
			if len(f) < 3 {
				continue
			}
			us, err := strconv.ParseInt(f[2], 10, 64)
			if err != nil {
				b.Fatalf("pgbench log %s: %q", name, line)
			}
			lat = append(lat, time.Duration(us)*time.Microsecond)
		}
	}
	return lat
}

// during runs do(0), do(1), … from clients goroutines until deadline and
// returns how many ran and each one's latency; it fails the benchmark on
// the first error.
func during(b *testing.B, deadline time.Time, clients int, do func(i int) error) (int, []time.Duration) {
	b.Helper()
	var (
		next   atomic.Int64
		failed atomic.Bool
		wg     sync.WaitGroup
		mu     sync.Mutex
		lat    []time.Duration
	)
	for range clients {
		wg.Go(func() {
			var mine []time.Duration
			defer func() {
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			}()
			for !failed.Load() && time.Now().Before(deadline) {
				i := int(next.Add(1)) - 1
				start := time.Now()
				if err := do(i); err != nil {
					if failed.CompareAndSwap(false, true) {
						b.Errorf("request %d: %v", i, err)
					}
					return
				}
				mine = append(mine, time.Since(start))
			}
		})
	}
	wg.Wait()
	if failed.Load() {
		b.FailNow()
	}
	return len(lat), lat
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
