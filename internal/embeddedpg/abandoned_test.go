//go:build unix

package embeddedpg

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestAbandoned checks that only a directory no process holds, whose
// server has exited and whose lock file is old, counts as abandoned: a
// running cluster, a fresh lock file, a held worker's lock and a directory
// without a lock file do not.
func TestAbandoned(t *testing.T) {
	t.Parallel()
	dir := tempDataDir(t)
	if Abandoned(dir) {
		t.Fatal("a directory without a lock file is abandoned")
	}
	lock := filepath.Join(dir, lockName)
	age := func(path string, d time.Duration) {
		t.Helper()
		at := time.Now().Add(-d)
		if err := os.Chtimes(path, at, at); err != nil {
			t.Fatal(err)
		}
	}

	c := startCluster(t, Config{DataDir: dir, Ephemeral: true, Logger: quietLogger()})
	age(lock, 2*time.Minute)
	if Abandoned(dir) {
		t.Fatal("the directory of a running cluster is abandoned")
	}
	if err := c.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !Abandoned(dir) {
		t.Fatal("the directory of a stopped cluster, its lock old and free, is not abandoned")
	}
	age(lock, 0)
	if Abandoned(dir) {
		t.Fatal("a lock file made a moment ago counts as abandoned")
	}
	age(lock, 2*time.Minute)

	worker := filepath.Join(dir, workerDirPrefix+"1")
	if err := os.MkdirAll(filepath.Join(worker, pgdataName), 0o700); err != nil {
		t.Fatal(err)
	}
	held, err := lockDataDir(worker, filepath.Join(worker, pgdataName))
	if err != nil {
		t.Fatal(err)
	}
	age(filepath.Join(worker, lockName), 2*time.Minute)
	if Abandoned(dir) {
		t.Fatal("a directory whose worker's lock is held is abandoned")
	}
	held.release()
	if !Abandoned(dir) {
		t.Fatal("the directory is not abandoned once its worker's lock is free")
	}
}
