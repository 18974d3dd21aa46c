package pgbouncer

import "syscall"

// setPdeathsig kills PgBouncer with the test process that started it.
func setPdeathsig(a *syscall.SysProcAttr) { a.Pdeathsig = syscall.SIGKILL }
