//go:build !linux

package testdb

import "os"

// scratchRoot is where the throwaway cluster lives: the temporary
// directory. (On Linux, /dev/shm when it has room; see scratch_linux.go.)
func scratchRoot() string { return os.TempDir() }
