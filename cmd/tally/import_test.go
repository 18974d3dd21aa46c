package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// writeFile writes a file of the test's temporary directory and returns
// its path.
func importWriteFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

// ledger is the ledger's rows as "tenant/id feature value timestamp-given",
// sorted.
func importLedger(t testing.TB, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT tenant || '/' || event_id || ' ' || feature || ' ' || value || ' ' || timestamp_given
		FROM usage_events ORDER BY tenant, event_id`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// summaryCount reads one count of the summary tally import prints.
func importSummary(t testing.TB, out, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s+(\S+)`).FindStringSubmatch(out)
	require.NotNil(t, m, "no %q in the summary:\n%s", name, out)
	return m[1]
}

const importTS = "2026-11-30T10:00:00Z"

// Bad input first: each case one file (or none) and what tally import
// must say about it — the bad rows by file and line with the API's
// reasons, exit 1, and every good row of the file stored; or, for a
// mistake in how it was called, exit 2 and nothing stored.
func TestImportBadInput(t *testing.T) {
	t.Parallel()
	good := func(id string) string {
		return fmt.Sprintf(`{"id":%q,"tenant":"acme","feature":"api","value":1,"timestamp":%q}`, id, importTS)
	}
	long := strings.Repeat("x", 129)
	cases := []struct {
		name    string
		file    string // name; "" for none
		content string
		args    []string
		code    int
		stderr  []string // each in stderr
		stored  []string // the ledger after
	}{
		{name: "malformed JSON line", file: "u.jsonl",
			content: good("a") + "\n" + `{"id":"b","tenant":"acme",` + "\n" + good("c") + "\n",
			code:    1, stderr: []string{"u.jsonl:2: malformed JSON at byte 26", "1 bad rows"},
			stored: []string{"acme/a api 1 true", "acme/c api 1 true"}},
		{name: "a line that is JSON but not an object", file: "u.jsonl", content: "[1,2]\n" + good("a") + "\n",
			code: 1, stderr: []string{"u.jsonl:1: must be a JSON object"}, stored: []string{"acme/a api 1 true"}},
		{name: "missing field", file: "u.jsonl", content: `{"id":"a","tenant":"acme","feature":"api"}` + "\n" + good("b") + "\n",
			code: 1, stderr: []string{"u.jsonl:1: value: required"}, stored: []string{"acme/b api 1 true"}},
		{name: "several problems of one row, and an unknown field", file: "u.jsonl",
			content: `{"id":"a","tenant":"ac me","value":"3","amount":3}` + "\n",
			code:    1, stderr: []string{"u.jsonl:1: amount: unknown field; feature: required; tenant: 1 to 64 characters", "value: must be a whole number"}},
		{name: "bad id", file: "u.jsonl", content: good(long) + "\n" + good("ok") + "\n",
			code: 1, stderr: []string{"u.jsonl:1: id: 1 to 128 printable ASCII characters"}, stored: []string{"acme/ok api 1 true"}},
		{name: "timestamp too far ahead", file: "u.jsonl",
			content: `{"id":"a","tenant":"acme","feature":"api","value":1,"timestamp":"2999-01-01T00:00:00Z"}` + "\n",
			code:    1, stderr: []string{"u.jsonl:1: timestamp: more than 24 hours in the future"}},
		{name: "negative value without --corrections", file: "u.jsonl",
			content: `{"id":"a","tenant":"acme","feature":"api","value":-2,"timestamp":"` + importTS + `"}` + "\n" + good("b") + "\n",
			code:    1, stderr: []string{"u.jsonl:1: value: a correction (negative value): import corrections with --corrections"},
			stored: []string{"acme/b api 1 true"}},
		{name: "negative value with --corrections", file: "u.jsonl", args: []string{"--corrections"},
			content: `{"id":"a","tenant":"acme","feature":"api","value":-2,"timestamp":"` + importTS + `"}` + "\n",
			code:    0, stored: []string{"acme/a api -2 true"}},
		{name: "id reused with different content in one batch", file: "u.jsonl",
			content: good("a") + "\n" + good("b") + "\n" + `{"id":"a","tenant":"acme","feature":"api","value":2,"timestamp":"` + importTS + `"}` + "\n" + good("a") + "\n",
			code:    1, stderr: []string{"u.jsonl:3: id: repeats the id of line 1 with different content", "1 bad rows"},
			stored: []string{"acme/a api 1 true", "acme/b api 1 true"}},
		{name: "id reused with different content in a later batch", file: "u.jsonl", args: []string{"--batch", "1"},
			content: good("a") + "\n" + `{"id":"a","tenant":"acme","feature":"api","value":2,"timestamp":"` + importTS + `"}` + "\n" + good("b") + "\n",
			code:    1, stderr: []string{"u.jsonl:2: id: an event with this id was stored before with different content"},
			stored: []string{"acme/a api 1 true", "acme/b api 1 true"}},
		{name: "blank lines and CRLF endings are fine", file: "u.ndjson", content: "\r\n" + good("a") + "\r\n\n" + good("b"),
			code: 0, stored: []string{"acme/a api 1 true", "acme/b api 1 true"}},
		{name: "a line too long", file: "u.jsonl",
			content: good("a") + "\n" + `{"id":"b","tenant":"acme","feature":"api","value":1,"x":"` + strings.Repeat("x", 70_000) + `"}` + "\n" + good("c") + "\n",
			code:    1, stderr: []string{"u.jsonl:2: longer than 65536 bytes: not one usage event"},
			stored: []string{"acme/a api 1 true", "acme/c api 1 true"}},
		{name: "a CSV row too long", file: "u.csv",
			content: "id,tenant,feature,value\n" + strings.Repeat("x", 70_000) + ",acme,api,1\nc,acme,api,1\n",
			code:    1, stderr: []string{"u.csv:2: longer than 65536 bytes: not one usage event"},
			stored: []string{"acme/c api 1 false"}},
		{name: "a CSV record past the bound stops the import, the rows before it stored", file: "u.csv",
			content: "id,tenant,feature,value\na,acme,api,1\nb,acme,api,1\n\"" + strings.Repeat("x\n", maxCSVRecord) + "\",acme,api,1\nc,acme,api,1\n",
			code:    1, stderr: []string{"u.csv:4: a CSV record longer than 1048576 bytes (1 MiB): not one usage event; every row before it is stored, none from it on"},
			stored: []string{"acme/a api 1 false", "acme/b api 1 false"}},
		{name: "CSV with an unknown column", file: "u.csv", content: "id,tenant,feature,amount\na,acme,api,1\n",
			code: 1, stderr: []string{`u.csv:1: header: unknown column "amount", no "value" column; the columns are id, tenant, feature, value (required) and timestamp (optional); the file is skipped`}},
		{name: "CSV with a column twice", file: "u.csv", content: "id,tenant,feature,value,value\n",
			code: 1, stderr: []string{`u.csv:1: header: column "value" twice`}},
		{name: "empty CSV", file: "u.csv", content: "",
			code: 1, stderr: []string{"u.csv:1: header: the file is empty"}},
		{name: "CSV rows: a missing value, a fraction, a field too many, bad quoting", file: "u.csv",
			content: "value, id ,tenant,feature,timestamp\n,a,acme,api,\n1.5,b,acme,api,\n1,c,acme,api,,\n1,\"d\"x,acme,api,\n7,\"e,1\",acme,api," + importTS + "\n",
			code:    1, stderr: []string{"u.csv:2: value: required", "u.csv:3: value: must be a whole number", "u.csv:4: 6 fields, but the header names 5 columns",
				"u.csv:5: not CSV", "4 bad rows"},
			stored: []string{"acme/e,1 api 7 true"}},
		{name: "CSV without timestamps: now, as at the API", file: "u.csv", content: "id,tenant,feature,value\na,acme,api,3\n",
			code: 0, stored: []string{"acme/a api 3 false"}},
		{name: "unknown format", file: "u.txt", content: good("a") + "\n", code: 2, stderr: []string{"cannot tell its format from its extension"}},
		{name: "unknown --format", file: "u.jsonl", args: []string{"--format", "xml"}, content: good("a") + "\n", code: 2, stderr: []string{"--format must be jsonl or csv"}},
		{name: "--format overrides the extension", file: "u.txt", args: []string{"--format", "jsonl"}, content: good("a") + "\n",
			code: 0, stored: []string{"acme/a api 1 true"}},
		{name: "batch too large", file: "u.jsonl", args: []string{"--batch", "10001"}, content: good("a") + "\n", code: 2, stderr: []string{"--batch must be 1 to 10000"}},
		{name: "batch above TALLY_INGEST_MAX_EVENTS", file: "u.jsonl", args: []string{"--batch", "20", "--ingest-max-events", "10"}, content: good("a") + "\n",
			code: 2, stderr: []string{"--batch must be 1 to 10"}},
		{name: "no file", code: 2, stderr: []string{"want one or more files"}},
		{name: "a file that is not there", args: []string{"/nonexistent/u.jsonl"}, code: 2, stderr: []string{"/nonexistent/u.jsonl: no such file or directory"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := testdb.New(t)
			args := []string{"import"}
			if tc.file != "" {
				args = append(args, importWriteFile(t, t.TempDir(), tc.file, tc.content))
			}
			code, out, errs := tally(t, testdb.URLOf(t, pool), append(args, tc.args...)...)
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", out, errs)
			for _, want := range tc.stderr {
				require.Contains(t, errs, want)
			}
			if tc.code == 2 {
				require.Empty(t, out, "a mistake in how it was called: no summary")
			} else {
				require.Contains(t, out, "bad rows")
			}
			if tc.stored == nil {
				tc.stored = []string{}
			}
			require.Equal(t, tc.stored, importLedger(t, pool))
		})
	}
}

