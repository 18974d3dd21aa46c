//go:build unix

package embeddedpg

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestHelperProcess is not a real test: TestServerDiesWithParent runs the
// test binary again with EMBEDDEDPG_HELPER_DIR set, and this starts a cluster
// there (guarded by the watchdog when EMBEDDEDPG_HELPER_WATCHDOG is set; a
// Citus coordinator and two workers from EMBEDDEDPG_HELPER_CITUS's binaries
// when that is set), logging to stderr, prints each postmaster's pid and
// waits to be killed.
func TestHelperProcess(t *testing.T) {
	dir := os.Getenv("EMBEDDEDPG_HELPER_DIR")
	if dir == "" {
		t.Skip("helper process only")
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil)) // for the test to follow
	cfg := Config{DataDir: dir, Ephemeral: true, Logger: logger, watchdog: os.Getenv("EMBEDDEDPG_HELPER_WATCHDOG") != ""}
	if bin := os.Getenv("EMBEDDEDPG_HELPER_CITUS"); bin != "" {
		cfg.Workers, cfg.BinDir = 2, bin
	}
	c, err := Start(context.Background(), cfg)
	if err != nil {
		os.Stdout.WriteString("error: " + err.Error() + "\n")
		os.Exit(2)
	}
	for _, n := range append([]*Cluster{c}, c.workers...) {
		os.Stdout.WriteString("pid " + strconv.Itoa(n.proc.Pid) + "\n")
	}
	select {}
}

// TestServerDiesWithParent: SIGKILL the process that started a cluster and
// its guard must take the postmaster down with it: on Linux the parent-death
// signal, an immediate shutdown; elsewhere (macOS) the watchdog.
func TestServerDiesWithParent(t *testing.T) {
	dir := tempDataDir(t)
	killParentOfCluster(t, dir, false)
	if kernelDeathSignal {
		assertLogged(t, dir, "received immediate shutdown request")
	} else {
		assertLogged(t, dir, "embeddedpg watchdog: tally exited without stopping postgres", "received fast shutdown request")
	}
}

// TestServerDiesWithParentWatchdog runs the watchdog where the kernel would
// otherwise guard the server (Linux), so that the path macOS takes is tested
// here too: with no parent-death signal asked for, only the watchdog can
// stop the postmaster, and it asks for a fast shutdown.
func TestServerDiesWithParentWatchdog(t *testing.T) {
	dir := tempDataDir(t)
	killParentOfCluster(t, dir, true)
	assertLogged(t, dir, "embeddedpg watchdog: tally exited without stopping postgres", "received fast shutdown request")
}

// killParentOfCluster has a helper process start a cluster in dir, SIGKILLs
// the helper, and waits for the postmaster to go away.
func killParentOfCluster(t *testing.T, dir string, watchdog bool) {
	t.Helper()
	h := startHelper(t, dir, watchdog)
	pid := h.ready(t)
	h.kill() // the guard must take the postmaster down with it
	awaitExit(t, pid)
}

// assertLogged fails unless the server log in dir holds every one of lines,
// waiting a little for writers that are still exiting.
func assertLogged(t *testing.T, dir string, lines ...string) {
	t.Helper()
	var log []byte
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		log, _ = os.ReadFile(filepath.Join(dir, logName))
		missing := false
		for _, l := range lines {
			missing = missing || !strings.Contains(string(log), l)
		}
		if !missing {
			return
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Fatalf("server log lacks %q:\n%s", lines, log)
}

// processAlive reports whether pid exists and is not a zombie (an orphan
// may stay a zombie when pid 1 does not reap). Without /proc (macOS), where
// launchd reaps orphans, existing is alive.
func processAlive(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return runtime.GOOS != "linux"
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}
