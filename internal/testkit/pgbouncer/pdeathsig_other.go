//go:build unix && !linux

package pgbouncer

import "syscall"

// setPdeathsig does nothing where the kernel has no parent-death signal:
// Cleanup stops PgBouncer.
func setPdeathsig(*syscall.SysProcAttr) {}