// An id imported once and again with other content in a later run: the
// later row is bad, the stored event unchanged.
func TestImportIDReusedAcrossRuns(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	url, dir := testdb.URLOf(t, pool), t.TempDir()
	code, _, errs := tally(t, url, "import", importWriteFile(t, dir, "first.csv", "id,tenant,feature,value,timestamp\na,acme,api,1,"+importTS+"\n"))
	require.Equal(t, 0, code, errs)
	second := importWriteFile(t, dir, "second.csv", "id,tenant,feature,value,timestamp\na,acme,api,2,"+importTS+"\nb,acme,api,1,"+importTS+"\n")
	code, out, errs := tally(t, url, "import", second)
	require.Equal(t, 1, code, out)
	require.Contains(t, errs, second+":2: id: an event with this id was stored before with different content")
	require.Equal(t, []string{"acme/a api 1 true", "acme/b api 1 true"}, importLedger(t, pool))
}

// importBigFile writes n events as JSON Lines, with three bad rows among them:
// a malformed line, a row without its tenant, and a row that repeats an
// earlier id (a batch before it) with another value. It returns the path,
// the bad lines and the ledger the good rows make.
func importBigFile(t testing.TB, dir string, n int) (string, []int, []string) {
	t.Helper()
	bad := map[int]string{
		7:          `{"id":"e7","tenant":"t1","feature":"api","value":`,
		n / 2:      fmt.Sprintf(`{"id":"e%d","feature":"api","value":1,"timestamp":%q}`, n/2, importTS),
		n - 2 - 10: fmt.Sprintf(`{"id":"e3","tenant":"t%d","feature":"api","value":99,"timestamp":%q}`, 3%4, importTS),
	}
	var (
		buf  bytes.Buffer
		want []string
	)
	for line := 1; line <= n; line++ {
		if b, ok := bad[line]; ok {
			buf.WriteString(b + "\n")
			continue
		}
		i := line - 1
		tenant, value := fmt.Sprintf("t%d", i%4), i%7+1
		fmt.Fprintf(&buf, `{"id":"e%d","tenant":%q,"feature":"api","value":%d,"timestamp":%q}`+"\n", i, tenant, value, importTS)
		want = append(want, fmt.Sprintf("%s/e%d api %d true", tenant, i, value))
	}
	sort.Strings(want)
	p := filepath.Join(dir, "usage.jsonl")
	require.NoError(t, os.WriteFile(p, buf.Bytes(), 0o600))
	lines := make([]int, 0, len(bad))
	for l := range bad {
		lines = append(lines, l)
	}
	sort.Ints(lines)
	return p, lines, want
}

