package history_test

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// watchPeak follows process pid's peak resident set (VmHWM) until the
// returned function is called, after the process exited, and returns it in
// bytes. The kernel's rusage is not used: a child started by clone with
// the parent's memory reports the parent's resident set as its own peak
// until it execs.
func watchPeak(pid int) func(*os.ProcessState) int64 {
	var peak atomic.Int64
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			if kb, ok := vmHWM(pid); ok {
				peak.Store(max(peak.Load(), kb*1024))
			}
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func(*os.ProcessState) int64 {
		close(done)
		<-stopped
		return peak.Load()
	}
}

// vmHWM reads pid's VmHWM in kilobytes.
func vmHWM(pid int) (int64, bool) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}
