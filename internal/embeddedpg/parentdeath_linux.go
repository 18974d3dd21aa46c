package embeddedpg

import "syscall"

// kernelDeathSignal says that Linux offers a parent-death signal
// (PR_SET_PDEATHSIG): the kernel signals the postmaster when tally dies,
// and no watchdog is needed.
const kernelDeathSignal = true

// setDeathSignal asks the kernel to send sig (unless 0) to the child when
// the thread that forked it exits.
func setDeathSignal(attr *syscall.SysProcAttr, sig syscall.Signal) { attr.Pdeathsig = sig }
