//go:build unix

package config

import (
	"fmt"
	"os"
	"syscall"
)

// OwnerProblem says why a file is not one tally dev made: another owner,
// or a mode that lets group or others at it; "" when it could be.
func OwnerProblem(fi os.FileInfo) string {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
		return fmt.Sprintf("is owned by uid %d, not by this user (uid %d)", st.Uid, os.Getuid())
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return fmt.Sprintf("has mode %04o: group or others may read or change it (tally dev writes 0600)", perm)
	}
	return ""
}
