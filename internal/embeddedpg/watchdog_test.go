//go:build unix

package embeddedpg

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestWatchdogTarget is not a real test: the watchdog tests run the test
// binary again with EMBEDDEDPG_WATCHDOG_TARGET set, and this stands in for
// a postmaster: it says "ready", then exits 0 on SIGINT (a fast shutdown
// request), saying "interrupted", and 3 if none comes within 30 s.
func TestWatchdogTarget(t *testing.T) {
	if os.Getenv("EMBEDDEDPG_WATCHDOG_TARGET") == "" {
		t.Skip("helper process only")
	}
	interrupted := make(chan os.Signal, 1)
	signal.Notify(interrupted, os.Interrupt) // even if the shell ignored SIGINT
	os.Stdout.WriteString("ready\n")
	select {
	case <-interrupted:
		os.Stdout.WriteString("interrupted\n")
		os.Exit(0)
	case <-time.After(30 * time.Second):
		os.Exit(3)
	}
}

// target is a stand-in postmaster with its postmaster.pid file.
type target struct {
	cmd     *exec.Cmd
	out     *bufio.Reader
	pidFile string
}

func startTarget(t *testing.T) *target {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestWatchdogTarget$", "-test.count=1")
	cmd.Env = append(os.Environ(), "EMBEDDEDPG_WATCHDOG_TARGET=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	tg := &target{cmd: cmd, out: bufio.NewReader(stdout), pidFile: filepath.Join(t.TempDir(), "postmaster.pid")}
	if line, err := tg.out.ReadString('\n'); line != "ready\n" {
		t.Fatalf("target said %q (%v)", line, err)
	}
	tg.writePidFile(t, cmd.Process.Pid)
	return tg
}

func (tg *target) writePidFile(t *testing.T, pid int) {
	t.Helper()
	if err := os.WriteFile(tg.pidFile, []byte(strconv.Itoa(pid)+"\n/data\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// assertAlive fails if the target has exited within a short while.
func (tg *target) assertAlive(t *testing.T) {
	t.Helper()
	time.Sleep(300 * time.Millisecond)
	if !processAlive(tg.cmd.Process.Pid) {
		t.Fatal("the watchdog stopped the target")
	}
}

// TestWatchdogStopsServerWhenTallyDies: the pipe closing without a line is
// tally's death; the watchdog asks the server for a fast shutdown and says
// why in the server's log.
func TestWatchdogStopsServerWhenTallyDies(t *testing.T) {
	tg := startTarget(t)
	var log bytes.Buffer
	w, err := startWatchdog(tg.cmd.Process.Pid, tg.pidFile, nil, &log)
	if err != nil {
		t.Fatal(err)
	}
	_ = w.stdin.Close() // what the kernel does when tally dies
	if line, err := tg.out.ReadString('\n'); line != "interrupted\n" {
		t.Fatalf("target said %q (%v), want a SIGINT", line, err)
	}
	if err := tg.cmd.Wait(); err != nil {
		t.Fatalf("target: %v", err)
	}
	if err := w.cmd.Wait(); err != nil {
		t.Fatalf("watchdog: %v", err)
	}
	if want := "tally exited without stopping postgres; stopping postgres (pid " + strconv.Itoa(tg.cmd.Process.Pid) + ")"; !strings.Contains(log.String(), want) {
		t.Errorf("watchdog said %q, want %q", log.String(), want)
	}
}

// TestWatchdogReleased: once tally has seen the postmaster exit, the
// watchdog exits without signalling anything.
func TestWatchdogReleased(t *testing.T) {
	tg := startTarget(t)
	w, err := startWatchdog(tg.cmd.Process.Pid, tg.pidFile, nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	w.release()
	if !w.cmd.ProcessState.Success() {
		t.Fatalf("watchdog exited %v", w.cmd.ProcessState)
	}
	tg.assertAlive(t)
}

// TestWatchdogSparesRecycledPid: when postmaster.pid names another process
// than the one watched, the watched pid may belong to someone else by now,
// and the watchdog leaves it alone.
func TestWatchdogSparesRecycledPid(t *testing.T) {
	for name, spoil := range map[string]func(t *testing.T, tg *target){
		"another pid": func(t *testing.T, tg *target) { tg.writePidFile(t, tg.cmd.Process.Pid+1) },
		// The server removes its pid file when it exits: a pid without one
		// is no longer the server's.
		"no pid file": func(t *testing.T, tg *target) {
			if err := os.Remove(tg.pidFile); err != nil {
				t.Fatal(err)
			}
		},
	} {
		t.Run(name, func(t *testing.T) { watchdogSpares(t, spoil) })
	}
}

func watchdogSpares(t *testing.T, spoil func(*testing.T, *target)) {
	tg := startTarget(t)
	spoil(t, tg)
	var log bytes.Buffer
	w, err := startWatchdog(tg.cmd.Process.Pid, tg.pidFile, nil, &log)
	if err != nil {
		t.Fatal(err)
	}
	_ = w.stdin.Close()
	if err := w.cmd.Wait(); err != nil {
		t.Fatalf("watchdog: %v", err)
	}
	tg.assertAlive(t)
	if log.Len() > 0 {
		t.Errorf("watchdog said %q", log.String())
	}
}
