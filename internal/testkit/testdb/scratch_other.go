//go:build !linux

package testdb

import "os"

// scratchRoot is where the throwaway cluster lives: the temporary
// directory, once the clusters dead processes left there are removed. (On
// Linux, /dev/shm when it has room; see scratch_linux.go.)
func scratchRoot() string {
	sweep(os.TempDir())
	return os.TempDir()
}
