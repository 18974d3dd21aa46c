package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tally-bin-")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "tally")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building tally: %v\n%s", err, out)
		os.Exit(1)
	}
	defer os.RemoveAll(dir)
	// The tests post usage dated up to hours back, and in the first hours
	// of a month that usage belongs to a period whose invoice closed an
	// hour after it ended: under the default policy it would be
	// quarantined period_closed, and a test of something else would fail
	// on the 1st of every month. Every binary the tests start inherits
	// this; the late-usage tests set the grace they test (a flag beats
	// the environment).
	if err := os.Setenv("TALLY_INVOICE_GRACE", "72h"); err != nil {
		panic(err)
	}
	testdb.Main(m)
}

// freeAddr returns a loopback address for a process the test starts to
// listen on. It is free when returned, and its port is outside the
// kernels' ephemeral ranges (Linux 32768-60999, macOS and Windows
// 49152-65535): a port the kernel handed out for 127.0.0.1:0 could be
// handed out again, as the local port of any outgoing connection (the
// tests open hundreds to Postgres) or another :0 listener, between this
// check and the process's bind ("address already in use", seen once in
// CI). Ports are never handed out twice by one test binary.
func freeAddr(t *testing.T) string {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		port := 20000 + rand.IntN(10000)
		if portsGiven[port] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		addr := l.Addr().String()
		require.NoError(t, l.Close())
		portsGiven[port] = true
		return addr
	}
	t.Fatal("no free port in 20000-29999")
	return ""
}

var (
	portsMu    sync.Mutex
	portsGiven = map[int]bool{}
)

func get(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

func TestMigrateExternalDatabase(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t) // already migrated: migrate is a no-op, twice
	for i := 0; i < 2; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		out, err := exec.CommandContext(ctx, binary, "migrate", "--database-url", url).CombinedOutput()
		cancel()
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), "migrations applied")
		require.NotContains(t, string(out), url, "the URL carries a password and is never printed")
	}
}

func TestConfigurationErrorsStopBeforeAnythingStarts(t *testing.T) {
	t.Parallel()
	dataDir := t.TempDir()
	cases := []struct {
		args []string
		env  []string
		want []string
	}{
		{[]string{"serve", "--outbox-horizon", "25h"}, nil, []string{"horizon 25h0m0s must be below the provider's dedup window"}},
		{[]string{"serve"}, []string{"TALLY_OUTBOX_LEASE=forever", "TALLY_OUTBOX_MAX_ATTEMPTS=0x"},
			[]string{"TALLY_OUTBOX_LEASE: not a duration", "TALLY_OUTBOX_MAX_ATTEMPTS: not a whole number"}},
		{[]string{"serve", "--log-format", "xml", "--outbox-backoff-base", "1h"}, nil,
			[]string{"TALLY_LOG_FORMAT must be text or json", "backoff base 1h0m0s is above the cap 15m0s"}},
		{[]string{"serve", "extra"}, nil, []string{"unexpected arguments"}},
		{[]string{"frobnicate"}, nil, []string{`unknown command "frobnicate"`}},
		// Stripe's v2 API takes only secret keys (docs.stripe.com/api-v2-overview).
		{[]string{"serve"}, []string{"STRIPE_API_KEY=rk_test_restricted", "TALLY_EXPORTER=stripe_meter_event_stream"},
			[]string{"restricted"}},
		{[]string{"serve"}, []string{"STRIPE_API_KEY=rk_test_restricted", "STRIPE_WEBHOOK_SECRET=whsec_x"},
			[]string{"restricted"}},
	}
	for _, tc := range cases {
		cmd := exec.Command(binary, tc.args...)
		cmd.Env = append(append(os.Environ(), "TALLY_DATA_DIR="+dataDir), tc.env...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "%v", tc.args)
		require.Equal(t, 2, ee.ExitCode(), "%s", out)
		for _, w := range tc.want {
			require.Contains(t, string(out), w)
		}
		entries, _ := os.ReadDir(dataDir)
		require.Empty(t, entries, "nothing started: no cluster was created")
	}
}

