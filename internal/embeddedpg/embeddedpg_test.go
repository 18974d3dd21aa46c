package embeddedpg

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
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
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
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

	// Files and ownership.
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

	// A second server on the same data directory is refused, naming the pid.
	_, err = Start(ctx, cfg)
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

func TestFindBinariesWithoutPATH(t *testing.T) {
	t.Setenv("PATH", "")
	dir, err := FindBinaries()
	if err != nil {
		t.Skipf("no PostgreSQL under %s: %v", searchGlob, err)
	}
	if ok, _ := filepath.Match(searchGlob, dir); !ok {
		t.Fatalf("FindBinaries() = %q, want a match of %s", dir, searchGlob)
	}
	for _, b := range []string{"initdb", "postgres"} {
		if !isExecutable(filepath.Join(dir, b)) {
			t.Errorf("%s missing in %s", b, dir)
		}
	}
}

func TestFindBinariesResolvesPATHSymlinks(t *testing.T) {
	t.Setenv("PATH", "")
	real, err := FindBinaries()
	if err != nil {
		t.Skip(err)
	}
	linkDir := t.TempDir()
	for _, b := range []string{"initdb", "postgres"} {
		if err := os.Symlink(filepath.Join(real, b), filepath.Join(linkDir, b)); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", linkDir)
	saved := searchGlob
	searchGlob = filepath.Join(t.TempDir(), "*", "bin")
	t.Cleanup(func() { searchGlob = saved })
	got, err := FindBinaries()
	if err != nil || got != real {
		t.Fatalf("FindBinaries() = %q, %v; want %q", got, err, real)
	}
}

func TestFindBinariesNone(t *testing.T) {
	t.Setenv("PATH", "")
	saved := searchGlob
	searchGlob = filepath.Join(t.TempDir(), "*", "bin")
	t.Cleanup(func() { searchGlob = saved })

	_, err := FindBinaries()
	if !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("err = %v, want ErrNoBinaries", err)
	}
	msg := err.Error()
	if !strings.Contains(msg, "TALLY_DATABASE_URL") || !strings.Contains(msg, "apt-get install postgresql") || strings.Contains(msg, "\n") {
		t.Fatalf("unhelpful message: %q", msg)
	}
	if _, err := Start(context.Background(), Config{DataDir: t.TempDir()}); !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("Start without binaries: %v", err)
	}
}

func TestUnreachableDataDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only meaningful as root")
	}
	locked := filepath.Join(filepath.Dir(tempDataDir(t)), "locked")
	if err := os.Mkdir(locked, 0o700); err != nil {
		t.Fatal(err)
	}
	dataDir := filepath.Join(locked, "x", ".tally")
	_, err := Start(context.Background(), Config{DataDir: dataDir, Logger: quietLogger()})
	if err == nil {
		t.Fatal("Start succeeded under a 0700 root directory")
	}
	msg := err.Error()
	for _, want := range []string{dataDir, "not reachable", locked + " is mode 0700", "TALLY_DATA_DIR"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not mention %q", msg, want)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error is not one line: %q", msg)
	}
	if _, err := os.Stat(filepath.Join(locked, "x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Start created directories before failing: %v", err)
	}
}

// TestFallbackForUnreachableDataDir: a data directory under a directory the
// server user cannot traverse is unreachable, one it can reach is not, and
// the fallback is stable per absolute path, distinct between paths, and
// reachable.
func TestFallbackForUnreachableDataDir(t *testing.T) {
	base := filepath.Dir(tempDataDir(t))
	locked := filepath.Join(base, "locked")
	if err := os.Mkdir(locked, 0o700); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	inLocked, inOpen := filepath.Join(locked, "repo", ".tally"), filepath.Join(open, ".tally")
	if Unreachable(inOpen, "") {
		t.Errorf("%s reported unreachable", inOpen)
	}
	if got, want := Unreachable(inLocked, ""), os.Geteuid() == 0; got != want {
		t.Errorf("Unreachable(%s) = %v, want %v (root: %v)", inLocked, got, want, os.Geteuid() == 0)
	}
	if first, again := Fallback(inLocked), Fallback(filepath.Join(locked, "repo", "..", "repo", ".tally")); first != again || first == Fallback(inOpen) {
		t.Errorf("fallbacks not stable and distinct: %s, %s", Fallback(inLocked), Fallback(inOpen))
	}
	if !strings.HasPrefix(Fallback(inLocked), "/var/tmp/tally-") {
		t.Errorf("fallback %s is not under /var/tmp", Fallback(inLocked))
	}
	if Unreachable(Fallback(inLocked), "") {
		t.Errorf("the fallback %s is itself unreachable", Fallback(inLocked))
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

// TestHelperProcess is not a real test: TestServerDiesWithParent runs the
// test binary again with EMBEDDEDPG_HELPER_DIR set, and this starts a cluster
// there, prints the postmaster pid and waits to be killed.
func TestHelperProcess(t *testing.T) {
	dir := os.Getenv("EMBEDDEDPG_HELPER_DIR")
	if dir == "" {
		t.Skip("helper process only")
	}
	c, err := Start(context.Background(), Config{DataDir: dir, Ephemeral: true, Logger: quietLogger()})
	if err != nil {
		os.Stdout.WriteString("error: " + err.Error() + "\n")
		os.Exit(2)
	}
	os.Stdout.WriteString("pid " + strconv.Itoa(c.proc.Pid) + "\n")
	select {}
}

func TestServerDiesWithParent(t *testing.T) {
	dir := tempDataDir(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "EMBEDDEDPG_HELPER_DIR="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "pid ") {
		t.Fatalf("helper said %q (%v)", line, err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "pid ")))

	// SIGKILL the parent: Pdeathsig must take the postmaster down with it.
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for processAlive(pid) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			t.Fatalf("postmaster %d survived its parent being killed", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// processAlive reports whether pid exists and is not a zombie (an orphan
// may stay a zombie when pid 1 does not reap).
func processAlive(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}