// The acceptance at a test's size: 20,000 events with 3 bad rows —
// the 3 named by file and line, exit 1, every good row stored exactly once;
// a second run stores nothing new.
func TestImportTwentyThousandEventsWithThreeBadRows(t *testing.T) {
	t.Parallel()
	const n = 20_000
	pool := testdb.New(t)
	url := testdb.URLOf(t, pool)
	path, badLines, want := importBigFile(t, t.TempDir(), n)

	code, out, errs := tally(t, url, "import", path)
	require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	named := regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(path)+`:(\d+): `).FindAllStringSubmatch(errs, -1)
	var lines []string
	for _, m := range named {
		lines = append(lines, m[1])
	}
	require.Equal(t, []string{fmt.Sprint(badLines[0]), fmt.Sprint(badLines[1]), fmt.Sprint(badLines[2])}, lines, errs)
	require.Contains(t, errs, fmt.Sprintf("%s:%d: malformed JSON", path, badLines[0]))
	require.Contains(t, errs, fmt.Sprintf("%s:%d: tenant: required", path, badLines[1]))
	require.Contains(t, errs, fmt.Sprintf("%s:%d: id: an event with this id was stored before with different content", path, badLines[2]))
	require.Contains(t, errs, "3 bad rows, named above by file and line")
	require.Equal(t, fmt.Sprint(n), importSummary(t, out, "rows read"))
	require.Equal(t, fmt.Sprint(n-3), importSummary(t, out, "accepted"))
	require.Equal(t, "3", importSummary(t, out, "bad rows"))
	require.Equal(t, "1", importSummary(t, out, "files"))
	require.Equal(t, want, importLedger(t, pool), "every good row stored exactly once")

	code, out, errs = tally(t, url, "import", path)
	require.Equal(t, 1, code, errs)
	require.Equal(t, "0", importSummary(t, out, "accepted"), "a second run stores nothing new")
	require.Equal(t, fmt.Sprint(n-3), importSummary(t, out, "duplicates"))
	require.Equal(t, "3", importSummary(t, out, "bad rows"))
	require.Equal(t, want, importLedger(t, pool))
}

