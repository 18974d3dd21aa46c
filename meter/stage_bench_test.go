package meter_test

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// stageFixture is a day of closed hourly windows: tenants × features
// (sum, sum, last, sum, sum) × 24 windows, perWindow rows each, loaded
// with COPY in time order, as ingest writes them.
type stageFixture struct {
	tenants, features, perWindow int
}

func (f stageFixture) windows() int { return f.tenants * f.features * 24 }

func (f stageFixture) load(b *testing.B, e *stagetest.Env) {
	b.Helper()
	aggs := []mappings.Aggregation{mappings.Sum, mappings.Sum, mappings.Last, mappings.Sum, mappings.Sum}
	for j := range f.features {
		e.Feature(b, fmt.Sprintf("f%d", j), aggs[j%len(aggs)], time.Hour)
	}
	for i := range f.tenants {
		e.Tenant(b, fmt.Sprintf("tenant-%04d", i), nil)
	}
	day := time.Now().UTC().Truncate(time.Hour).Add(-26 * time.Hour)
	// In time order, every tenant and feature interleaved, as ingest
	// writes them.
	var rows [][]any
	for h := range 24 {
		for k := range f.perWindow {
			at := day.Add(time.Duration(h)*time.Hour + time.Duration(k*3600/f.perWindow)*time.Second)
			for i := range f.tenants {
				for j := range f.features {
					tenant := fmt.Sprintf("tenant-%04d", i)
					rows = append(rows, []any{tenant, fmt.Sprintf("e-%d-%d-%d", j, h, k),
						fmt.Sprintf("f%d", j), int64(k + 1), at, true, tenantbucket.Of(tenant)})
				}
			}
		}
	}
	_, err := e.Pool.CopyFrom(e.Ctx, pgx.Identifier{"usage_events"},
		[]string{"tenant", "event_id", "feature", "value", "occurred_at", "timestamp_given", "bucket"}, pgx.CopyFromRows(rows))
	require.NoError(b, err)
	_, err = e.Pool.Exec(e.Ctx, "VACUUM ANALYZE usage_events")
	require.NoError(b, err)
}

// stageWay is one way of staging a day: a pass over each of parts parts
// at once, each on its own connection.
type stageWay struct {
	name  string
	parts int
	pass  func(ctx context.Context, s *meter.Stager, db pgdb.DB, p meter.Part) (meter.PassResult, error)
}

func (w stageWay) run(b *testing.B, e *stagetest.Env) (meter.PassResult, time.Duration, cpuTimes) {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(e.Pool.Config().ConnString())
	require.NoError(b, err)
	var tr *statementTimes
	if os.Getenv("TALLY_BENCH_STAGE_TRACE") != "" {
		tr = &statementTimes{took: map[string]time.Duration{}, n: map[string]int{}}
		cfg.ConnConfig.Tracer = tr
		defer tr.print(w.name)
	}
	pool, err := pgxpool.NewWithConfig(e.Ctx, cfg)
	require.NoError(b, err)
	defer pool.Close()
	var (
		mu    sync.Mutex
		total meter.PassResult
		wg    sync.WaitGroup
		errs  = make(chan error, w.parts)
	)
	pss := os.Getenv("TALLY_BENCH_STAGE_PSS") != ""
	if pss {
		_, err := e.Pool.Exec(e.Ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
		require.NoError(b, err)
		_, err = e.Pool.Exec(e.Ctx, "SELECT pg_stat_statements_reset()")
		require.NoError(b, err)
		defer printStatements(b, e, w.name)
	}
	cpu0 := readCPU(b, e)
	start := time.Now()
	for _, p := range meter.Parts(w.parts) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := w.pass(e.Ctx, e.Stager, pool, p)
			mu.Lock()
			total.Items, total.Events = total.Items+res.Items, total.Events+res.Events
			mu.Unlock()
			errs <- err
		}()
	}
	wg.Wait()
	took := time.Since(start)
	cpu := readCPU(b, e).minus(cpu0)
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
	return total, took, cpu
}