// A restricted key meets a feature mapping that names the v2 stream: serve
// refuses to start, naming the feature, before it starts anything — the
// stream's items could never be sent.
func TestRestrictedKeyWithAStreamFeatureRefusesToStart(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	code, _, errs := tally(t, url, "mappings", "features", "set", "logins", "--event-name", "logins", "--aggregation", "count",
		"--exporter", "stripe_meter_event_stream")
	require.Equal(t, 0, code, errs)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "serve", "--listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "TALLY_DATABASE_URL="+url, "STRIPE_API_KEY=rk_test_restricted",
		"STRIPE_API_BASE=http://127.0.0.1:1", "TALLY_LOG_LEVEL=error")
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "%s", out)
	require.NoError(t, ctx.Err(), "it stopped by itself")
	require.Contains(t, string(out), "restricted key")
	require.Contains(t, string(out), "logins")
	require.NotContains(t, string(out), "rk_test_restricted", "the key is never printed")
}

// tally runs the binary against url and returns its exit code, stdout and
// stderr.
func tally(t *testing.T, url string, args ...string) (int, string, string) {
	t.Helper()
	return tallyEnv(t, []string{"TALLY_DATABASE_URL=" + url}, args...)
}

// tallyEnv is tally with env (TALLY_DATABASE_URL among it) added to the
// test's environment.
func tallyEnv(t *testing.T, env []string, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := exec.Command(binary, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return code, out.String(), errb.String()
}

func TestOperatorCommands(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)

	code, out, errs := tally(t, url, "tokens", "create", "--role", "ingest", "--tenant", "acme", "--name", "svc")
	require.Equal(t, 0, code, errs)
	secret := strings.TrimSpace(out)
	require.True(t, strings.HasPrefix(secret, "tly_tok_"), out)
	require.Contains(t, errs, "shown once")
	code, out, _ = tally(t, url, "tokens", "list")
	require.Equal(t, 0, code)
	require.Contains(t, out, "svc")
	require.NotContains(t, out, secret)
	code, _, errs = tally(t, url, "tokens", "create", "--role", "root")
	require.Equal(t, 2, code, errs)

	code, out, errs = tally(t, url, "mappings", "features", "set", "api", "--event-name", "api_calls", "--aggregation", "sum", "--window", "15m")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, `"changed": true`)
	code, out, _ = tally(t, url, "mappings", "features", "get", "api")
	require.Equal(t, 0, code)
	require.Contains(t, out, `"window": "15m0s"`)
	code, _, errs = tally(t, url, "mappings", "features", "set", "api", "--event-name", "api_calls", "--aggregation", "avg")
	require.Equal(t, 2, code, "invalid input is a usage error")
	require.Contains(t, errs, "aggregation")
	code, _, errs = tally(t, url, "mappings", "tenants", "set", "acme", "--customer", "cus_1", "--anchor", "2026-01-15T00:00:00Z")
	require.Equal(t, 0, code, errs)
	code, _, _ = tally(t, url, "mappings", "features", "frobnicate")
	require.Equal(t, 2, code)

	code, out, errs = tally(t, url, "quarantine", "--format", "csv")
	require.Equal(t, 0, code, errs)
	require.Equal(t, "reason,tenant,feature,period,items,events,value\n", out)
	code, _, _ = tally(t, url, "quarantine", "--format", "xml")
	require.Equal(t, 2, code)

	code, out, errs = tally(t, url, "report", "completeness", "--period", "2026-11", "--format", "json")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, `"holds": true`)
	code, _, _ = tally(t, url, "report", "completeness")
	require.Equal(t, 2, code, "the period is required")

	code, _, errs = tally(t, url, "requeue", "12345", "--mapping-version", "1")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "no such item")
	code, _, _ = tally(t, url, "requeue", "12345")
	require.Equal(t, 2, code, "the mapping version is required")

	code, _, errs = tally(t, url, "reconcile")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "no Stripe key")

	// Recovery of two uncertain items: one by hand, one by a plan whose
	// lease token is out of date.
	ids := uncertainItems(t, url, 2)
	code, _, errs = tally(t, url, "recover", fmt.Sprint(ids[0]), "--to", "pending")
	require.Equal(t, 2, code, errs)
	code, out, errs = tally(t, url, "recover", fmt.Sprint(ids[0]), "--expect", "uncertain", "--to", "pending",
		"--not-reached", "--reason", "every attempt failed before recording")
	require.Equal(t, 0, code, errs)
	require.Equal(t, fmt.Sprintf("item %d: uncertain -> pending\n", ids[0]), out)
	code, _, errs = tally(t, url, "recover", fmt.Sprint(ids[0]), "--expect", "uncertain", "--to", "rejected", "--reason", "x")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "expected_state_mismatch: item")
	require.Contains(t, errs, "is pending, not uncertain")

	plan := filepath.Join(t.TempDir(), "plan.json")
	require.NoError(t, os.WriteFile(plan, []byte(fmt.Sprintf(`{"run_id":1,"created":"2026-11-30T00:00:00Z","unplanned_discrepancies":0,
		"actions":[{"item":%d,"expect":"uncertain","to":"accepted","lease_token":99,"reason":"test","evidence":{}}]}`, ids[1])), 0o600))
	code, out, errs = tally(t, url, "recover", "--plan", plan)
	require.Equal(t, 1, code, errs)
	require.Contains(t, out, "refused: item")
	require.Contains(t, errs, "1 of 1 recoveries refused")
	require.NoError(t, os.WriteFile(plan, []byte(`{"actions":[],"surprise":1}`), 0o600))
	code, _, errs = tally(t, url, "recover", "--plan", plan)
	require.Equal(t, 2, code, errs)
}

