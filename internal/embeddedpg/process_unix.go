//go:build unix

package embeddedpg

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// checkPlatform reports whether Start can run a cluster here: on Unix, yes.
func checkPlatform() error { return nil }

// sysProcAttr is how initdb, postgres and the watchdog are started: in a
// process group of their own, so that a terminal's Ctrl-C reaches tally
// alone and tally controls the shutdown; as the unprivileged user as when
// tally is root; and, where the kernel offers it (Linux), with deathSignal
// (unless 0) sent to the child when tally's forking thread dies.
func sysProcAttr(as *runAs, deathSignal syscall.Signal) *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{Setpgid: true, Credential: as.credential()}
	setDeathSignal(attr, deathSignal)
	return attr
}

// killGroup sends SIGKILL to the process group that pid leads.
func killGroup(pid int) error { return syscall.Kill(-pid, syscall.SIGKILL) }

// processExists reports whether a process pid exists, whoever owns it.
func processExists(pid int) bool {
	return !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// processGone reports whether pid has exited: there is no such process, or
// it is a zombie nobody has reaped yet (where /proc tells; elsewhere a
// zombie counts as alive).
func processGone(pid int) bool {
	if !processExists(pid) {
		return true
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && (s[i+2] == 'Z' || s[i+2] == 'X')
}
