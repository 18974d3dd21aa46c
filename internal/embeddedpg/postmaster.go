package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// orphanWait bounds how long Start waits for the server of a killed tally
// to exit. The parent-death signal asks for an immediate shutdown, which
// takes seconds at most; the watchdog's fast shutdown becomes an immediate
// one after killGrace and a kill after twice that.
const orphanWait = 30 * time.Second

// checkRunningPostmaster makes sure no server runs on pgdata before Start
// launches one. The caller holds the data directory's lock, so no live
// tally runs a server there. A pid file naming a process that is alive but
// is not a postgres server on pgdata (pid reuse after a crash, common in
// containers) is removed, since postgres itself would refuse to start. A
// server that a tally started on pgdata, as its pid file shows, has lost
// that tally: an orphan shutting down, which it waits for, up to
// orphanWait. Any other server is refused. Telling a postgres server from
// another process reads /proc, so where there is no /proc (macOS) a live
// pid counts as a running server.
func checkRunningPostmaster(ctx context.Context, pgdata string, logger *slog.Logger) error {
	pidPath := filepath.Join(pgdata, "postmaster.pid")
	b, err := readFile(pidPath)
	if err != nil {
		return nil // no pid file, or unreadable: let postgres decide
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return nil
	}
	if pid < 0 {
		pid = -pid // a standalone backend writes its pid negated
	}
	if pid == 0 || pid == os.Getpid() {
		return nil
	}
	if processGone(pid) {
		return nil // stale; postgres handles it
	}
	if notPostmasterOf(pid, pgdata) {
		logger.Warn("removing stale postmaster.pid", "dir", pgdata, "pid", pid)
		if err := os.Remove(pidPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("embeddedpg: remove stale %s: %w", pidPath, err)
		}
		return nil
	}
	if !startedByTally(string(b), pgdata) {
		return fmt.Errorf("embeddedpg: another PostgreSQL server (pid %d) is already running on data directory %s; stop it first", pid, pgdata)
	}
	logger.Info("waiting for the postgres server of an earlier tally, which is shutting down, to exit", "dir", pgdata, "pid", pid)
	return waitGone(ctx, pid, pgdata)
}

// waitGone waits, up to orphanWait, for the orphaned server pid on pgdata
// to exit.
func waitGone(ctx context.Context, pid int, pgdata string) error {
	deadline := time.NewTimer(orphanWait)
	defer deadline.Stop()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for !processGone(pid) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("embeddedpg: waiting for the postgres server (pid %d) of an earlier tally on %s to exit: %w", pid, pgdata, context.Cause(ctx))
		case <-deadline.C:
			return fmt.Errorf("embeddedpg: the postgres server (pid %d) of an earlier tally on data directory %s did not exit within %s; stop it first", pid, pgdata, orphanWait)
		case <-tick.C:
		}
	}
	return nil
}

// startedByTally reports whether the postmaster.pid content pidFile is that
// of a server Start launched on pgdata: its data directory (line 2) is
// pgdata, it has no Unix socket directory (line 5) and it listens on
// listenAddress alone (line 6).
func startedByTally(pidFile, pgdata string) bool {
	lines := strings.Split(pidFile, "\n")
	if len(lines) < 6 {
		return false
	}
	dir := strings.TrimSpace(lines[1])
	if dir != pgdata {
		a, err1 := filepath.EvalSymlinks(dir)
		b, err2 := filepath.EvalSymlinks(pgdata)
		if err1 != nil || err2 != nil || a != b {
			return false
		}
	}
	return strings.TrimSpace(lines[4]) == "" && strings.TrimSpace(lines[5]) == listenAddress
}

// notPostmasterOf reports whether /proc shows that the live process pid is
// not a postgres server running in pgdata. It is false when /proc cannot
// tell.
func notPostmasterOf(pid int, pgdata string) bool {
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil {
		name := strings.TrimSpace(string(comm))
		if name != "postgres" && name != "postmaster" {
			return true
		}
	}
	if cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid)); err == nil {
		want := pgdata
		if r, err := filepath.EvalSymlinks(pgdata); err == nil {
			want = r
		}
		return cwd != want
	}
	return false
}
