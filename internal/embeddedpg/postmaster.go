package embeddedpg

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// checkRunningPostmaster fails when postmaster.pid names a live postgres
// process running on pgdata. A pid file naming a process that is alive but is
// not a postgres server on pgdata (pid reuse after a crash, common in
// containers) is removed, since postgres itself would refuse to start.
// Telling the two apart reads /proc, so where there is no /proc (macOS) a
// live pid counts as a running server.
func checkRunningPostmaster(pgdata string, logger *slog.Logger) error {
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
	if !processExists(pid) {
		return nil // stale; postgres handles it
	}
	if notPostmasterOf(pid, pgdata) {
		logger.Warn("removing stale postmaster.pid", "dir", pgdata, "pid", pid)
		if err := os.Remove(pidPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("embeddedpg: remove stale %s: %w", pidPath, err)
		}
		return nil
	}
	return fmt.Errorf("embeddedpg: another PostgreSQL server (pid %d) is already running on data directory %s; stop it first", pid, pgdata)
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