// cancelReport is an import's report that ends the import's context
// after its first batch, as an interrupt would, and keeps what it is told.
type cancelReport struct {
	mu      sync.Mutex
	cancel  context.CancelFunc
	batches int
	bad     []string
}

func (r *cancelReport) badRows(file string, rows []badRow) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, row := range rows {
		r.bad = append(r.bad, fmt.Sprintf("%s:%d", filepath.Base(file), row.line))
	}
}

func (r *cancelReport) progress(importStats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.batches++; r.batches == 1 {
		r.cancel()
	}
}

func (r *cancelReport) note(string)            {}
func (r *cancelReport) done(importStats, bool) {}

// An import interrupted after its first batch stops there, with that batch
// stored whole and the summary so far; run again, it stores the rest, and
// every row is stored once.
func TestImportInterruptedThenResumed(t *testing.T) {
	t.Parallel()
	const n = 5_000
	pool := testdb.New(t)
	path, _, want := importBigFile(t, t.TempDir(), n)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	report := &cancelReport{cancel: cancel}
	var out bytes.Buffer
	im := &importer{ingester: &meter.Ingester{}, db: pool, decoder: meter.Decoder{}, batch: 1000, acceptPast: 35 * 24 * time.Hour,
		files: []importFile{{path: path, format: formatJSONL}}, report: report, stdout: &out}
	err := im.run(ctx, context.Background())
	require.ErrorIs(t, err, errImportInterrupted)
	require.Contains(t, err.Error(), fmt.Sprintf("after %s line 1000", path))
	require.Equal(t, 1, report.batches, "it stopped after the batch in flight")
	require.Equal(t, []string{"usage.jsonl:7"}, report.bad, "the first batch's bad row")
	require.Equal(t, "999", importSummary(t, out.String(), "accepted"))
	require.Equal(t, "1000", importSummary(t, out.String(), "rows read"))
	require.Equal(t, "0", importSummary(t, out.String(), "files"), "no file was read to its end")
	require.Len(t, importLedger(t, pool), 999, "the first batch, whole")

	code, out2, errs := tally(t, testdb.URLOf(t, pool), "import", path)
	require.Equal(t, 1, code, errs)
	require.Equal(t, fmt.Sprint(n-3-999), importSummary(t, out2, "accepted"))
	require.Equal(t, "999", importSummary(t, out2, "duplicates"))
	require.Equal(t, want, importLedger(t, pool), "every row stored once")
}

