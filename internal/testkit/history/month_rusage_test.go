//go:build unix && !linux

package history_test

import (
	"os"
	"runtime"
	"syscall"
)

// watchPeak reads the exited process's peak resident set from its rusage,
// in bytes. It may count memory the child shared with this process before
// it ran tally.
func watchPeak(int) func(*os.ProcessState) int64 {
	return func(ps *os.ProcessState) int64 {
		ru, ok := ps.SysUsage().(*syscall.Rusage)
		if !ok || ru == nil {
			return 0
		}
		if runtime.GOOS == "darwin" {
			return int64(ru.Maxrss) // bytes there, kilobytes elsewhere
		}
		return int64(ru.Maxrss) * 1024
	}
}
