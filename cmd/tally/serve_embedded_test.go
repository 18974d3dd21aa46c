//go:build unix

package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/embeddedpg"
)

// TestServeEmbedded is the acceptance scenario: with a fresh data directory
// (made by mktemp -d: mode 0700, owned by whoever runs the test, root in CI)
// `tally serve` starts PostgreSQL, migrates, answers /healthz and /readyz, and
// on SIGTERM exits cleanly with its PostgreSQL stopped; a second start reuses
// the cluster.
func TestServeEmbedded(t *testing.T) {
	t.Parallel()
	dataDir, err := os.MkdirTemp("", "tally-data-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dataDir, 0o700))
	t.Cleanup(func() { _ = os.RemoveAll(dataDir) })

	for round := 1; round <= 2; round++ {
		addr := freeAddr(t)
		var out bytes.Buffer
		cmd := exec.Command(binary, "serve")
		cmd.Env = append(os.Environ(), "TALLY_DATABASE_URL=", "TALLY_DATA_DIR="+dataDir, "TALLY_LISTEN="+addr)
		cmd.Stdout, cmd.Stderr = &out, &out
		require.NoError(t, cmd.Start())

		deadline := time.Now().Add(60 * time.Second)
		for {
			code, _ := get("http://" + addr + "/readyz?scope=ingest")
			if code == http.StatusOK {
				break
			}
			if time.Now().After(deadline) {
				_ = cmd.Process.Kill()
				t.Fatalf("round %d: not ready in time:\n%s", round, out.String())
			}
			time.Sleep(100 * time.Millisecond)
		}
		code, body := get("http://" + addr + "/healthz")
		require.Equal(t, http.StatusOK, code)
		require.JSONEq(t, `{"status":"ok"}`, body)
		// Without STRIPE_API_KEY export stalls loudly: /readyz fails and
		// says why; ingest's readiness, what a load balancer asks, holds.
		code, body = get("http://" + addr + "/readyz")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.JSONEq(t, `{"status":"not_ready","checks":{"database":"ok","schema":"ok","export":"export stalled: STRIPE_API_KEY is unset"}}`, body)
		code, body = get("http://" + addr + "/readyz?scope=ingest")
		require.Equal(t, http.StatusOK, code)
		require.JSONEq(t, `{"status":"ready","checks":{"database":"ok","schema":"ok"}}`, body)
		code, _ = get("http://" + addr + "/readyz?scope=ingests")
		require.Equal(t, http.StatusBadRequest, code, "a misspelt scope is refused, not taken for the full check")
		// ... and says so in one error line at boot, not one per poll.
		time.Sleep(300 * time.Millisecond)
		errorLines := 0
		for _, line := range strings.Split(out.String(), "\n") {
			if strings.Contains(line, `"level":"ERROR"`) {
				errorLines++
				require.Contains(t, line, "STRIPE_API_KEY is unset")
			}
		}
		require.Equal(t, 1, errorLines, "%s", out.String())
		code, body = get("http://" + addr + "/metrics")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, "tally_outbox_items")
		require.Contains(t, body, `tally_export_stalled{reason="no_key"} 1`)
		require.Contains(t, body, `tally_export_stalled{reason="retrying"} 0`)
		require.Contains(t, body, "tally_ledger_unstaged_events 0")
		// The nodes' workloads connect as the runtime role: privileges
		// enforced by default.
		if round == 1 {
			owner, ok, err := embeddedpg.Attach(dataDir, "tally")
			require.NoError(t, err)
			require.True(t, ok)
			conn, err := pgx.Connect(context.Background(), owner)
			require.NoError(t, err)
			var sessions int
			var member, owns bool
			require.NoError(t, conn.QueryRow(context.Background(), `SELECT
					(SELECT count(*) FROM pg_stat_activity WHERE usename = 'tally_app'),
					pg_has_role('tally_app', 'tally_runtime', 'MEMBER'),
					pg_has_role('tally_app', (SELECT relowner FROM pg_class WHERE oid = 'usage_events'::regclass), 'USAGE')`).
				Scan(&sessions, &member, &owns))
			_ = conn.Close(context.Background())
			require.NotZero(t, sessions, "serve's pools connect as tally_app")
			require.True(t, member)
			require.False(t, owns)
		}
		code, body = get("http://" + addr + "/nope")
		require.Equal(t, http.StatusNotFound, code)
		require.JSONEq(t, `{"error":{"code":"not_found","message":"no such route"}}`, body)

		pid := postmasterPID(t, dataDir)
		require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			require.NoError(t, err, "round %d: tally must exit 0 on SIGTERM:\n%s", round, out.String())
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("round %d: tally did not exit on SIGTERM:\n%s", round, out.String())
		}
		require.NoFileExists(t, filepath.Join(dataDir, "pgdata", "postmaster.pid"), "postgres stopped cleanly")
		require.Error(t, syscall.Kill(pid, 0), "the postmaster is gone")
		require.Contains(t, out.String(), "postgres stopped")
		if round == 2 {
			require.Contains(t, out.String(), `"applied":0`, "the second start reuses the migrated cluster")
		}
	}
}

func postmasterPID(t *testing.T, dataDir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dataDir, "pgdata", "postmaster.pid"))
	require.NoError(t, err)
	var pid int
	_, err = fmt.Sscan(strings.SplitN(string(b), "\n", 2)[0], &pid)
	require.NoError(t, err)
	return pid
}