// Usage older than Stripe's 35 days is imported and quarantined as
// timestamp_window, as at the API: a count feature's event in the import's
// own transaction, a sum feature's window at the next staging pass — the
// same items, in the same states, as the API's ingest makes of the same
// events for another tenant. A batch that would make more quarantined
// items than one request may (TALLY_INGEST_MAX_QUARANTINED) is stored in
// smaller transactions rather than refused.
func TestImportOldUsageIsQuarantined(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	env := stagetest.New(t, outbox.Config{})
	env.Target.Account = stripesim.DefaultAccount
	url := testdb.URLOf(t, env.Pool)
	env.Feature(t, "logins", mappings.Count, time.Hour)
	env.Feature(t, "api", mappings.Sum, time.Hour)
	env.Tenant(t, "acme", nil)
	env.Tenant(t, "twin", nil)

	old := time.Now().UTC().Add(-40 * 24 * time.Hour).Truncate(time.Second)
	recent := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Second)
	var (
		csv    strings.Builder
		events []meter.Event
	)
	csv.WriteString("id,tenant,feature,value,timestamp\n")
	add := func(id, feature string, at time.Time) {
		fmt.Fprintf(&csv, "%s,acme,%s,1,%s\n", id, feature, at.Format(time.RFC3339))
		events = append(events, stagetest.Ev(id, "twin", feature, 1, &at))
	}
	for i := 0; i < 12; i++ {
		add(fmt.Sprintf("old-login-%d", i), "logins", old.Add(time.Duration(i)*time.Second))
	}
	add("old-api", "api", old)
	add("new-login", "logins", recent)
	add("new-api", "api", recent)
	file := importWriteFile(t, t.TempDir(), "old.csv", csv.String())

	code, out, errs := tally(t, url, "import", file, "--ingest-max-quarantined", "5",
		"--stripe-api-key", stripesim.DefaultKey, "--stripe-api-base", srv.URL)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	require.Equal(t, "15", importSummary(t, out, "accepted"))
	require.Equal(t, "13", importSummary(t, out, "too old for Stripe"))
	require.Contains(t, out, "older than 35 days: stored, and quarantined as timestamp_window when staged")
	env.MustIngest(t, events...) // the API's ingest, for the twin

	states := func(tenant string) []string {
		rows, err := env.Pool.Query(env.Ctx, `SELECT s || ' ' || count(*) FROM (
			SELECT payload ->> 'feature' || ' ' || state || ' ' || coalesce(quarantine_reason, '-') AS s FROM outbox_items WHERE tenant_key = $1) i
			GROUP BY s ORDER BY s`, tenant)
		require.NoError(t, err)
		s, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return s
	}
	require.Equal(t, []string{"logins pending - 1", "logins quarantined timestamp_window 12"}, states("acme"),
		"the count feature's events are staged in the import's transaction")
	env.Pass(t) // serve's staging pass
	want := []string{"api pending - 1", "api quarantined timestamp_window 1", "logins pending - 1", "logins quarantined timestamp_window 12"}
	require.Equal(t, want, states("acme"))
	require.Equal(t, want, states("twin"), "as at the API")
}

// On a terminal the bar shows the events, their rate, the bytes done of
// the total and the time left; elsewhere a line every so often says the
// same, and each bad row is named by file and line.
func TestImportProgressReports(t *testing.T) {
	t.Parallel()
	const total = 100 << 20
	st := importStats{Rows: 500, Accepted: 400, Duplicates: 100, Bytes: 50 << 20, Elapsed: 2 * time.Second}

	var bar bytes.Buffer
	r := newBarReport(&bar, total)
	r.badRows("u.jsonl", []badRow{{line: 7, reason: "value: required"}})
	r.progress(st)
	r.done(st, true)
	require.Contains(t, bar.String(), "u.jsonl:7: value: required")
	require.Contains(t, bar.String(), "      500 events,    250 events/s")
	require.Regexp(t, `50% \|█+ +\| \(52/105 MB`, bar.String(), "done of the total")
	require.Regexp(t, `\[\d+s:\d+s\]`, bar.String(), "elapsed and time left")

	var log bytes.Buffer
	lr := &logReport{w: &log, every: 0, total: total}
	lr.badRows("u.jsonl", []badRow{{line: 7, reason: "value: required"}})
	lr.progress(st)
	require.Equal(t, "u.jsonl:7: value: required\n"+
		"import: 50.0 MiB of 100.0 MiB (50%) read, 500 rows, 500 events stored or found stored, 0 bad rows, 250 events/s, about 2s left\n", log.String())
	lr.every = time.Hour
	lr.progress(st)
	require.Equal(t, 2, strings.Count(log.String(), "\n"), "no more than a line every so often")
}
