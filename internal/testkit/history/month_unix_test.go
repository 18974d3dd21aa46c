//go:build unix

package history_test

import (
	"os"
	"runtime"
	"syscall"
)

// freeBytes is the space an unprivileged user may still write under dir.
func freeBytes(dir string) (int64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * int64(st.Bsize), nil
}

// peakRSS is an exited process's peak resident set, in bytes; 0 when the
// system does not say.
func peakRSS(ps *os.ProcessState) int64 {
	ru, ok := ps.SysUsage().(*syscall.Rusage)
	if !ok {
		return 0
	}
	if runtime.GOOS == "darwin" {
		return ru.Maxrss // bytes there, kilobytes elsewhere
	}
	return ru.Maxrss * 1024
}
