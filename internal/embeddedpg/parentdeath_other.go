//go:build unix && !linux

package embeddedpg

import "syscall"

// kernelDeathSignal says that this Unix (macOS among them) has no
// parent-death signal: a watchdog takes the postmaster down when tally dies.
const kernelDeathSignal = false

// setDeathSignal does nothing: there is no parent-death signal to ask for.
func setDeathSignal(*syscall.SysProcAttr, syscall.Signal) {}
