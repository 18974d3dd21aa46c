package testdb

import (
	"os"
	"path/filepath"
	"sync"

	"github.com/tallymeter/tally/internal/embeddedpg"
)

var sweepOnce sync.Once

// sweep removes, once per process, the throwaway clusters under roots that
// test processes which died before their cleanup (a panic, a timeout, a
// kill) left behind: in /dev/shm they would hold memory until the machine
// restarts, and crowd later runs out of it. Only directories no live
// process holds are removed (embeddedpg.Abandoned).
func sweep(roots ...string) {
	sweepOnce.Do(func() { sweepRoots(roots...) })
}

// sweepRoots is sweep, every time.
func sweepRoots(roots ...string) {
	for _, root := range roots {
		for _, pattern := range []string{"tally-test-pg-*", "tally-test-citus-*"} {
			dirs, _ := filepath.Glob(filepath.Join(root, pattern))
			for _, d := range dirs {
				if embeddedpg.Abandoned(d) {
					_ = os.RemoveAll(d)
				}
			}
		}
	}
}
