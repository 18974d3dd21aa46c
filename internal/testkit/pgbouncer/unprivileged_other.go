//go:build !unix

package pgbouncer

import "os/exec"

// unprivileged does nothing where there is no root.
func unprivileged(*exec.Cmd, string) error { return nil }