// cpuTimes is the CPU time spent by the test's PostgreSQL cluster (the
// postmaster and every process it started: backends, WAL writer,
// checkpointer, autovacuum) and by this Go process, from /proc: what the
// work costs whatever else the machine runs. ok is false without /proc.
type cpuTimes struct {
	pg, goproc time.Duration
	ok         bool
}

func (c cpuTimes) minus(o cpuTimes) cpuTimes {
	return cpuTimes{pg: c.pg - o.pg, goproc: c.goproc - o.goproc, ok: c.ok && o.ok}
}

// procCPU reads a process's utime+stime and parent from /proc/pid/stat
// (in clock ticks of 1/100 s, Linux's USER_HZ).
func procCPU(pid string) (cpu time.Duration, ppid string, ok bool) {
	raw, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0, "", false
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:]) // after "pid (comm) "
	if len(f) < 13 {
		return 0, "", false
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond, f[1], true
}

func readCPU(b *testing.B, e *stagetest.Env) cpuTimes {
	b.Helper()
	var backend int
	require.NoError(b, e.Pool.QueryRow(e.Ctx, "SELECT pg_backend_pid()").Scan(&backend))
	_, postmaster, ok := procCPU(strconv.Itoa(backend))
	if !ok {
		return cpuTimes{}
	}
	var c cpuTimes
	c.pg, _, _ = procCPU(postmaster)
	entries, _ := os.ReadDir("/proc")
	for _, d := range entries {
		if cpu, ppid, ok := procCPU(d.Name()); ok && ppid == postmaster {
			c.pg += cpu
		}
	}
	c.goproc, _, c.ok = procCPU("self")
	return c
}

// BenchmarkStage stages a day's closed windows of many tenants and
// features, the serial way (one window a transaction, as before batches)
// and the batched way, each over one part and over two parts at once
// (two workers), each on a fresh copy of the same ledger, and prints
// windows and events staged a second. TALLY_BENCH_STAGE_TENANTS sets the
// tenants (default 100: 12,000 windows of 10 rows).
func BenchmarkStage(b *testing.B) {
	fx := stageFixture{tenants: 100, features: 5, perWindow: 10}
	if v, err := strconv.Atoi(os.Getenv("TALLY_BENCH_STAGE_TENANTS")); err == nil && v > 0 {
		fx.tenants = v
	}
	serial := func(ctx context.Context, s *meter.Stager, db pgdb.DB, p meter.Part) (meter.PassResult, error) {
		return meter.SerialPassPart(ctx, s, db, p)
	}
	batched := func(ctx context.Context, s *meter.Stager, db pgdb.DB, p meter.Part) (meter.PassResult, error) {
		return s.PassPart(ctx, db, p)
	}
	ways := []stageWay{{"serial, 1 worker", 1, serial}, {"serial, 2 workers", 2, serial},
		{"batched, 1 worker", 1, batched}, {"batched, 2 workers", 2, batched}}
	type result struct {
		res  meter.PassResult
		took time.Duration
		cpu  cpuTimes
	}
	results := make([]result, len(ways))
	for range b.N {
		for i, w := range ways {
			b.StopTimer()
			e := stagetest.New(b, outbox.Config{})
			fx.load(b, e)
			b.StartTimer()
			res, took, cpu := w.run(b, e)
			require.Equal(b, fx.windows(), res.Items, w.name)
			require.Equal(b, fx.windows()*fx.perWindow, res.Events, w.name)
			results[i] = result{res, took, cpu}
		}
	}
	fmt.Printf("\n%d tenants × %d features × 24 hourly windows = %d windows, %d rows each (%d rows)\n",
		fx.tenants, fx.features, fx.windows(), fx.perWindow, fx.windows()*fx.perWindow)
	fmt.Printf("%-22s %8s %10s %10s %9s | %8s %8s %12s %12s\n", "", "seconds", "windows/s", "events/s", "ms/window",
		"pg CPU", "Go CPU", "windows/CPUs", "events/CPUs")
	for i, w := range ways {
		r := results[i]
		s := r.took.Seconds()
		fmt.Printf("%-22s %8.2f %10.0f %10.0f %9.3f", w.name, s, float64(r.res.Items)/s, float64(r.res.Events)/s,
			1000*s/float64(r.res.Items))
		if cpu := r.cpu.pg + r.cpu.goproc; r.cpu.ok && cpu > 0 {
			// Per CPU-second of the cluster and this process together.
			fmt.Printf(" | %7.2fs %7.2fs %12.0f %12.0f", r.cpu.pg.Seconds(), r.cpu.goproc.Seconds(),
				float64(r.res.Items)/cpu.Seconds(), float64(r.res.Events)/cpu.Seconds())
		}
		fmt.Println()
	}
	base := results[0].took.Seconds()
	for i, w := range ways[1:] {
		fmt.Printf("%-22s %10.2fx the serial pass's rate\n", w.name, base/results[i+1].took.Seconds())
	}
	fmt.Println()
	b.ReportMetric(float64(results[0].res.Items)/results[0].took.Seconds(), "serial_windows/s")
	b.ReportMetric(float64(results[3].res.Items)/results[3].took.Seconds(), "batched2_windows/s")
	b.ReportMetric(float64(results[3].res.Events)/results[3].took.Seconds(), "batched2_events/s")
}

