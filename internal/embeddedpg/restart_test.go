//go:build unix

package embeddedpg

import (
	"bufio"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestRestartRightAfterKill: three times, the process running a cluster is
// SIGKILLed and another starts on the same data directory at once, as
// systemd or Kubernetes restart a crashed tally; every start must come up
// the first time. The killed process's postmaster is an orphan shutting
// down after the parent-death signal (or its watchdog's); to make the race
// certain rather than likely, the test stops the postmaster (SIGSTOP) before
// the kill and lets it go on only once the new start has begun, so that
// the new start always finds it alive. Attach, meanwhile, does not offer
// the orphan to a command. The watchdog, which guards the server on macOS,
// is tried too.
func TestRestartRightAfterKill(t *testing.T) {
	t.Parallel()
	for _, watchdog := range []bool{false, true} {
		t.Run(map[bool]string{false: "parent-death signal", true: "watchdog"}[watchdog], func(t *testing.T) {
			t.Parallel()
			dir := tempDataDir(t)
			h := startHelper(t, dir, watchdog)
			pid := h.ready(t)
			for i := 0; i < 3; i++ {
				if _, ok, err := Attach(dir, "postgres"); !ok || err != nil {
					t.Fatalf("restart %d: Attach to the running server: ok %v, %v", i+1, ok, err)
				}
				if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
					t.Fatal(err)
				}
				defer syscall.Kill(pid, syscall.SIGCONT) // never leave it stopped, even on failure
				h.kill()
				if _, ok, err := Attach(dir, "postgres"); ok || err != nil {
					t.Errorf("restart %d: Attach to the orphan: ok %v, %v", i+1, ok, err)
				}
				next := startHelper(t, dir, watchdog)
				time.Sleep(300 * time.Millisecond) // the new start finds the orphan alive
				if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
					t.Fatal(err)
				}
				orphan := pid
				pid = next.ready(t)
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

// helper is a test binary running TestHelperProcess: a process that owns a
// cluster, to be SIGKILLed.
type helper struct {
	cmd *exec.Cmd
	out *bufio.Reader
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
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: cmd, out: bufio.NewReader(out)}
	t.Cleanup(h.kill)
	return h
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
