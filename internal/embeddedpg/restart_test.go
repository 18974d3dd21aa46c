//go:build unix

package embeddedpg

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestRestartRightAfterKill: three times, the process running a cluster is
// SIGKILLed and another starts on the same data directory at once, as
// systemd or Kubernetes restart a crashed tally; every start must come up
// the first time. The killed process's postmaster is an orphan shutting
// down after the parent-death signal (or its watchdog's), and it exits
// only once its backends have. To make the race certain rather than
// likely, the test stops a backend (SIGSTOP) before the kill and lets it
// go on only once the new start says it waits for the orphan, so that the
// new start always finds it alive. (Stopping the postmaster itself would
// not do: the kernel continues a stopped process whose process group its
// parent's death orphans.) Attach, meanwhile, does not offer the orphan to
// a command. The watchdog, which guards the server on macOS, is tried too.
func TestRestartRightAfterKill(t *testing.T) {
	t.Parallel()
	for _, watchdog := range []bool{false, true} {
		t.Run(map[bool]string{false: "parent-death signal", true: "watchdog"}[watchdog], func(t *testing.T) {
			t.Parallel()
			dir := tempDataDir(t)
			h := startHelper(t, dir, watchdog)
			pid := h.ready(t)
			for i := 0; i < 3; i++ {
				backend := stopBackend(t, dir)
				h.kill()
				if _, ok, err := Attach(dir, "postgres"); ok || err != nil {
					t.Errorf("restart %d: Attach to the orphan: ok %v, %v", i+1, ok, err)
				}
				next := startHelper(t, dir, watchdog)
				waited := next.logged("waiting for the postgres server of an earlier tally")
				if err := syscall.Kill(backend, syscall.SIGCONT); err != nil {
					t.Fatal(err)
				}
				orphan := pid
				pid = next.ready(t)
				if !waited {
					t.Errorf("restart %d: the new start did not say it waited for the orphan", i+1)
				}
				if pid == orphan || processAlive(orphan) {
					t.Fatalf("restart %d: the new server (pid %d) came up while the orphan %d lives", i+1, pid, orphan)
				}
				h = next
			}
			h.kill()
			awaitExit(t, pid)
		})
	}
}

// stopBackend connects to the server running in dir, through Attach, and
// stops (SIGSTOP) the backend serving the connection, so that the server
// cannot finish a shutdown until the backend goes on or the server kills
// it. It returns the backend's pid, which it continues when the test ends.
func stopBackend(t *testing.T, dir string) int {
	t.Helper()
	url, ok, err := Attach(dir, "postgres")
	if !ok || err != nil {
		t.Fatalf("Attach to the running server: ok %v, %v", ok, err)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(ctx) })
	var backend int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(backend, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(backend, syscall.SIGCONT) })
	return backend
}

// helper is a test binary running TestHelperProcess: a process that owns a
// cluster, to be SIGKILLed.
type helper struct {
	cmd  *exec.Cmd
	out  *bufio.Reader
	logs chan string // its log lines, as many as fit
}

// startHelper starts a helper on dir, its server guarded by the watchdog
// when watchdog is set.
func startHelper(t *testing.T, dir string, watchdog bool) *helper {
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
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: cmd, out: bufio.NewReader(out), logs: make(chan string, 100)}
	go func() {
		defer close(h.logs)
		for sc := bufio.NewScanner(stderr); sc.Scan(); {
			select {
			case h.logs <- sc.Text():
			default: // nobody is looking any more
			}
		}
	}()
	t.Cleanup(h.kill)
	return h
}

// logged waits up to 10 s for the helper to log a line holding s, and
// reports whether it did; false too when the helper exits first.
func (h *helper) logged(s string) bool {
	timeout := time.After(10 * time.Second)
	for {
		select {
		case line, ok := <-h.logs:
			if !ok {
				return false
			}
			if strings.Contains(line, s) {
				return true
			}
		case <-timeout:
			return false
		}
	}
}

// ready waits for the helper's cluster and returns its postmaster's pid;
// it fails the test when the helper could not start one.
func (h *helper) ready(t *testing.T) int {
	t.Helper()
	line, err := h.out.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "pid ") {
		t.Fatalf("helper said %q (%v)", line, err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "pid ")))
	return pid
}

// kill SIGKILLs the helper and reaps it; killing it again does nothing.
func (h *helper) kill() {
	_ = h.cmd.Process.Kill()
	_ = h.cmd.Wait()
}

// awaitExit waits for the postmaster pid, orphaned, to exit.
func awaitExit(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for processAlive(pid) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			t.Fatalf("postmaster %d survived its parent being killed", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
