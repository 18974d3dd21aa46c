package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// syncBuffer is a bytes.Buffer safe to read while a process writes to it.
type syncBuffer = syncbuf.Buffer

// TestDev is the README's first command as a newcomer runs it: `tally dev`
// in a checkout with no settings — as root in CI, from a checkout under a
// 0700 directory as /root is — serves the API and the simulator, prints a
// curl line, and the usage that line posts reaches the simulator: the count
// feature at once, the sum feature when its minute window closes.
func TestDev(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a minute window to close")
	}
	t.Parallel()
	d := startDev(t)
	d.checkReady()
	d.checkOperatorCommandsFindDev()

	printed := d.out.String()
	d.runCurlLine(printed)
	require.Eventually(t, func() bool { return d.landed("logins") }, 30*time.Second, 200*time.Millisecond,
		"the count event did not reach the simulator:\n%s", d.out)
	require.Eventually(t, func() bool { return d.landed("api_calls") }, 90*time.Second, 500*time.Millisecond,
		"the sum window did not reach the simulator within its minute:\n%s", d.out)

	// As the README says: a reconcile run with no settle delay confirms
	// what reached the simulator.
	d.checkReconcile(printed)

	require.NoError(t, d.cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, d.cmd.Wait(), "%s", d.out)
	require.NotContains(t, d.out.String(), "level=ERROR")
	_, err := os.Stat(d.envFile)
	require.ErrorIs(t, err, os.ErrNotExist, "dev removes dev.env when it stops")
}

// TestDevCitus is TestDev's first steps on a Citus coordinator and two
// workers (TALLY_EMBEDDED_WORKERS=2): the curl line dev prints reaches the
// simulator, and the operator commands beside it, which do not repeat the
// setting, find the coordinator. It needs `make citus`.
func TestDevCitus(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three servers and a node")
	}
	requireCitus(t)
	t.Parallel()
	d := startDev(t, "TALLY_EMBEDDED_WORKERS=2")
	d.citus = true
	d.checkReady()
	require.Contains(t, d.out.String(), "Data: embedded Citus, a coordinator and 2 workers, in ")
	for _, node := range []string{"citus", "citus/worker1", "citus/worker2"} {
		require.Regexp(t, `msg="postgres started" dir=\S+/`+node+" ", d.out.String())
	}
	d.checkOperatorCommandsFindDev()
	d.runCurlLine(d.out.String())
	require.Eventually(t, func() bool { return d.landed("logins") }, 30*time.Second, 200*time.Millisecond,
		"the count event did not reach the simulator:\n%s", d.out)

	require.NoError(t, d.cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, d.cmd.Wait(), "%s", d.out)
	require.NotContains(t, d.out.String(), "level=ERROR")
	require.Equal(t, 3, strings.Count(d.out.String(), `msg="postgres stopped"`), "%s", d.out)
}

// checkOperatorCommandsFindDev runs commands in the checkout with no
// setting, as an operator beside dev would: doctor finds dev's simulator
// through the dev.env dev printed and runs its Stripe checks against it
// (the demo's meters and customers), and a mapping to a customer the
// simulator does not have is refused there as at the API.
func (d *devRun) checkOperatorCommandsFindDev() {
	d.t.Helper()
	m := regexp.MustCompile(`find dev through (\S+) \(mode 0600`).FindStringSubmatch(d.out.String())
	require.NotNil(d.t, m, "dev says where dev.env is:\n%s", d.out)
	d.envFile = m[1]
	fi, err := os.Stat(d.envFile)
	require.NoError(d.t, err)
	require.Equal(d.t, os.FileMode(0o600), fi.Mode().Perm())
	require.NotContains(d.t, d.out.String(), "sk_test_", "dev prints no Stripe key")

	status, out, errs := d.operator("doctor", "--format", "json")
	var results []struct{ Check, Status, Detail string }
	require.NoError(d.t, json.Unmarshal([]byte(out), &results), out)
	got := map[string]string{}
	for _, r := range results {
		got[r.Check] = r.Status + ": " + r.Detail
		require.NotEqual(d.t, "FAIL", r.Status, "%s: %s", r.Check, r.Detail)
	}
	require.Equal(d.t, 0, status, "%s%s", out, errs)
	if d.citus {
		require.Regexp(d.t, `^ok: Citus \S+ on PostgreSQL \S+, 2 workers: .*; tables: [1-9]\d* distributed, [1-9]\d* reference`, got["engine"])
	} else {
		require.Regexp(d.t, `^ok: PostgreSQL \S+, one server`, got["engine"])
	}
	require.Contains(d.t, got["configuration"], "STRIPE_API_KEY, STRIPE_API_BASE, STRIPE_METER_EVENTS_BASE, STRIPE_WEBHOOK_SECRET from "+d.envFile)
	require.Contains(d.t, got["stripe"], "ok: reachable; account acct_sim, test mode")
	require.Contains(d.t, got["meters"], "ok: all 3 mapped features have an active meter")
	require.Contains(d.t, got["customers"], "ok: all 2 mapped tenants' customers exist")
	require.NotContains(d.t, out, "sk_test_", "doctor prints no key")

	status, _, errs = d.operator("mappings", "tenants", "set", "acme", "--customer", "cus_acmee")
	require.Equal(d.t, 1, status, errs)
	require.Contains(d.t, errs, "customer_not_found: Stripe has no customer cus_acmee")
}

