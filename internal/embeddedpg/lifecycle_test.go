//go:build unix

package embeddedpg

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// tempDataDir returns a not-yet-existing data directory under t.TempDir().
// t.TempDir's per-test parent is created with mode 0700, which the
// unprivileged postgres user could not traverse when the test runs as root.
func tempDataDir(t *testing.T) string {
	t.Helper()
	d := t.TempDir()
	if os.Geteuid() == 0 {
		if err := os.Chmod(filepath.Dir(d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(d, ".tally")
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func startCluster(t *testing.T, cfg Config) *Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Start(ctx, cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = c.Stop(context.Background()) })
	return c
}

func connect(t *testing.T, c *Cluster) *pgx.Conn {
	t.Helper()
	return connectTo(t, c, "postgres")
}

func connectTo(t *testing.T, c *Cluster, database string) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.URL(database))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(ctx) })
	return conn
}

func queryString(t *testing.T, conn *pgx.Conn, sql string) string {
	t.Helper()
	var s string
	if err := conn.QueryRow(context.Background(), sql).Scan(&s); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return s
}

func assertGone(t *testing.T, c *Cluster) {
	t.Helper()
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done() not closed after the server stopped")
	}
	if err := syscall.Kill(c.proc.Pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("postmaster pid %d still exists (kill 0: %v)", c.proc.Pid, err)
	}
}

func TestLifecycle(t *testing.T) {
	dir := tempDataDir(t)
	ctx := context.Background()
	cfg := Config{
		DataDir:   dir,
		Ephemeral: true,
		Logger:    quietLogger(),
		Settings:  map[string]string{"work_mem": "8MB"},
	}

	// First start: initdb and run.
	c := startCluster(t, cfg)
	if c.Port() <= 0 || !strings.Contains(c.URL("postgres"), ":"+strconv.Itoa(c.Port())+"/postgres?sslmode=disable") {
		t.Fatalf("unexpected port %d / URL shape", c.Port())
	}
	conn := connect(t, c)
	if got := queryString(t, conn, "SELECT 1::text"); got != "1" {
		t.Fatalf("SELECT 1 = %q", got)
	}
	if got := queryString(t, conn, "SELECT current_user"); got != "tally" {
		t.Fatalf("current_user = %q, want tally", got)
	}
	for setting, want := range map[string]string{
		"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
		"max_connections": "200", "work_mem": "8MB", "listen_addresses": "127.0.0.1",
		"unix_socket_directories": "", "server_encoding": "UTF8", "lc_collate": "C",
		"password_encryption": "scram-sha-256",
	} {
		if got := queryString(t, conn, "SHOW "+setting); got != want {
			t.Errorf("SHOW %s = %q, want %q", setting, got, want)
		}
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('still here')"); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(ctx)

	// Wrong password is rejected (scram for host connections, not trust).
	bad := strings.Replace(c.URL("postgres"), c.password, "wrong", 1)
	if conn, err := pgx.Connect(ctx, bad); err == nil {
		_ = conn.Close(ctx)
		t.Fatal("connected with a wrong password")
	}

	assertClusterFiles(t, dir)

	// A second server on the same data directory is refused, naming the pid.
	_, err := Start(ctx, cfg)
	if err == nil || !strings.Contains(err.Error(), "pid "+strconv.Itoa(c.proc.Pid)) {
		t.Fatalf("second Start on a running cluster: got %v, want an error naming pid %d", err, c.proc.Pid)
	}

	// Stop, and Stop again.
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	assertGone(t, c)
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("second Stop: %v", err)
	}

	// Reuse: the table survives a restart.
	c2 := startCluster(t, cfg)
	conn2 := connect(t, c2)
	if got := queryString(t, conn2, "SELECT v FROM kept"); got != "still here" {
		t.Fatalf("after restart: %q", got)
	}
	_ = conn2.Close(ctx)

	// The server dying (as if tally were SIGKILLed and postgres with it)
	// closes Done and leaves a stale postmaster.pid that the next start copes with.
	if err := syscall.Kill(-c2.proc.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	assertGone(t, c2)
	if _, err := os.Stat(filepath.Join(dir, "pgdata", "postmaster.pid")); err != nil {
		t.Fatalf("expected a stale postmaster.pid: %v", err)
	}
	if err := c2.Stop(ctx); err != nil {
		t.Fatalf("Stop after death: %v", err)
	}

	c3 := startCluster(t, cfg)
	conn3 := connect(t, c3)
	if got := queryString(t, conn3, "SELECT v FROM kept"); got != "still here" {
		t.Fatalf("after crash restart: %q", got)
	}
	_ = conn3.Close(ctx)

	// Stop with an already-ended context forces the server down and reports it.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := c3.Stop(cctx); err == nil {
		t.Fatal("Stop with a cancelled context returned nil")
	}
	assertGone(t, c3)
	if err := c3.Stop(ctx); err != nil {
		t.Fatalf("Stop after forced stop: %v", err)
	}
}

func TestConfigValidation(t *testing.T) {
	ctx := context.Background()
	if _, err := Start(ctx, Config{}); err == nil || !strings.Contains(err.Error(), "DataDir") {
		t.Errorf("empty DataDir: %v", err)
	}
	dir := tempDataDir(t)
	_, err := Start(ctx, Config{DataDir: dir, Settings: map[string]string{"Port": "1"}})
	if err == nil || !strings.Contains(err.Error(), "Port") {
		t.Errorf("reserved setting: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("invalid config still created %s", dir)
	}
}

func TestRefusesForeignDirectory(t *testing.T) {
	dir := tempDataDir(t)
	if err := os.MkdirAll(filepath.Join(dir, "pgdata"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pgdata", "important"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Start(context.Background(), Config{DataDir: dir, Logger: quietLogger()})
	if err == nil || !strings.Contains(err.Error(), "not a PostgreSQL cluster") {
		t.Fatalf("got %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "pgdata", "important")); err != nil {
		t.Fatalf("foreign file was touched: %v", err)
	}
}

// assertClusterFiles checks the files Start leaves in dir: the password file
// private to tally, pgdata and the server log owned by the server's user
// when tally is root, and nothing left over from initdb.
func assertClusterFiles(t *testing.T, dir string) {
	t.Helper()
	fi, err := os.Stat(filepath.Join(dir, "password"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("password file: %v, mode %v", err, fi.Mode())
	}
	if os.Geteuid() == 0 {
		want := "postgres"
		if _, err := user.Lookup("postgres"); err != nil {
			want = "nobody"
		}
		u, _ := user.Lookup(want)
		for _, p := range []string{"pgdata", "postgres.log"} {
			fi, err := os.Stat(filepath.Join(dir, p))
			if err != nil {
				t.Fatal(err)
			}
			if uid := fi.Sys().(*syscall.Stat_t).Uid; strconv.Itoa(int(uid)) != u.Uid {
				t.Errorf("%s owned by uid %d, want %s (%s)", p, uid, u.Uid, want)
			}
		}
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".*"))
	if _, err := os.Stat(filepath.Join(dir, initdbTmpName)); err == nil || len(leftovers) > 0 {
		t.Errorf("initdb leftovers in %s: %v", dir, leftovers)
	}
}
