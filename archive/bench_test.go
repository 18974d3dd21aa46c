package archive

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// envBenchRows sets BenchmarkArchive's ledger rows (default 1,000,000).
const envBenchRows = "TALLY_ARCHIVE_BENCH_ROWS"

// envBenchProfile, set to a directory, makes each child process write its
// CPU and memory profiles there.
const envBenchProfile = "TALLY_ARCHIVE_BENCH_PROFILE"

// envChild makes TestArchiveChild run one archive command: "archive" or
// "verify", the database URL, the directory and the period, separated by
// spaces. Unset, TestArchiveChild skips.
const envChild = "TALLY_ARCHIVE_CHILD"

// BenchmarkArchive loads a month of confirmed history by COPY (history's
// fixture: ~1M ledger rows carried by 250,000 items), then runs tally
// archive and tally archive verify of it, each in a process of its own, and
// prints rows/s, bytes per event in Parquet and in Postgres, and each
// command's peak RSS (VmHWM).
func BenchmarkArchive(b *testing.B) {
	if runtime.GOOS != "linux" {
		b.Skip("peak RSS is read from /proc")
	}
	rows := int64(1_000_000)
	if v := os.Getenv(envBenchRows); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		rows = n
	}
	ctx := context.Background()
	pool := testdb.New(b)
	if err := history.Map(ctx, pool); err != nil {
		b.Fatal(err)
	}
	size := history.Size{Rows: rows - rows%history.EventsPerItem, Items: rows / history.EventsPerItem}
	l, err := history.Load(ctx, pool, size, time.Now())
	if err != nil {
		b.Fatal(err)
	}
	period := l.To.Add(-time.Hour).Format("2006-01")
	var events, pgBytes int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM usage_events`).Scan(&events); err != nil {
		b.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT pg_total_relation_size('usage_events') + pg_total_relation_size('outbox_item_bodies')
		+ pg_total_relation_size('outbox_item_states') + pg_total_relation_size('outbox_attempts')`).Scan(&pgBytes); err != nil {
		b.Fatal(err)
	}
	fmt.Printf("\narchive: %d ledger rows, %d items loaded by COPY in %s (%s to %s); archiving %s\n",
		size.Rows, size.Items, l.Copy.Round(time.Second), l.From.Format(time.DateOnly), l.To.Format(time.DateOnly), period)
	url := testdb.URLOf(b, pool)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		dir := b.TempDir()
		for _, cmd := range []string{"archive", "verify"} {
			out := child(b, cmd, url, dir, period)
			fmt.Printf("%-8s %s\n", cmd, out.line)
			b.ReportMetric(out.peakKB/1024, cmd+"_peak_rss_MB")
			b.ReportMetric(out.rowsPerSecond, cmd+"_rows/s")
			if cmd == "archive" {
				b.ReportMetric(float64(out.bytes)/float64(out.events), "parquet_B/event")
				fmt.Printf("bytes per event: %.1f in Parquet (every file), %.1f in Postgres (ledger, items, attempts with indexes)\n",
					float64(out.bytes)/float64(out.events), float64(pgBytes)/float64(events))
				b.ReportMetric(float64(pgBytes)/float64(events), "postgres_B/event")
			}
		}
	}
}

type childResult struct {
	line                  string
	peakKB, rowsPerSecond float64
	bytes, events         int64
}

// child runs TestArchiveChild in a new process of this test binary and
// reads its one line of results.
func child(b *testing.B, cmd, url, dir, period string) childResult {
	b.Helper()
	args := []string{"-test.run=^TestArchiveChild$", "-test.count=1"}
	if dir := os.Getenv(envBenchProfile); dir != "" {
		args = append(args, "-test.cpuprofile="+filepath.Join(dir, cmd+".cpu"), "-test.memprofile="+filepath.Join(dir, cmd+".mem"))
	}
	c := exec.Command(os.Args[0], args...)
	c.Env = append(os.Environ(), envChild+"="+strings.Join([]string{cmd, url, dir, period}, " "))
	out, err := c.CombinedOutput()
	if err != nil {
		b.Fatalf("%s: %v\n%s", cmd, err, out)
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "result ") {
			continue
		}
		var r childResult
		r.line = strings.TrimPrefix(line, "result ")
		for _, f := range strings.Fields(r.line) {
			k, v, _ := strings.Cut(f, "=")
			n, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "peak_rss_kB":
				r.peakKB = n
			case "rows/s":
				r.rowsPerSecond = n
			case "bytes":
				r.bytes = int64(n)
			case "events":
				r.events = int64(n)
			}
		}
		return r
	}
	b.Fatalf("%s: no result\n%s", cmd, out)
	return childResult{}
}

// TestArchiveChild is BenchmarkArchive's child process: one archive or
// verify, then its figures and the process's peak RSS on one line.
func TestArchiveChild(t *testing.T) {
	spec := os.Getenv(envChild)
	if spec == "" {
		t.Skip("run by BenchmarkArchive")
	}
	debug.SetMemoryLimit(MemoryLimit) // as the commands do
	f := strings.Fields(spec)
	cmd, url, dir, period := f[0], f[1], f[2], f[3]
	ctx := context.Background()
	pool := poolOf(t, url)
	store, err := NewDirStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Store: store, By: "bench"}
	start := time.Now()
	var rows, bytes, events int64
	switch cmd {
	case "archive":
		res, err := Archive(ctx, pool, period, cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, file := range res.Manifest.Files {
			rows += file.Rows
			bytes += file.Bytes
			if file.Name == fileEvents {
				events = file.Rows
			}
		}
	case "verify":
		v, err := Verify(ctx, pool, period, 0, cfg)
		if err != nil {
			t.Fatal(err)
		}
		rows, bytes = v.Rows, v.Bytes
	}
	took := time.Since(start)
	fmt.Printf("result rows=%d events=%d bytes=%d took=%s rows/s=%.0f peak_rss_kB=%d\n", rows, events, bytes,
		took.Round(time.Millisecond), float64(rows)/took.Seconds(), peakRSS(t))
}

// peakRSS is the process's peak resident set size in kB (VmHWM).
func peakRSS(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

// poolOf opens a pool on url for the child process.
func poolOf(t *testing.T, url string) *pgxpool.Pool {
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