// operator runs a tally command in the checkout with no TALLY_ or STRIPE_
// setting, and returns its exit status, stdout and stderr.
func (d *devRun) operator(args ...string) (int, string, string) {
	d.t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Dir = d.checkout
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TALLY_") && !strings.HasPrefix(kv, "STRIPE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), out.String(), errb.String()
	}
	require.NoError(d.t, err, "%s", errb.String())
	return 0, out.String(), errb.String()
}

// devRun is one `tally dev` process of TestDev, run in a checkout of its
// own with no settings.
type devRun struct {
	t        *testing.T
	checkout string
	addr     string // the API's address
	simAddr  string // the simulator's address
	cmd      *exec.Cmd
	out      *syncBuffer // what it prints
	envFile  string      // the dev.env it wrote
	citus    bool        // dev runs a Citus coordinator and workers, its tables placed
}

// startDev starts `tally dev` in a checkout under a 0700 directory, with
// no TALLY_ or STRIPE_ setting but the address to listen on and env, and
// waits for it to say how to stop it.
func startDev(t *testing.T, env ...string) *devRun {
	t.Helper()
	home, err := os.MkdirTemp("", "tally-home-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(home, 0o700))
	checkout := filepath.Join(home, "tally")
	require.NoError(t, os.Mkdir(checkout, 0o755))
	t.Cleanup(func() {
		_ = os.RemoveAll(home)
		_ = os.RemoveAll(embeddedpg.Fallback(filepath.Join(checkout, ".tally")))
	})

	d := &devRun{t: t, checkout: checkout, addr: freeAddr(t), simAddr: freeAddr(t), out: new(syncBuffer)}
	d.cmd = exec.Command(binary, "dev", "--sim-listen", d.simAddr)
	d.cmd.Dir = checkout
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TALLY_") && !strings.HasPrefix(kv, "STRIPE_") {
			d.cmd.Env = append(d.cmd.Env, kv)
		}
	}
	d.cmd.Env = append(d.cmd.Env, "TALLY_LISTEN="+d.addr)
	d.cmd.Env = append(d.cmd.Env, env...)
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	require.NoError(t, d.cmd.Start())
	t.Cleanup(func() { _ = d.cmd.Process.Kill() })

	require.Eventually(t, func() bool { return strings.Contains(d.out.String(), "Stop with Ctrl-C") },
		60*time.Second, 100*time.Millisecond, "dev did not start")
	return d
}

// checkReady checks that, as root, the unreachable default data directory
// moved and dev said so, and that the API is ready.
func (d *devRun) checkReady() {
	d.t.Helper()
	if os.Geteuid() == 0 {
		require.Contains(d.t, d.out.String(), "using="+embeddedpg.Fallback(filepath.Join(d.checkout, ".tally")),
			"as root, the unreachable default data directory moves, and says so")
	}
	code, body := get("http://" + d.addr + "/readyz")
	require.Equal(d.t, http.StatusOK, code, body)
	require.JSONEq(d.t, `{"status":"ready","checks":{"database":"ok","schema":"ok","export":"ok","meters":"ok"}}`, body)
}

