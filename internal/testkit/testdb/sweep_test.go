package testdb

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestSweepRemovesOnlyAbandonedClusters checks that the sweep removes a
// test cluster's directory whose lock is old and free, and keeps one
// without a lock file (being made), one whose lock is fresh, and another
// program's directory.
func TestSweepRemovesOnlyAbandonedClusters(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	old := time.Now().Add(-2 * time.Minute)
	dir := func(name string, lock bool, at time.Time) string {
		d := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Join(d, "pgdata"), 0o700); err != nil {
			t.Fatal(err)
		}
		if lock {
			p := filepath.Join(d, "tally.lock")
			if err := os.WriteFile(p, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chtimes(p, at, at); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	dead := dir("tally-test-pg-1", true, old)
	deadCitus := dir("tally-test-citus-2", true, old)
	making := dir("tally-test-pg-3", false, old)
	fresh := dir("tally-test-pg-4", true, time.Now())
	other := dir("tally-chaos-5", true, old)

	sweepRoots(root)
	for d, kept := range map[string]bool{dead: false, deadCitus: false, making: true, fresh: true, other: true} {
		_, err := os.Stat(d)
		if kept != (err == nil) {
			t.Errorf("%s: kept %v, want %v (%v)", filepath.Base(d), err == nil, kept, err)
		}
	}
}
