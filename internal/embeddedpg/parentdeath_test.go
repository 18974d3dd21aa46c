//go:build unix

package embeddedpg

import (
	"bufio"
	"context"
	"errors"
	"os"
	"os/exec"
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
// there (guarded by the watchdog when EMBEDDEDPG_HELPER_WATCHDOG is set),
// prints the postmaster pid and waits to be killed.
func TestHelperProcess(t *testing.T) {
	dir := os.Getenv("EMBEDDEDPG_HELPER_DIR")
	if dir == "" {
		t.Skip("helper process only")
	}
	cfg := Config{DataDir: dir, Ephemeral: true, Logger: quietLogger(), watchdog: os.Getenv("EMBEDDEDPG_HELPER_WATCHDOG") != ""}
	c, err := Start(context.Background(), cfg)
	if err != nil {
		os.Stdout.WriteString("error: " + err.Error() + "\n")
		os.Exit(2)
	}
	os.Stdout.WriteString("pid " + strconv.Itoa(c.proc.Pid) + "\n")
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
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "EMBEDDEDPG_HELPER_DIR="+dir)
	if watchdog {
		cmd.Env = append(cmd.Env, "EMBEDDEDPG_HELPER_WATCHDOG=1")
	}
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

	// SIGKILL the parent: the guard must take the postmaster down with it.
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