// statementTimes sums, per statement (its first words), the time from
// sending it to its end, as the client sees it (TALLY_BENCH_STAGE_TRACE).
type statementTimes struct {
	mu    sync.Mutex
	took  map[string]time.Duration
	n     map[string]int
	start sync.Map // *pgx.Conn → time.Time, sql
}

type traced struct {
	at  time.Time
	sql string
}

func (s *statementTimes) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	s.start.Store(conn, traced{time.Now(), data.SQL})
	return ctx
}

func (s *statementTimes) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, _ pgx.TraceQueryEndData) {
	v, ok := s.start.Load(conn)
	if !ok {
		return
	}
	t := v.(traced)
	key := strings.Join(strings.Fields(t.sql), " ")
	if len(key) > 70 {
		key = key[:70]
	}
	s.mu.Lock()
	s.took[key] += time.Since(t.at)
	s.n[key]++
	s.mu.Unlock()
}

func (s *statementTimes) print(name string) {
	keys := make([]string, 0, len(s.took))
	for k := range s.took {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return s.took[keys[i]] > s.took[keys[j]] })
	fmt.Printf("%s: time per statement, client side\n", name)
	for _, k := range keys[:min(len(keys), 12)] {
		fmt.Printf("  %8.3f s %7d× %s\n", s.took[k].Seconds(), s.n[k], k)
	}
}

// printStatements prints the statements of the database that took the
// most time on the server, from pg_stat_statements (TALLY_BENCH_STAGE_PSS,
// on a server that preloads it, TALLY_TEST_DATABASE_URL).
func printStatements(b *testing.B, e *stagetest.Env, name string) {
	rows, err := e.Pool.Query(e.Ctx, `SELECT total_exec_time, calls, rows, shared_blks_hit + shared_blks_read, wal_records, wal_bytes,
		left(regexp_replace(query, '\s+', ' ', 'g'), 70)
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		ORDER BY total_exec_time DESC LIMIT 10`)
	require.NoError(b, err)
	fmt.Printf("%s: pg_stat_statements, by server time\n", name)
	var (
		ms                   float64
		calls, n, blks, recs int64
		walBytes             float64
		q                    string
	)
	_, err = pgx.ForEachRow(rows, []any{&ms, &calls, &n, &blks, &recs, &walBytes, &q}, func() error {
		fmt.Printf("  %9.1f ms %7d calls %8d rows %9d blocks %8d WAL records %6.1f MB  %s\n", ms, calls, n, blks, recs, walBytes/1e6, q)
		return nil
	})
	require.NoError(b, err)
}
