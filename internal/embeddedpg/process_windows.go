package embeddedpg

import (
	"errors"
	"os"
	"syscall"
)

// unsupportedError is what Start returns on Windows, where the embedded
// cluster is not supported. It matches errors.ErrUnsupported.
type unsupportedError struct{}

func (unsupportedError) Error() string {
	return "embeddedpg: the embedded PostgreSQL cluster is not supported on Windows; set TALLY_DATABASE_URL to a PostgreSQL server"
}

func (unsupportedError) Is(target error) bool { return target == errors.ErrUnsupported }

// checkPlatform reports whether Start can run a cluster here: on Windows,
// no.
func checkPlatform() error { return unsupportedError{} }

// kernelDeathSignal is false: Windows has no parent-death signal (and no
// cluster starts here).
const kernelDeathSignal = false

// sysProcAttr is nil: no cluster starts on Windows.
func sysProcAttr(*runAs, syscall.Signal) *syscall.SysProcAttr { return nil }

// killGroup kills the process pid.
func killGroup(pid int) error {
	p, err := os.FindProcess(pid)
	if err != nil {
		return err
	}
	return p.Kill()
}

// processExists reports whether a process pid exists.
func processExists(pid int) bool {
	p, err := os.FindProcess(pid)
	if err != nil {
		return false
	}
	_ = p.Release()
	return true
}

// processGone reports whether pid has exited.
func processGone(pid int) bool { return !processExists(pid) }