// runCurlLine runs the curl line dev printed, as printed.
func (d *devRun) runCurlLine(printed string) {
	d.t.Helper()
	start := strings.Index(printed, "Post usage:\n")
	end := strings.Index(printed, "See it reach Stripe")
	require.True(d.t, start >= 0 && end > start, "no curl line in:\n%s", printed)
	curl := printed[start+len("Post usage:\n") : end]
	res, err := exec.Command("bash", "-c", curl).CombinedOutput()
	require.NoError(d.t, err, "%s", res)
	require.JSONEq(d.t, `{"accepted":2,"duplicates":0,"unmapped":0}`, string(res), "dev maps its example tenant and features")
}

// landed reports whether the simulator recorded an event of the feature
// for cus_acme.
func (d *devRun) landed(feature string) bool {
	code, body := get("http://" + d.simAddr + "/_sim/events")
	if code != http.StatusOK {
		return false
	}
	var got struct {
		Events []struct {
			EventName string `json:"event_name"`
			Customer  string `json:"customer"`
			Status    string `json:"status"`
		}
	}
	if json.Unmarshal([]byte(body), &got) != nil {
		return false
	}
	for _, e := range got.Events {
		if e.EventName == feature && e.Customer == "cus_acme" && e.Status == "recorded" {
			return true
		}
	}
	return false
}

// checkReconcile runs a reconcile run with no settle delay, with the
// admin token dev printed, and checks that it confirms the logins event
// and the api_calls window.
func (d *devRun) checkReconcile(printed string) {
	d.t.Helper()
	var admin string
	for _, line := range strings.Split(printed, "\n") {
		if v, ok := strings.CutPrefix(line, "Admin token:"); ok {
			admin = strings.TrimSpace(v)
		}
	}
	require.NotEmpty(d.t, admin, printed)
	// The simulator records an event before dev records Stripe's answer:
	// the run confirms only what Tally holds as accepted, so wait for both.
	require.Eventually(d.t, func() bool {
		code, body := post(d.t, http.MethodGet, "http://"+d.addr+"/v1/outbox/summary", admin, nil)
		require.Equal(d.t, http.StatusOK, code, body)
		var summary struct {
			Counts map[string]int64 `json:"counts"`
		}
		require.NoError(d.t, json.Unmarshal([]byte(body), &summary))
		return summary.Counts["accepted"] == 2
	}, 30*time.Second, 100*time.Millisecond, "both items accepted before the run")
	code, body := post(d.t, http.MethodPost, "http://"+d.addr+"/v1/reconcile/runs", admin, map[string]string{"settle": "0s"})
	require.Equal(d.t, http.StatusAccepted, code, body)
	var run struct {
		ID             int64  `json:"id"`
		Status         string `json:"status"`
		ItemsConfirmed int64  `json:"items_confirmed"`
		Discrepancies  int    `json:"discrepancies"`
	}
	require.NoError(d.t, json.Unmarshal([]byte(body), &run))
	require.Eventually(d.t, func() bool {
		code, body := post(d.t, http.MethodGet, fmt.Sprintf("http://%s/v1/reconcile/runs/%d", d.addr, run.ID), admin, nil)
		require.Equal(d.t, http.StatusOK, code, body)
		require.NoError(d.t, json.Unmarshal([]byte(body), &run))
		return run.Status == "succeeded" || run.Status == "failed"
	}, 30*time.Second, 100*time.Millisecond)
	require.Equal(d.t, "succeeded", run.Status)
	require.Equal(d.t, int64(2), run.ItemsConfirmed, "the logins event and the api_calls window")
	require.Zero(d.t, run.Discrepancies)
}

// requireCitus skips t without `make citus`'s build, or fails it when
// testdb.EnvRequireCitus is 1.
func requireCitus(t *testing.T) {
	t.Helper()
	if _, err := embeddedpg.FindCitus(); err != nil {
		if os.Getenv(testdb.EnvRequireCitus) == "1" {
			t.Fatalf("%s=1: %v", testdb.EnvRequireCitus, err)
		}
		t.Skip(err)
	}
}