// uncertainItems enqueues n items straight into the outbox of url and
// brings each to uncertain, as an answer that may have reached Stripe past
// the cap would.
func uncertainItems(t *testing.T, url string, n int) []int64 {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	store, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	items := make([]outbox.NewItem, n)
	for i := range items {
		items[i] = outbox.NewItem{Identity: outbox.Identity{TenantKey: "acme", SubjectKind: outbox.SubjectUsageWindow,
			SubjectRef: fmt.Sprintf("usage:api:cli#%d", i), Exporter: "stripe_meter_events", DestinationAccount: "acct_1",
			Mode: outbox.ModeTest, MappingVersion: 1},
			Payload: outbox.Payload{Customer: "cus_1", EventName: "api_calls", Value: 1, Timestamp: time.Now().Unix(), Feature: "api", Period: "2026-11-01T00:00:00Z"}}
	}
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := store.EnqueueBatch(ctx, tx, items)
		return err
	}))
	leases, err := store.Claim(ctx, pool, outbox.ClaimOptions{Owner: "test", Limit: n, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, n)
	var ids []int64
	var outcomes []outbox.Outcome
	for _, l := range leases {
		ids = append(ids, l.ID)
		outcomes = append(outcomes, outbox.Outcome{Lease: l, Kind: outbox.Uncertain, Error: outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}})
	}
	_, err = store.Record(ctx, pool, outcomes)
	require.NoError(t, err)
	return ids
}

