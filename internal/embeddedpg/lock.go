package embeddedpg

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// lockName is the lock file in the data directory.
const lockName = "tally.lock"

// How often, and how far apart, taking a busy lock is tried again, so that
// a short look by another process is not taken for an owner (0.5 s in
// all).
const (
	lockAttempts   = 10
	lockRetryDelay = 50 * time.Millisecond
)

// dirLock is the lock on DataDir/tally.lock that a process holds while it
// runs the data directory's server: from before initdb until the server
// exits or Stop returns. The kernel drops it when the process dies, however
// it dies, and no child inherits it (the descriptor is close-on-exec), so a
// live server on a data directory whose lock is free has lost its tally:
// an orphan on its way down after the parent-death signal or the watchdog.
type dirLock struct {
	f    *os.File
	once sync.Once
}

// errLockBusy is what lockFile returns when another process holds the
// lock.
var errLockBusy = errors.New("lock held by another process")

// lockDataDir takes the lock of dataDir, whose cluster is pgdata. When
// another process holds it, it returns an error naming the server that
// process runs, if any.
func lockDataDir(dataDir, pgdata string) (*dirLock, error) {
	path := filepath.Join(dataDir, lockName)
	f, err := openFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: lock file: %w", err)
	}
	for attempt := 1; ; attempt++ {
		err = lockFile(f)
		if !errors.Is(err, errLockBusy) || attempt == lockAttempts {
			break
		}
		time.Sleep(lockRetryDelay)
	}
	if err == nil {
		return &dirLock{f: f}, nil
	}
	_ = f.Close()
	if !errors.Is(err, errLockBusy) {
		return nil, fmt.Errorf("embeddedpg: lock %s: %w", path, err)
	}
	if pid, _, perr := readPostmasterPID(filepath.Join(pgdata, "postmaster.pid")); perr == nil && !processGone(pid) {
		return nil, fmt.Errorf("embeddedpg: another PostgreSQL server (pid %d) is already running on data directory %s, run by another process; stop it first", pid, dataDir)
	}
	return nil, fmt.Errorf("embeddedpg: another process is starting a PostgreSQL server on data directory %s (it holds %s); stop it first", dataDir, path)
}

// release gives the lock up; releasing it again, or a nil lock, does
// nothing.
func (l *dirLock) release() {
	if l == nil {
		return
	}
	l.once.Do(func() { _ = l.f.Close() })
}

// ownerless reports whether dataDir's lock file exists and no process
// holds its lock, so that no live process runs a server there, whatever
// postmaster.pid says. It is false when that cannot be told (no lock file,
// or one this user may not open).
func ownerless(dataDir string) bool {
	f, err := openFile(filepath.Join(dataDir, lockName), os.O_RDONLY, 0)
	if err != nil {
		return false
	}
	defer f.Close() // and with it the lock probeLock took
	return probeLock(f)
}

// Abandoned reports whether dataDir, a directory Start ran a cluster in,
// is no longer any process's: its lock is free, the server its
// postmaster.pid names, if any, has exited, and its lock file is over a
// minute old (a process that has just made it may not hold it yet); and so
// for each worker's directory in it. A directory it cannot tell about (no
// lock file, or one this user may not open) is not abandoned, so that a
// caller removes only what a dead process left.
func Abandoned(dataDir string) bool {
	workers, err := filepath.Glob(filepath.Join(dataDir, workerDirPrefix+"*"))
	if err != nil {
		return false
	}
	for _, d := range append([]string{dataDir}, workers...) {
		st, err := os.Stat(filepath.Join(d, lockName))
		if err != nil || time.Since(st.ModTime()) < time.Minute || !ownerless(d) {
			return false
		}
		if pid, _, err := readPostmasterPID(filepath.Join(d, pgdataName, "postmaster.pid")); err == nil && !processGone(pid) {
			return false
		}
	}
	return true
}