// TestStripeSimCommand runs `tally stripe-sim` as a user would: its meters
// and customers from flags, a meter event posted with the key it prints,
// the event in its record, and a clean exit on SIGTERM. A malformed --meter
// is a usage error.
func TestStripeSimCommand(t *testing.T) {
	t.Parallel()
	out, err := exec.Command(binary, "stripe-sim", "--meter", "api_calls").CombinedOutput()
	require.Error(t, err)
	require.Equal(t, 2, err.(*exec.ExitError).ExitCode(), "%s", out)
	require.Contains(t, string(out), "want EVENT_NAME:FORMULA")

	addr := freeAddr(t)
	var buf bytes.Buffer
	cmd := exec.Command(binary, "stripe-sim", "--sim-listen", addr, "--meter", "api_calls:sum", "--customer", "cus_demo")
	cmd.Stdout, cmd.Stderr = &buf, &buf
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	base := "http://" + addr
	call := func(method, path, form string) (int, string) {
		req, err := http.NewRequest(method, base+path, strings.NewReader(form))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer sk_test_sim")
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		return resp.StatusCode, b.String()
	}
	require.Eventually(t, func() bool { code, _ := call("GET", "/v1/account", ""); return code == 200 }, 20*time.Second, 50*time.Millisecond, "%s", &buf)
	require.Contains(t, buf.String(), "STRIPE_API_BASE="+base+" STRIPE_METER_EVENTS_BASE="+base+" STRIPE_API_KEY=sk_test_sim")
	code, body := call("GET", "/v1/billing/meters", "")
	require.Equal(t, 200, code, body)
	require.Contains(t, body, `"event_name":"api_calls"`)
	code, body = call("POST", "/v1/billing/meter_events",
		fmt.Sprintf("event_name=api_calls&identifier=tly_cmd_test&payload[stripe_customer_id]=cus_demo&payload[value]=7&timestamp=%d", time.Now().Unix()-60))
	require.Equal(t, 200, code, body)
	code, body = get(base + "/_sim/events")
	require.Equal(t, 200, code, body)
	require.Contains(t, body, "tly_cmd_test")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "%s", &buf)
}

// TestDoctorCommand: on a healthy setup tally doctor exits 0 with every
// check ok; without a key, or with a database it cannot reach, it exits 1
// and says how to fix it. (cmd/tally/doctor tests each check's failures.)
func TestDoctorCommand(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	url := testdb.URL(t)
	stripe := []string{"--stripe-api-key", stripesim.DefaultKey, "--stripe-api-base", srv.URL, "--stripe-webhook-secret", "whsec_doctor"}

	code, out, errs := tally(t, url, append([]string{"doctor"}, stripe...)...)
	require.Equal(t, 0, code, "%s%s", out, errs)
	for _, check := range []string{"configuration", "database", "migrations", "clock", "stripe", "mappings", "meters"} {
		require.Regexp(t, `(?m)^ok\s+`+check+`\s`, out)
	}
	require.NotContains(t, out, stripesim.DefaultKey)

	code, out, errs = tally(t, url, "doctor")
	require.Equal(t, 1, code)
	require.Contains(t, out, "STRIPE_API_KEY is unset")
	require.Contains(t, out, "fix: set STRIPE_API_KEY")
	require.Contains(t, errs, "problems found")

	code, out, _ = tally(t, "postgres://tally:s3cret@127.0.0.1:1/tally?connect_timeout=2", append([]string{"doctor", "--format", "json"}, stripe...)...)
	require.Equal(t, 1, code)
	require.Contains(t, out, `"check": "database"`)
	require.Contains(t, out, "did not answer")
	require.NotContains(t, out, "s3cret")
}

// -h states the logging defaults the command runs with: json only for
// serve, text for the rest; warn for the operator commands.
func TestHelpStatesEachCommandsLogDefaults(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ cmd, format, level string }{
		{"serve", "json", "info"}, {"dev", "text", "info"}, {"doctor", "text", "warn"},
	} {
		var out, errb bytes.Buffer
		require.Equal(t, 0, run([]string{c.cmd, "-h"}, func(string) string { return "" }, &out, &errb), c.cmd)
		help := regexp.MustCompile(`\s+`).ReplaceAllString(errb.String(), " ")
		require.Contains(t, help, `-log-format value log format: text or json (default: json for serve, text for dev and the operator commands) (env TALLY_LOG_FORMAT) (default "`+c.format+`")`, c.cmd)
		require.Contains(t, help, `(env TALLY_LOG_LEVEL) (default "`+c.level+`")`, c.cmd)
	}
}
